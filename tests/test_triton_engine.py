"""The GPU path end to end, without a GPU: the engine with every op on its Triton kernel
(paged attention, KV writes, the vision tower's varlen attention, norms, rotary, the
gated delta rule and its convolution), run by Triton's interpreter on CPU tensors, against
transformers in fp32 — the same tokens and logprobs as the parity tests ask of the CPU
kernels. With VLMSERVE_TEST_DEVICE=cuda the same engines run on a GPU, compiled
(benchmarks/gpu_check.py); what only a GPU can show (bf16, speed) is in that check."""

from __future__ import annotations

import pytest

from conftest import TEST_DEVICE
from test_qwen2_5_vl_parity import CASES, check, greedy, mixed_requests, request, run_together
from vlmserve import LLM
from vlmserve.kernels import ops
from vlmserve.kernels.triton_attention import paged_attention_triton

pytestmark = pytest.mark.slow  # the interpreter runs each program in numpy
request_of = request  # the helper, under a name pytest's `request` fixture does not shadow


@pytest.fixture
def triton_llm():
    """Builds engines on the Triton kernels (each engine's own kernel table: the CPU
    kernels stay the default outside it)."""

    def make(path, **kwargs):
        llm = LLM(path, dtype="float32", use_triton=True, num_kv_blocks=256, device=TEST_DEVICE, **kwargs)
        assert llm.engine.engine_core.runner.kernels.paged_attention is paged_attention_triton
        assert ops.paged_attention is not paged_attention_triton
        return llm

    return make


def test_qwen2_5_vl_on_triton_kernels(triton_llm, qwen25_path, hf_qwen25):
    """Full and sliding-window attention, a mixed batch with pictures, a prefix hit."""
    llm = triton_llm(qwen25_path)
    specs, prompts, _ = mixed_requests(hf_qwen25)
    # a few answer tokens each: the interpreter runs every decode step's programs in numpy
    specs = [(text, images, min(n, 5)) for text, images, n in specs[:4]]
    params = [greedy(n, prompt_logprobs=-1) for _, _, n in specs]
    for out, (text, images, n) in zip(run_together(llm, prompts[:4], params), specs):
        check(out, hf_qwen25, text, images, n)
    text, images = CASES["one_image"]
    out = llm.generate(request(hf_qwen25, text, images), greedy(max_tokens=6))[0]  # seen before: cached
    check(out, hf_qwen25, text, images, 6)
    assert sum(llm.engine.stats().prefix_cache_hits) > 0


