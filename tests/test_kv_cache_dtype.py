"""--kv-cache-dtype fp8 (vLLM's names): twice the blocks in the same memory, answers close to a
bf16 cache's, a checkpoint's k_scale/v_scale loaded, and the settings that cannot be refused
in one line. The kernels' own checks are test_fp8_kv_kernels.py's (and the Triton ones')."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_image
from vlmserve import LLM, SamplingParams
from vlmserve.core.kv_cache_spec import (FullAttentionSpec, MambaSpec, blocks_for_memory, group_layers,
                                         with_kv_cache_dtype)
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.model_source import SHIPPED_MODEL
from vlmserve.errors import ConfigError
from vlmserve.models.layers import PagedAttention
from vlmserve.training import evaluate


def attention_layers(llm: LLM) -> list[PagedAttention]:
    return [m for m in llm.engine.engine_core.runner.model.modules() if isinstance(m, PagedAttention)]


def test_an_fp8_page_is_half_a_bf16_one():
    """The budget code counts the spec's page size: the attention layers' pages halve, a
    hybrid model's recurrent states keep their dtype and size."""
    specs = {0: FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16),
             1: MambaSpec(block_size=16, conv_shape=(64, 3), ssm_shape=(4, 32, 32), dtype=torch.bfloat16)}
    fp8 = with_kv_cache_dtype(specs, torch.float8_e4m3fn)
    assert fp8[0].page_size_bytes * 2 == specs[0].page_size_bytes and fp8[1] == specs[1]
    budget = 100 << 20
    assert blocks_for_memory(group_layers(fp8), budget) == 2 * blocks_for_memory(group_layers(specs), budget)


def test_an_fp8_cache_holds_twice_the_blocks_in_the_same_memory(qwen25_path):
    counts = {}
    for name in ("auto", "fp8", "fp8_e4m3"):
        llm = LLM(qwen25_path, dtype="bfloat16", kv_cache_memory_gb=0.01, kv_cache_dtype=name)
        counts[name] = llm.engine.core.info.num_kv_blocks
        caches = {tensor.dtype for pair in llm.engine.engine_core.runner.kv_caches.values() for tensor in pair}
        assert caches == {torch.bfloat16 if name == "auto" else torch.float8_e4m3fn}
    assert counts["fp8"] == counts["fp8_e4m3"] in (2 * counts["auto"], 2 * counts["auto"] + 1)


def test_the_shipped_model_answers_its_held_out_questions_as_with_a_bf16_cache():
    """A trained model (Qwen3.5's hybrid: attention layers in FP8, recurrent states as
    they were) on questions training never saw: the same accuracy and nearly every
    greedy answer the same; where answers agree, their tokens' logprobs within 0.1
    (benchmarks/kv_cache_drift.py, 608 questions: every answer the same, the largest
    difference 0.058 over 12,589 tokens, the mean 1e-5)."""
    items = evaluate.held_out_set(6, 1, video_captions=1)
    params = SamplingParams(temperature=0, max_tokens=evaluate.MAX_TOKENS, logprobs=0)
    outs = {name: [o.outputs[0] for o in LLM(str(SHIPPED_MODEL), dtype="bfloat16", kv_cache_dtype=name)
                   .chat([evaluate.chat_for(i) for i in items], params)] for name in ("auto", "fp8")}
    scores = {name: sum(g for g, _ in evaluate.score(items, [o.text for o in out]).values())
              for name, out in outs.items()}
    assert abs(scores["fp8"] - scores["auto"]) <= 1
    same = [a.token_ids == b.token_ids for a, b in zip(outs["auto"], outs["fp8"])]
    assert sum(same) >= 0.9 * len(items)
    for a, b, equal in zip(outs["auto"], outs["fp8"], same):
        if equal:
            assert max(abs(x.logprobs[0] - y.logprobs[0]) for x, y in zip(a.logprobs, b.logprobs)) < 0.1


