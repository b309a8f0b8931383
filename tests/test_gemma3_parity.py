"""Gemma 3 against transformers on a tiny random-weight checkpoint: greedy tokens equal,
prompt and sampled logprobs within 1e-4 (fp32) — sliding and global layers with their own
rotary, a picture's tokens attending to each other both ways, pan-and-scan crops (each
its own run of tokens) — in every scheduling situation."""

import pytest
import torch

from conftest import HFReference, make_image
from test_qwen2_5_vl_parity import (CASES, IMG_A, IMG_C, assert_all_free, check, check_mixed_chunked_then_preempted,
                                    greedy, request)
from vlmserve import LLM, SamplingParams
from vlmserve.testing.checkpoints import build_gemma3
from vlmserve.worker.step_inputs import StepInputBuilder

PAN_AND_SCAN = {"do_pan_and_scan": True}
# over 1.2:1 with crops of 256 px or more: the picture and two crops, each 16 tokens
WIDE = make_image(600, 280, seed=4)
TALL = make_image(270, 600, seed=5)
CROPS = {"wide": ("Describe the image.", [WIDE]), "wide_and_tall": ("What is in this picture? " * 2, [WIDE, TALL]),
         "crops_and_plain": ("How many shapes are there?", [IMG_A, TALL])}


def gemma(path, **kw):
    return LLM(path, num_kv_blocks=kw.pop("num_kv_blocks", 256), mm_processor_kwargs=PAN_AND_SCAN, **kw)


@pytest.mark.parametrize("case", [*CASES, *CROPS])
def test_single_request_matches_transformers(gemma3_path, hf_gemma3, case):
    text, images = {**CASES, **CROPS}[case]
    out = gemma(gemma3_path).generate(request(hf_gemma3, text, images), greedy(prompt_logprobs=-1))[0]
    check(out, hf_gemma3, text, images, 16, prompt_logprobs=True)


def test_pan_and_scan_crops_are_runs_of_their_own(gemma3_path, hf_gemma3):
    """A wide picture becomes the picture and two crops: three runs of 16 tokens, three
    encoder items; without pan-and-scan (the processor's default), one run."""
    llm = gemma(gemma3_path)
    text, images = CROPS["wide"]
    out = llm.generate(request(hf_gemma3, text, images), greedy(4))[0]
    soft = hf_gemma3.processor.tokenizer.image_token_id
    assert out.prompt_token_ids.count(soft) == 48
    assert llm.engine.engine_core.runner.encoder_runs == 3
    plain_hf = HFReference(gemma3_path)
    plain = LLM(gemma3_path, num_kv_blocks=64).generate(request(plain_hf, text, images), greedy(prompt_logprobs=-1))[0]
    assert plain.prompt_token_ids.count(soft) == 16
    check(plain, plain_hf, text, images, 16, prompt_logprobs=True)


def test_eight_mixed_requests_under_chunked_prefill_then_preempted(gemma3_path, hf_gemma3):
    # steps of 50 tokens stop before the pictures that do not fit whole
    check_mixed_chunked_then_preempted(hf_gemma3, gemma(gemma3_path, max_num_batched_tokens=50),
                                       gemma(gemma3_path, num_kv_blocks=28, max_num_seqs=8))


