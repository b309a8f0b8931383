"""Qwen3-VL (dense, DeepStack): vlmserve vs transformers on a tiny random-weight
checkpoint — greedy tokens equal, prompt and sampled logprobs within 1e-4 (fp32) — in
every scheduling situation. (Video: tests/test_media.py.)"""

import pytest
import torch

from test_qwen2_5_vl_parity import CASES, IMG_A, IMG_C, check, greedy, mixed_requests, request, run_together
from vlmserve import LLM
from vlmserve.models.qwen3_vl import Qwen3VLForConditionalGeneration


@pytest.fixture(scope="module")
def llm(qwen3vl_path):
    return LLM(qwen3vl_path, num_kv_blocks=256)


def assert_all_free(llm):
    assert not any(llm.engine.stats().blocks_in_use.values())


@pytest.mark.parametrize("case", CASES)
def test_single_request_matches_transformers(llm, hf_qwen3vl, case):
    text, images = CASES[case]
    out = llm.generate(request(hf_qwen3vl, text, images), greedy(prompt_logprobs=-1))[0]
    check(out, hf_qwen3vl, text, images, 16, prompt_logprobs=True)
    assert_all_free(llm)


def test_the_encoder_cache_keeps_every_deepstack_level(qwen3vl_path, hf_qwen3vl):
    llm = LLM(qwen3vl_path, num_kv_blocks=256)
    llm.generate(request(hf_qwen3vl, "Describe the image.", [IMG_A]), greedy(2))
    (features,) = llm.engine.engine_core.runner.encoder_cache.values()
    hidden = hf_qwen3vl.model.config.text_config.hidden_size
    levels = 1 + len(hf_qwen3vl.model.config.vision_config.deepstack_visual_indexes)
    assert features.shape[1] == levels * hidden == 3 * hidden


def test_without_deepstack_the_answer_is_not_transformers(qwen3vl_path, hf_qwen3vl, monkeypatch):
    """The parity above depends on DeepStack: with its levels dropped, the logprobs move."""
    text, images = CASES["one_image"]

    def last_level_only(self, embeds, token_index, mm_embeds):
        embeds.index_copy_(0, token_index, mm_embeds[:, : embeds.shape[-1]].to(embeds.dtype))
        return None

    monkeypatch.setattr(Qwen3VLForConditionalGeneration, "merge_multimodal", last_level_only)
    out = LLM(qwen3vl_path, num_kv_blocks=256).generate(request(hf_qwen3vl, text, images), greedy(prompt_logprobs=-1))[0]
    with pytest.raises(AssertionError):
        check(out, hf_qwen3vl, text, images, 16, prompt_logprobs=True)


def test_eight_mixed_requests_together(llm, hf_qwen3vl):
    specs, prompts, params = mixed_requests(hf_qwen3vl)
    outs = run_together(llm, prompts, params)
    for out, (text, images, n) in zip(outs, specs):
        check(out, hf_qwen3vl, text, images, n, prompt_logprobs=True)
    assert_all_free(llm)


def test_chunked_prefill_through_an_image(qwen3vl_path, hf_qwen3vl):
    """Steps of 5 tokens cut each picture (and its DeepStack levels) into pieces."""
    llm = LLM(qwen3vl_path, num_kv_blocks=256, max_num_batched_tokens=5)
    text, images = CASES["two_images"]
    out = llm.generate(request(hf_qwen3vl, text, images), greedy(prompt_logprobs=-1))[0]
    check(out, hf_qwen3vl, text, images, 16, prompt_logprobs=True)
    assert llm.engine.engine_core.runner.encoder_runs == 2
    assert_all_free(llm)


def test_prefix_cache_hit_reuses_kv_and_skips_the_encoder(qwen3vl_path, hf_qwen3vl):
    llm = LLM(qwen3vl_path, num_kv_blocks=256)
    text = "Describe the image. " * 3
    first = llm.generate(request(hf_qwen3vl, text, [IMG_A]), greedy())[0]
    second = llm.generate(request(hf_qwen3vl, text, [IMG_A]), greedy())[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert llm.engine.engine_core.runner.encoder_runs == 1
    check(second, hf_qwen3vl, text, [IMG_A], 16)
    other = llm.generate(request(hf_qwen3vl, text, [IMG_C]), greedy())[0]
    assert llm.engine.engine_core.runner.encoder_runs == 2
    check(other, hf_qwen3vl, text, [IMG_C], 16)


def test_preemption_with_a_tiny_kv_cache(qwen3vl_path, hf_qwen3vl):
    llm = LLM(qwen3vl_path, num_kv_blocks=24, max_num_seqs=8)
    specs, prompts, params = mixed_requests(hf_qwen3vl)
    outs = run_together(llm, prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    for out, (text, images, n) in zip(outs, specs):
        check(out, hf_qwen3vl, text, images, n, prompt_logprobs=True)
    assert_all_free(llm)


def test_bf16_runs_and_agrees_with_fp32_on_the_first_token(qwen3vl_path, hf_qwen3vl):
    text, images = CASES["one_image"]
    fp32 = LLM(qwen3vl_path, num_kv_blocks=64).generate(request(hf_qwen3vl, text, images), greedy(1))[0]
    bf16 = LLM(qwen3vl_path, num_kv_blocks=64, dtype="bfloat16").generate(request(hf_qwen3vl, text, images),
                                                                           greedy(1))[0]
    assert torch.isfinite(torch.tensor(bf16.outputs[0].logprobs[0].logprobs)).all()
    assert abs(bf16.outputs[0].logprobs[0].logprobs[0] - fp32.outputs[0].logprobs[0].logprobs[0]) < 0.1


@pytest.mark.slow
def test_released_dimensions(tmp_path):
    """Qwen3-VL-2B's shapes with few layers: text head size 128 (16 query / 8 KV heads),
    M-RoPE sections [24, 20, 20], theta 5e6; vision width 1024 in 16 heads, a 48 x 48
    position table, three DeepStack levels."""
    from conftest import HFReference
    from vlmserve.testing.checkpoints import build_qwen3_vl

    path = str(build_qwen3_vl(
        tmp_path / "qwen3vl-2b-shapes", hidden_size=2048, num_layers=2, num_heads=16, num_kv_heads=8, head_dim=128,
        intermediate_size=1024, vision_hidden=1024, vision_depth=3, vision_heads=16, vision_intermediate=1024,
        num_position_embeddings=2304, deepstack_indexes=(0, 1, 2), rope_theta=5e6, mrope_section=[24, 20, 20],
        weight_scale=0.1))
    hf = HFReference(path)
    llm = LLM(path, num_kv_blocks=64)
    for text, images in (CASES["one_image"], CASES["two_images"]):
        out = llm.generate(request(hf, text, images), greedy(8, prompt_logprobs=-1))[0]
        check(out, hf, text, images, 8, prompt_logprobs=True)