def test_an_fp8_kv_cache_on_triton_kernels_gives_the_cpu_kernels_answers(triton_llm, qwen25_path, hf_qwen25):
    """--kv-cache-dtype fp8 through the Triton kernels (written by their integer rounding,
    read by the GPU's conversion, here the interpreter's), a mixed batch with a prefix hit:
    the tokens and logprobs of the CPU kernels over the same FP8 cache (the same bytes, fp32
    sums in another order)."""
    llm = triton_llm(qwen25_path, kv_cache_dtype="fp8")
    cpu = LLM(qwen25_path, dtype="float32", num_kv_blocks=256, kv_cache_dtype="fp8")
    specs, prompts, _ = mixed_requests(hf_qwen25)
    prompts = prompts[:3] + prompts[:1]  # the last one hits the first one's blocks
    params = [greedy(4) for _ in prompts]
    for got, want in zip(run_together(llm, prompts, params), run_together(cpu, prompts, params)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert abs(a.logprobs[0] - b.logprobs[0]) < 1e-4
    assert sum(llm.engine.stats().prefix_cache_hits) > 0


def test_qwen3_5_on_triton_kernels(triton_llm, qwen35_path, hf_qwen35):
    """Gated DeltaNet and gated attention; chunked prefill through two pictures."""
    llm = triton_llm(qwen35_path, max_num_batched_tokens=24)
    text, images = CASES["two_images"]
    out = llm.generate(request(hf_qwen35, text, images), greedy(max_tokens=6))[0]
    check(out, hf_qwen35, text, images, 6)


def test_speculative_decoding_on_triton_kernels(triton_llm, qwen35_path, hf_qwen35):
    """Drafts checked by the Triton kernels: verification queries through paged attention,
    the delta rule and the conv writing their per-draft checkpoints; kept and refused
    drafts (the oracle proposer of the speculative-decoding tests) give transformers'
    tokens."""
    from test_spec_decode import NGRAM, with_oracle

    text, images = CASES["one_image"]
    plain = LLM(qwen35_path, num_kv_blocks=256).generate(request(hf_qwen35, text, images), greedy(max_tokens=10))
    llm = with_oracle(triton_llm(qwen35_path, speculative_config=NGRAM), plain)
    out = llm.generate(request(hf_qwen35, text, images), greedy(max_tokens=10))[0]
    check(out, hf_qwen35, text, images, 10)
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_draft_model_on_triton_kernels(triton_llm, qwen35_path, hf_qwen35):
    """A hybrid draft model (the target drafting for itself) on the Triton kernels: its
    catch-up over a picture prompt, its guesses in scratch state slots; every guess kept,
    transformers' tokens."""
    from test_spec_decode import acceptance, draft_settings

    text, images = CASES["one_image"]
    llm = triton_llm(qwen35_path, speculative_config=draft_settings(qwen35_path))
    out = llm.generate(request(hf_qwen35, text, images), greedy(max_tokens=10))[0]
    check(out, hf_qwen35, text, images, 10)
    drafted, accepted = acceptance(llm)
    assert drafted > 0 and accepted == drafted


@pytest.mark.parametrize("family", ["qwen3vl", "qwen3vlmoe"])
def test_qwen3_vl_on_triton_kernels(triton_llm, family, request):
    """Qwen3 attention (q/k norms), DeepStack and the experts; chunked prefill through two
    pictures."""
    path, hf = request.getfixturevalue(f"{family}_path"), request.getfixturevalue(f"hf_{family}")
    llm = triton_llm(path, max_num_batched_tokens=24)
    text, images = CASES["two_images"]
    out = llm.generate(request_of(hf, text, images), greedy(max_tokens=6))[0]
    check(out, hf, text, images, 6)


def test_gemma3_on_triton_kernels(triton_llm, gemma3_path, hf_gemma3):
    """Sliding and global layers, pictures and pan-and-scan crops whose tokens see each
    other (the kernel's key_ends), steps that stop before a picture."""
    from test_gemma3_parity import CROPS, PAN_AND_SCAN

    llm = triton_llm(gemma3_path, max_num_batched_tokens=48, mm_processor_kwargs=PAN_AND_SCAN)
    text, images = CROPS["crops_and_plain"]
    out = llm.generate(request(hf_gemma3, text, images), greedy(max_tokens=6))[0]
    check(out, hf_gemma3, text, images, 6)


def test_a_published_int4_checkpoint_on_triton_kernels(triton_llm, tmp_path):
    """An AWQ checkpoint's int4 layers through the Triton quantized matmul: the tokens and
    logprobs transformers gives on the weights the checkpoint stands for."""
    from conftest import HFReference, make_image
    from vlmserve.kernels.triton_quantized_linear import quantized_linear_triton
    from vlmserve.testing.checkpoints import build_qwen2_5_vl
    from vlmserve.testing.quantized_checkpoints import write_awq

    source = build_qwen2_5_vl(tmp_path / "source", hidden_size=128, intermediate_size=256, num_layers=2)
    quantized, reference = write_awq(source, tmp_path / "awq")
    llm = triton_llm(str(quantized))
    assert llm.engine.engine_core.runner.kernels.quantized_linear is quantized_linear_triton
    hf = HFReference(str(reference))
    text, images = "Describe the image.", [make_image(100, 80, seed=5)]
    out = llm.generate(request(hf, text, images), greedy(max_tokens=6))[0]
    check(out, hf, text, images, 6)