def test_prefix_cache_hit_ending_inside_a_picture(gemma3_path, hf_gemma3):
    """A second chat about the same picture hits the prefix cache up to a block boundary
    inside the picture's last crop (the block size is chosen so): its remaining tokens
    see the cached ones and each other."""
    first, text = "Describe the image.", "How many shapes are there?"
    ids = [hf_gemma3.inputs(hf_gemma3.prompt(t, 1), [WIDE])["input_ids"][0].tolist() for t in (first, text)]
    common = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    soft = hf_gemma3.processor.tokenizer.image_token_id
    end = max(i for i, t in enumerate(ids[0]) if t == soft) + 1
    last_run = range(end - hf_gemma3.model.config.mm_tokens_per_image + 1, end)  # boundaries strictly inside
    block_size = next(b for b in range(4, 40, 2) if common // b * b in last_run)
    llm = gemma(gemma3_path, block_size=block_size)
    llm.generate(request(hf_gemma3, first, [WIDE]), greedy())
    second = llm.generate(request(hf_gemma3, text, [WIDE]), greedy())[0]  # (prompt logprobs would skip the cache)
    assert second.num_cached_tokens == common // block_size * block_size
    assert llm.engine.engine_core.runner.encoder_runs == 3
    check(second, hf_gemma3, text, [WIDE], 16)
    check(llm.generate(request(hf_gemma3, text, [IMG_C]), greedy())[0], hf_gemma3, text, [IMG_C], 16)
    assert_all_free(llm)


def test_a_step_never_cuts_a_picture(gemma3_path, hf_gemma3):
    """Steps of 48 tokens through six runs of 16 with text between them: each run goes
    whole into a step, the text around them is chunked, the answer is transformers'."""
    llm = gemma(gemma3_path, max_num_batched_tokens=48)
    text, images = CROPS["wide_and_tall"]
    out = llm.generate(request(hf_gemma3, text, images), greedy(prompt_logprobs=-1))[0]
    check(out, hf_gemma3, text, images, 16, prompt_logprobs=True)
    assert_all_free(llm)


def test_without_the_pictures_two_way_attention_the_answer_is_not_transformers(gemma3_path, hf_gemma3, monkeypatch):
    monkeypatch.setattr(StepInputBuilder, "_key_ends", lambda self, step: None)
    text, images = CASES["one_image"]
    out = gemma(gemma3_path).generate(request(hf_gemma3, text, images), greedy(prompt_logprobs=-1))[0]
    with pytest.raises(AssertionError):
        check(out, hf_gemma3, text, images, 16, prompt_logprobs=True)


def test_a_picture_larger_than_a_step_is_refused(gemma3_path, hf_gemma3):
    """Three runs of 16 cannot go into steps of 32 tokens: a clear error, nothing held."""
    llm = gemma(gemma3_path, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="needs 48 tokens"):
        llm.generate(request(hf_gemma3, *CROPS["wide"]), greedy())
    assert_all_free(llm)
    text, images = CASES["one_image"]  # one run of 16: served
    check(llm.generate(request(hf_gemma3, text, images), greedy())[0], hf_gemma3, text, images, 16)


def test_bf16_runs_and_agrees_with_fp32_on_the_first_token(gemma3_path, hf_gemma3):
    text, images = CASES["one_image"]
    fp32 = gemma(gemma3_path, num_kv_blocks=64).generate(request(hf_gemma3, text, images), greedy(1))[0]
    bf16 = gemma(gemma3_path, num_kv_blocks=64, dtype="bfloat16").generate(request(hf_gemma3, text, images),
                                                                           greedy(1))[0]
    assert torch.isfinite(torch.tensor(bf16.outputs[0].logprobs[0].logprobs)).all()
    assert abs(bf16.outputs[0].logprobs[0].logprobs[0] - fp32.outputs[0].logprobs[0].logprobs[0]) < 0.1


@pytest.mark.slow
def test_released_dimensions(tmp_path):
    """Gemma 3 4B's shapes with two layers (a sliding and a global one; MLP widths cut):
    8 query / 4 KV heads of 256, query scale 256^-0.5, window 1024, global rotary theta
    1e6 with linear scaling 8, local 1e4; SigLIP 896 px in patches of 14 (4,096 patches),
    width 1152 in 16 heads, pooled to 256 tokens a picture."""
    path = build_gemma3(tmp_path / "gemma-3-4b", hidden_size=2560, num_layers=2, sliding_pattern=2,
                        sliding_window=1024, num_heads=8, num_kv_heads=4, head_dim=256, intermediate_size=512,
                        vision_hidden=1152, vision_depth=1, vision_heads=16, image_size=896, patch_size=14,
                        mm_tokens_per_image=256, weight_scale=0.1)
    hf = HFReference(str(path), do_pan_and_scan=True)
    llm = gemma(str(path), num_kv_blocks=128)
    for text, images in (CASES["one_image"], CASES["two_images"]):
        out = llm.generate(request(hf, text, images), greedy(8, prompt_logprobs=-1))[0]
        check(out, hf, text, images, 8, prompt_logprobs=True)


@pytest.mark.slow
def test_served_over_the_openai_api(gemma3_path, hf_gemma3):
    """`vlmserve serve` with the Gemma 3 checkpoint, the official client: a picture with
    pan-and-scan asked per request (vLLM's `mm_processor_kwargs`), streamed and not, is
    transformers' greedy answer; a bad setting is a 400 that says what is wrong."""
    import openai

    from test_openai_server import KEY, Server, data_url, image_chat

    server = Server(gemma3_path, "--api-key", KEY)
    try:
        client = server.client()
        kwargs = dict(model="tiny", temperature=0, max_tokens=12, extra_body={"mm_processor_kwargs": PAN_AND_SCAN})
        text, images = CROPS["wide"]
        answer = client.chat.completions.create(messages=image_chat(data_url(WIDE), text), **kwargs)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            messages=image_chat(data_url(WIDE), text), stream=True, **kwargs) if c.choices)
        tokens, _ = hf_gemma3.generate(hf_gemma3.prompt(text, 1), images, 12)
        local = gemma(gemma3_path).chat(image_chat(data_url(WIDE), text), SamplingParams(temperature=0, max_tokens=12))[0]
        assert local.outputs[0].token_ids == tokens  # transformers' answer, and the server's:
        assert answer.choices[0].message.content == streamed == local.outputs[0].text
        assert answer.usage.prompt_tokens == len(hf_gemma3.inputs(hf_gemma3.prompt(text, 1), images)["input_ids"][0])
        with pytest.raises(openai.BadRequestError, match="do_pan_and_scan must be true or false"):
            client.chat.completions.create(messages=image_chat(data_url(WIDE), text), model="tiny", max_tokens=2,
                                           extra_body={"mm_processor_kwargs": {"do_pan_and_scan": "yes"}})
    finally:
        server.stop()