def test_a_random_checkpoint_parts_from_bf16_only_where_its_top_tokens_are_close(qwen25_path):
    """A random model's greedy answers hinge on small margins. FP8 keeps 3 mantissa bits
    (each value within 2^-4 of itself): on this 3-layer fp32 model the chosen tokens'
    logprobs move by up to 0.16 (bf16 weights instead of fp32 move them by up to 0.08), so
    the answers agree wherever the reference's two best tokens are over 2 x 0.25 apart,
    and where they part, the reference's two best were within that."""
    bound = 0.25
    prompts = [{"prompt": f"<|vision_start|><|image_pad|><|vision_end|>Describe picture {i}.",
                "multi_modal_data": {"image": make_image(96 + 16 * i, 72, seed=i)}} for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    ref, got = ([o.outputs[0] for o in LLM(qwen25_path, num_kv_blocks=256, kv_cache_dtype=name)
                 .generate(prompts, params)] for name in ("auto", "fp8"))
    for a, b in zip(ref, got):
        for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            if a.token_ids[i] != b.token_ids[i]:
                assert x.logprobs[1] - x.logprobs[2] < 2 * bound  # the two best were close
                break
            assert abs(x.logprobs[0] - y.logprobs[0]) < bound


def with_kv_scales(src: str, dst, scales: dict[str, torch.Tensor]) -> str:
    """A copy of a checkpoint with KV cache scales added under the given names."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    save_file({**weights, **scales}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_a_checkpoints_kv_scales_are_loaded_and_used(qwen25_path, tmp_path):
    """vLLM's names for them: k_scale and v_scale per layer, a single kv_scale for both, the
    older k_proj/v_proj output_scale; a query scale is passed over. An FP8 cache quantizes
    by them; a bf16 cache ignores them (vLLM: 1.0 under auto)."""
    k0, v0, kv1, k2 = (torch.tensor(x) for x in (0.3, 0.45, [0.2], 1.5))
    path = with_kv_scales(qwen25_path, tmp_path / "scaled", {
        "model.layers.0.self_attn.k_scale": k0, "model.layers.0.self_attn.v_scale": v0,
        "model.layers.1.self_attn.kv_scale": kv1, "model.layers.2.self_attn.k_proj.output_scale": k2,
        "model.layers.2.self_attn.q_scale": torch.tensor(3.0)})
    image = make_image(96, 72, seed=1)
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe it.", "multi_modal_data": {"image": image}}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    scaled = LLM(path, num_kv_blocks=64, kv_cache_dtype="fp8")
    assert [(m.k_scale, m.v_scale) for m in attention_layers(scaled)] == \
        [(k0.item(), v0.item()), (kv1.item(), kv1.item()), (k2.item(), 1.0)]
    plain = LLM(qwen25_path, num_kv_blocks=64, kv_cache_dtype="fp8")
    assert [m.logprobs[0] for m in scaled.generate(prompt, params)[0].outputs[0].logprobs] != \
        [m.logprobs[0] for m in plain.generate(prompt, params)[0].outputs[0].logprobs]
    bf16 = [LLM(p, num_kv_blocks=64).generate(prompt, params)[0].outputs[0] for p in (path, qwen25_path)]
    assert bf16[0].token_ids == bf16[1].token_ids and \
        [e.logprobs for e in bf16[0].logprobs] == [e.logprobs for e in bf16[1].logprobs]


def test_scales_per_head_are_refused_with_an_fp8_cache_alone(qwen25_path, tmp_path):
    """A bf16 cache ignores the checkpoint's scales, per head or not (vLLM: 1.0 under auto)."""
    path = with_kv_scales(qwen25_path, tmp_path / "per-head", {"model.layers.0.self_attn.k_scale": torch.ones(2)})
    with pytest.raises(ConfigError, match="per head .*use --kv-cache-dtype auto"):
        LLM(path, num_kv_blocks=64, kv_cache_dtype="fp8")
    LLM(path, num_kv_blocks=64)


@pytest.mark.parametrize("name", ["fp8_e5m2", "int8", "bfloat16"])
def test_a_kv_cache_dtype_vlmserve_has_not_is_one_line(name):
    with pytest.raises(ConfigError, match=f"--kv-cache-dtype {name}: auto or fp8 or fp8_e4m3"):
        EngineArgs(kv_cache_dtype=name).check_settings()


def test_the_cli_refuses_it_before_loading_anything(tmp_path):
    result = subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", "caption", "--kv-cache-dtype",
                             "fp8_e5m2", "--out", str(tmp_path / "c.jsonl"), str(tmp_path / "none.png")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--kv-cache-dtype fp8_e5m2: auto or fp8 or fp8_e4m3" in result.stderr


def test_a_gpu_without_fp8_conversions_is_refused(monkeypatch):
    """The Triton kernels read an FP8 cache by the GPU's own conversion: compute capability
    8.9 and later (an A100 is 8.0). The CUDA functions stand in for such a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError, match=r"compute capability 8\.0\) has no FP8 conversions"):
        EngineArgs(device="cuda", kv_cache_dtype="fp8").check_device()
    EngineArgs(device="cuda").check_device()  # auto: the model's dtype, any GPU
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    EngineArgs(device="cuda", kv_cache_dtype="fp8").check_device()


@pytest.mark.slow
def test_an_fp8_cache_on_two_ranks_gives_one_ranks_outputs(qwen25_path, hf_qwen25):
    """Tensor parallelism over an FP8 cache: each rank quantizes its own KV heads by the
    same per-tensor scales, so two gloo ranks give one rank's tokens and logprobs (fp32
    sums in another order may move a value across an FP8 rounding edge: 1e-3, not 1e-4)."""
    from test_tensor_parallel import assert_same, runs

    results, _ = runs(qwen25_path, hf_qwen25, [{"num_kv_blocks": 256, "kv_cache_dtype": "fp8"}])
    assert_same(results[1][0], results[2][0], atol=1e-3)
