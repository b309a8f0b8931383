"""The Python API: chat with images from every source, outputs, sampling, errors."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import data_url, make_image, png_bytes
from vlmserve import LLM, SamplingParams
from vlmserve.errors import ConfigError

IMG = make_image(130, 100, seed=1)


@pytest.fixture(scope="module")
def llm(qwen25_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "pic.png").write_bytes(png_bytes(IMG))
    engine = LLM(qwen25_path, num_kv_blocks=256, allowed_local_media_path=str(folder))
    engine.media_folder = folder
    return engine


def chat(image_part, text="Describe the image."):
    return [{"role": "user", "content": [image_part, {"type": "text", "text": text}]}]


def test_chat_takes_pil_path_and_data_url_alike(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10)
    by_pil = llm.chat(chat({"type": "image", "image": IMG}), greedy)[0]
    by_path = llm.chat(chat({"type": "image_url", "image_url": {"url": str(llm.media_folder / "pic.png")}}), greedy)[0]
    by_file_url = llm.chat(chat({"type": "image_url", "image_url": {"url": "file://" + str(llm.media_folder / "pic.png")}}), greedy)[0]
    by_data = llm.chat(chat({"type": "image_url", "image_url": {"url": data_url(IMG)}}), greedy)[0]
    texts = {o.outputs[0].text for o in (by_pil, by_path, by_file_url, by_data)}
    assert len(texts) == 1 and texts.pop()
    for out in (by_pil, by_path, by_data):
        c = out.outputs[0]
        assert c.token_ids and c.finish_reason in ("stop", "length")
        assert out.num_prompt_tokens > 20 and out.finished
    # the file and the data URL carry the same bytes: same mm_hash, so the prefix cache hits
    assert by_data.num_cached_tokens > 0


def test_generate_outputs_and_finish_reasons(llm):
    outs = llm.generate(["Hello world", "The quick brown fox"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for out in outs:
        c = out.outputs[0]
        assert len(c.token_ids) == 3 and c.finish_reason == "length"
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_reproducible_and_n_gives_distinct_samples(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=12, n=3, ignore_eos=True)
    a = llm.generate("Describe the image.", params)[0]
    b = llm.generate(["Hello", "Describe the image."], [SamplingParams(max_tokens=5), params])[1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len(a.outputs) == 3 and len({tuple(c.token_ids) for c in a.outputs}) > 1
    assert [c.index for c in a.outputs] == [0, 1, 2]


def test_stop_string_is_cut_exactly(llm):
    free = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop = free.text[5:8]
    assert stop and stop in free.text
    cut = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.text == free.text[: free.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == free.text[: free.text.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[4]
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # below min_tokens the stop token cannot even be sampled
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                    stop_token_ids=[stop_id], min_tokens=12))[0].outputs[0]
    assert len(out.token_ids) == 12 and stop_id not in out.token_ids


def test_logprobs_are_consistent(llm):
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=5, logprobs=4))[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_ids[0] == token and entry.rank == 1  # greedy picks the top token
        assert len(entry.token_ids) == 5
        assert entry.logprobs[1:] == sorted(entry.logprobs[1:], reverse=True)
        assert abs(entry.logprobs[0] - entry.logprobs[1]) < 1e-6


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, "not a readable image"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
        ({"type": "image_url", "image_url": {"url": "/etc/passwd"}}, "outside the allowed media folder"),
        ({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, "http"),
        ({"type": "audio", "audio": "x"}, "unsupported content part"),
    ],
)
def test_bad_input_fails_clearly_and_leaves_nothing_behind(llm, bad, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(chat(bad))
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not any(engine.stats().blocks_in_use.values())
    ok = llm.chat(chat({"type": "image", "image": IMG}), SamplingParams(temperature=0, max_tokens=3))[0]
    assert ok.outputs[0].token_ids


def test_prompt_longer_than_the_context_is_refused(qwen25_path):
    llm = LLM(qwen25_path, num_kv_blocks=256, max_model_len=64)
    with pytest.raises(ValueError, match="context is 64 tokens"):
        llm.generate("Hello world " * 40)  # 80 tokens, found by tokenizing
    with pytest.raises(ValueError, match=r"characters, more than the model's context of 64 tokens"):
        llm.generate("Hello world " * 10_000)  # refused from its length alone
    # short text, but a picture whose tokens take it over the context
    with pytest.raises(ValueError, match="media included"):
        llm.chat(chat({"type": "image", "image": make_image(224, 224, 3)}))
    assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].finished


def test_prompt_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.hf_config.text_config.vocab_size
    for bad in ([1, 2, vocab], [-1, 5]):
        with pytest.raises(ValueError, match="not a token id of this model"):
            llm.generate({"prompt_token_ids": bad})
    assert llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2))[0].finished


def test_a_fault_in_the_model_fails_its_step_and_poisons_no_cache(llm):
    """The requests of a step whose forward raised end with finish reason "error"; nothing
    that step was to compute (KV blocks, the picture's encoder output) is reused later."""
    picture = chat({"type": "image", "image": make_image(90, 70, 21)})
    greedy = SamplingParams(temperature=0, max_tokens=6)
    engine = llm.engine
    assert engine.reset_caches()
    expected = llm.chat(picture, greedy)[0].outputs[0].text
    assert engine.reset_caches()
    runner = engine.engine_core.runner
    forward = runner.model.forward
    runner.model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("simulated fault"))
    try:
        failed = llm.chat(picture, greedy)[0]
    finally:
        runner.model.forward = forward
    assert failed.outputs[0].finish_reason == "error" and "simulated fault" in failed.error
    assert not any(engine.stats().blocks_in_use.values()) and not engine.has_unfinished_requests()
    again = llm.chat(picture, greedy)[0]
    assert again.num_cached_tokens == 0  # the failed step's blocks were not kept for the prefix cache
    assert again.outputs[0].text == expected


def test_too_many_placeholders_or_images_is_refused(llm):
    with pytest.raises(ValueError, match="1 image placeholder"):
        llm.generate({"prompt": "<|image_pad|> hi", "multi_modal_data": {"image": [IMG, IMG]}})



NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@NO_CUDA
@pytest.mark.parametrize("flags,env,says", [
    (["--device", "cuda"], {}, "no CUDA device on this machine"),
    (["--device", "tpu"], {}, "vlmserve runs on cpu or cuda"),
])
def test_a_device_this_machine_lacks_is_one_line_not_a_traceback(flags, env, says):
    proc = subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", *flags],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and says in proc.stderr, proc.stderr


def test_the_triton_interpreter_is_turned_on_where_the_triton_kernels_run_on_the_cpu():
    """Not at import, nor by the environment beforehand: by the kernel table the engine
    asks for, before the Triton kernels are first defined."""
    code = ("import os, vlmserve, vlmserve.engine.args; assert 'TRITON_INTERPRET' not in os.environ; "
            "from vlmserve.kernels import kernel_table; kernel_table('cpu', triton=True); "
            "from vlmserve.kernels import triton_attention; "
            "print(os.environ['TRITON_INTERPRET'], type(triton_attention.dot_precision).__name__, "
            "type(triton_attention._paged_attention_kernel).__name__)")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "VLMSERVE_USE_TRITON")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split()[0] == "1" and out.stdout.split()[-1] == "InterpretedFunction", out.stderr


@NO_CUDA
def test_llm_on_a_missing_device_raises_a_config_error():
    with pytest.raises(ConfigError, match="no CUDA device"):
        LLM(device="cuda")
