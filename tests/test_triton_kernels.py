"""Every Triton kernel against the torch version of its op.

Here (no GPU) Triton's interpreter runs them on CPU tensors, in fp32 on small shapes (the
interpreter has no bf16 dot). With VLMSERVE_TEST_DEVICE=cuda (benchmarks/gpu_check.py on
a GPU machine) the same tests run compiled on CUDA tensors in fp32 and bf16, and the
cases at real widths run too: head sizes 128 and 256, GQA 8, blocks of 16 and 32,
32k-token sequences in a cache pool past 2^31 elements (32-bit offsets would wrap), and
Qwen3.5's delta-rule heads over a 4k-token prefill.

Tolerances: fp32 2e-5 for attention, norms, rotary and silu-and-mul; 1e-4 for the delta
rule (chunked forms and a recurrence against each other); bf16 2e-2 (outputs rounded to
bf16, the dots in tf32).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import TEST_DEVICE
from test_kernels import assert_equals_dense, bidirectional_case, dense_attention, paged_case
from vlmserve.kernels import attention, gdn, linear, norms, rotary
from vlmserve.kernels import (  # conftest turned the interpreter on (on the CPU)
    triton_attention,
    triton_elementwise,
    triton_gdn,
    triton_quantized_linear,
)
from vlmserve.kernels.quantized_linear import QuantizedWeight, dequantize, quantize
from vlmserve.testing.quantized_checkpoints import fp8_blocks
from vlmserve.models.layers import mrope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.slow  # the interpreter runs each program in numpy

DEVICE = torch.device(TEST_DEVICE)
ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]
gpu_only = pytest.mark.skipif(not ON_GPU, reason="real widths run on a GPU (VLMSERVE_TEST_DEVICE=cuda)")


def on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(DEVICE) for t in tensors)


def upload(name: str, array: np.ndarray) -> torch.Tensor:
    """Step metadata on the test device (the runner's staging does this on a GPU)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(DEVICE)


def tol(dtype: torch.dtype, fp32: float) -> dict[str, float]:
    return dict(atol=fp32, rtol=fp32) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
def test_paged_attention(block_size, window, q_heads, kv_heads, dtype):
    """Decodes, a fresh prefill, a chunk over a cached prefix, one crossing several query
    tiles; the tables' padding is the null block; a window edge inside a block."""
    torch.manual_seed(0)
    d = 16
    num_computed = [0, 7, 33, 0, 40, 5]
    query_lens = [1, 1, 1, 23, 17, 40]
    k_cache, v_cache, tables, history, new_k, new_v = paged_case(num_computed, query_lens, kv_heads, d, block_size,
                                                                 num_blocks=64, dtype=dtype)
    meta = attention.build_attention_metadata(tables, num_computed, query_lens, block_size, window, upload)
    q = torch.randn(sum(query_lens), q_heads, d).to(dtype)
    out = triton_attention.paged_attention_triton(*on_device(q, new_k, new_v, k_cache, v_cache), meta, d**-0.5)
    start = 0
    for (keys, values), n in zip(history, query_lens):
        ref = dense_attention(q[start : start + n], torch.cat([keys, new_k[start : start + n]]),
                              torch.cat([values, new_v[start : start + n]]), d**-0.5, window)
        torch.testing.assert_close(out[start : start + n].cpu().double(), ref, **tol(dtype, 2e-5))
        start += n


@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_with_pictures_that_attend_both_ways(window):
    num_computed, query_lens, case, key_ends = bidirectional_case(16)
    k_cache, v_cache, tables, history, new_k, new_v = case
    meta = attention.build_attention_metadata(tables, num_computed, query_lens, 16, window, upload,
                                              key_ends=np.concatenate(key_ends))
    q = torch.randn(sum(query_lens), 4, 16, generator=torch.Generator().manual_seed(3))
    out = triton_attention.paged_attention_triton(*on_device(q, new_k, new_v, k_cache, v_cache), meta, 0.25)
    assert_equals_dense(out.cpu(), q, history, new_k, new_v, query_lens, 0.25, window, key_ends)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_cache_write_and_varlen_attention(dtype):
    torch.manual_seed(1)
    k_shape, v_shape = attention.kv_cache_shapes(8, 16, 2, 16)
    caches = [torch.zeros(k_shape, dtype=dtype, device=DEVICE), torch.zeros(v_shape, dtype=dtype, device=DEVICE)]
    ref = [torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)]
    slots = torch.tensor([17, 3, 100, 80, 81, 16])
    k, v = torch.randn(6, 2, 16).to(dtype), torch.randn(6, 2, 16).to(dtype)
    triton_attention.write_kv_cache_triton(*on_device(k, v), *caches, slots.to(DEVICE))
    attention.write_kv_cache(k, v, *ref, slots)
    assert torch.equal(caches[0].cpu(), ref[0]) and torch.equal(caches[1].cpu(), ref[1])
    # a padding row of a CUDA graph's batch (slot -1) writes nothing
    triton_attention.write_kv_cache_triton(*on_device(k[:1] + 1, v[:1] + 1), *caches, torch.tensor([-1]).to(DEVICE))
    assert torch.equal(caches[0].cpu(), ref[0]) and torch.equal(caches[1].cpu(), ref[1])
    seq_lens = [7, 40, 1, 16]
    q, kk, vv = (torch.randn(sum(seq_lens), 4, 16).to(dtype) for _ in range(3))
    out = triton_attention.varlen_attention_triton(*on_device(q, kk, vv), seq_lens, 0.25)
    torch.testing.assert_close(out.cpu().float(), attention.varlen_attention(q.float(), kk.float(), vv.float(),
                                                                             seq_lens, 0.25), **tol(dtype, 2e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 2.0)])
def test_fp8_kv_cache_write_quantizes_as_torch_does(dtype, k_scale, v_scale):
    """Byte for byte against the portable write (its integer arithmetic, not the
    interpreter's conversion): ties to even, subnormals, values past +-448 saturated, NaN."""
    k_shape, v_shape = attention.kv_cache_shapes(8, 16, 2, 16)
    caches = [torch.zeros(shape, dtype=attention.FP8_KV_DTYPE, device=DEVICE) for shape in (k_shape, v_shape)]
    ref = [torch.zeros(shape, dtype=attention.FP8_KV_DTYPE) for shape in (k_shape, v_shape)]
    slots = torch.tensor([17, 3, 100, 80, 81, 16])
    k, v = torch.randn(6, 2, 16) * 4, torch.randn(6, 2, 16)
    special = torch.tensor([2.625, -2.625, 0.65625, 5.25, 3 * 2**-11, 2**-10, 1e-5, 0.0, 447.0, 460.0, 1000.0, -1e6,
                            1e30, float("nan"), 2**-6, 2**-7 * 1.5])
    k[0, 0], v[1, 1] = special * k_scale, special * v_scale
    k, v = k.to(dtype), v.to(dtype)
    triton_attention.write_kv_cache_triton(*on_device(k, v), *caches, slots.to(DEVICE), k_scale, v_scale)
    attention.write_kv_cache(k, v, *ref, slots, k_scale, v_scale)
    for got, want in zip(caches, ref):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,window", [(16, None), (32, 20)])  # each ~2 s in the interpreter
def test_paged_attention_over_an_fp8_cache(block_size, window, dtype):
    """The mixed batch of test_paged_attention over FP8 caches with scales: the float64
    reference over the numbers the caches hold."""
    from test_fp8_kv_kernels import fp8_case

    num_computed, query_lens = [0, 7, 33, 0, 40, 5], [1, 1, 1, 23, 17, 40]
    k8, v8, tables, history, new_k, new_v, held_new = fp8_case(num_computed, query_lens, 2, 16, block_size, dtype,
                                                               0.25, 2.0, num_blocks=64)
    meta = attention.build_attention_metadata(tables, num_computed, query_lens, block_size, window, upload)
    q = torch.randn(sum(query_lens), 8, 16, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = triton_attention.paged_attention_triton(*on_device(q, new_k, new_v, k8, v8), meta, 0.25, 0.25, 2.0)
    assert out.dtype == dtype
    assert_equals_dense(out.cpu(), q, history, *held_new, query_lens, 0.25, window,
                        tol=2e-5 if dtype == torch.float32 else 2e-2)


def recurrent_case(seed: int, dtype: torch.dtype = torch.float32, meta_upload=None):
    torch.manual_seed(seed)
    hk, h, dk, dv, c, kernel, num_slots = 2, 8, 16, 16, 20, 4, 14
    # the last two: verification queries (speculative decoding), a checkpoint slot per draft
    slots, num_computed, query_lens = [3, 0, 7, 5, 2, 1, 6], [10, 4, 0, 30, 0, 20, 15], [1, 1, 5, 70, 130, 3, 4]
    checkpoints = [[]] * 5 + [[10, 11], [12, 13, 4]]
    meta = gdn.build_recurrent_metadata(slots, num_computed, query_lens, meta_upload, checkpoint_slots=checkpoints)
    t = sum(query_lens)
    return dict(meta=meta, q=torch.randn(t, hk, dk).to(dtype), k=torch.randn(t, hk, dk).to(dtype),
                v=torch.randn(t, h, dv).to(dtype), g=-torch.rand(t, h), beta=torch.rand(t, h),
                state=torch.randn(num_slots, h, dk, dv), x=torch.randn(t, c).to(dtype),
                weight=torch.randn(c, kernel).to(dtype), conv_state=torch.randn(num_slots, c, kernel - 1).to(dtype))


def device_case(case: dict) -> dict:
    return {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in case.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_delta_rule_and_conv1d_of_a_mixed_batch(dtype):
    """Decodes and prefills (several chunks), fresh and resuming states, a GQA ratio of 4
    between value and key heads, verification queries writing checkpoints: the states in
    every slot, and the outputs."""
    a, b = device_case(recurrent_case(0, dtype, upload)), recurrent_case(0, dtype)
    out = triton_gdn.gated_delta_rule_triton(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["meta"])
    ref = gdn.gated_delta_rule(b["q"], b["k"], b["v"], b["g"], b["beta"], b["state"], b["meta"])
    torch.testing.assert_close(out.cpu(), ref, **tol(dtype, 1e-4))
    torch.testing.assert_close(a["state"].cpu(), b["state"], **tol(dtype, 1e-4))
    y = triton_gdn.causal_conv1d_triton(a["x"], a["weight"], a["conv_state"], a["meta"])
    torch.testing.assert_close(y.cpu(), gdn.causal_conv1d(b["x"], b["weight"], b["conv_state"], b["meta"]),
                               **tol(dtype, 2e-5))
    torch.testing.assert_close(a["conv_state"].cpu(), b["conv_state"], **tol(dtype, 0.0))


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("gate_scale", [1.0, 8.0])
def test_chunked_delta_rule_of_varlen_prefills(chunk, gate_scale):
    """Prefills alone (the chunked route, no recurrence launched): lengths shorter than,
    equal to and one past a chunk, several chunks and a ragged end, fresh and resuming
    states; key and value head sizes that are not powers of two and more value channels
    than one scan program holds; mild and strong gates (cumulative decays down to
    e^-250 inside a chunk). Outputs and final states against the portable chunked form
    (chunks of 64), and on a GPU the Triton recurrence."""
    torch.manual_seed(7)
    hk, h, dk, dv, num_slots = 2, 4, 24, 48, 8
    slots, num_computed, query_lens = [5, 0, 2, 7, 1, 3], [0, 9, 0, 40, 0, 3], [2, 15, 16, 17, 47, 70]
    meta = gdn.build_recurrent_metadata(slots, num_computed, query_lens, upload)
    ref_meta = gdn.build_recurrent_metadata(slots, num_computed, query_lens)
    assert triton_gdn._longest_prefill(meta) == 70 and not triton_gdn._recurrent_needed(meta)
    t = sum(query_lens)
    q, k, v = torch.randn(t, hk, dk), torch.randn(t, hk, dk), torch.randn(t, h, dv)
    g, beta = -gate_scale * torch.rand(t, h), torch.rand(t, h)
    state = torch.randn(num_slots, h, dk, dv)
    ref_state, rec_state, got_state = state.clone(), state.clone().to(DEVICE), state.clone().to(DEVICE)
    ref = gdn.gated_delta_rule(q, k, v, g, beta, ref_state, ref_meta)
    inputs = on_device(q, k, v, g, beta)
    out = triton_gdn.gated_delta_rule_triton(*inputs, got_state, meta, chunk=chunk)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_state.cpu(), ref_state, atol=1e-4, rtol=1e-4)
    if ON_GPU:  # the interpreter takes the recurrence token by token: slow here
        rec = triton_gdn.gated_delta_rule_recurrent_triton(*inputs, rec_state, meta)
        torch.testing.assert_close(out, rec, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_state, rec_state, atol=1e-4, rtol=1e-4)


def test_decode_steps_launch_the_recurrence_alone():
    """A step of decodes has no chunked work (nothing to read back from the device to
    know it); a one-token prefill chunk goes a token at a time."""
    decodes = gdn.build_recurrent_metadata([0, 1, 2], [5, 9, 30], [1, 1, 1])
    assert triton_gdn._longest_prefill(decodes) == 0 and triton_gdn._recurrent_needed(decodes)
    mixed = gdn.build_recurrent_metadata([0, 1, 2], [5, 9, 0], [1, 1, 1])  # a one-token prompt last
    assert triton_gdn._recurrent_needed(mixed)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_recurrent_state_carries_from_a_prefill_into_decodes(dtype):
    """A prompt in two chunks, then three decode steps, each a launch of its own: the
    outputs equal one launch over the whole sequence (the portable recurrence)."""
    torch.manual_seed(3)
    t, hk, h, dk, dv = 70, 1, 4, 16, 16
    q, k, v = (torch.randn(t, hk, dk).to(dtype), torch.randn(t, hk, dk).to(dtype), torch.randn(t, h, dv).to(dtype))
    g, beta = -torch.rand(t, h), torch.rand(t, h)
    x, weight = torch.randn(t, 12).to(dtype), torch.randn(12, 4).to(dtype)
    state, conv_state = torch.zeros(2, h, dk, dv, device=DEVICE), torch.zeros(2, 12, 3, dtype=dtype, device=DEVICE)
    outs, ys, done = [], [], 0
    for n in (40, 27, 1, 1, 1):
        meta = gdn.build_recurrent_metadata([1], [done], [n], upload)
        part = slice(done, done + n)
        outs.append(triton_gdn.gated_delta_rule_triton(*on_device(q[part], k[part], v[part], g[part], beta[part]),
                                                       state, meta))
        ys.append(triton_gdn.causal_conv1d_triton(*on_device(x[part], weight), conv_state, meta))
        done += n
    whole = gdn.build_recurrent_metadata([0], [0], [t])
    ref_state, ref_conv = torch.zeros(1, h, dk, dv), torch.zeros(1, 12, 3, dtype=dtype)
    torch.testing.assert_close(torch.cat(outs).cpu(), gdn.gated_delta_rule(q, k, v, g, beta, ref_state, whole),
                               **tol(dtype, 1e-4))
    torch.testing.assert_close(state[1].cpu(), ref_state[0], **tol(dtype, 1e-4))
    torch.testing.assert_close(torch.cat(ys).cpu(), gdn.causal_conv1d(x, weight, ref_conv, whole), **tol(dtype, 2e-5))


def test_padding_rows_leave_every_state_alone():
    """A CUDA graph's batch rounded up: rows with state slot -1 read and write no state."""
    torch.manual_seed(5)
    meta = gdn.build_recurrent_metadata([1, -1, -1], [4, 1, 1], [1, 1, 1], upload)
    state, conv_state = torch.randn(2, 2, 16, 16, device=DEVICE), torch.randn(2, 12, 3, device=DEVICE)
    before, conv_before = state.clone(), conv_state.clone()
    q, k, v = torch.randn(3, 1, 16), torch.randn(3, 1, 16), torch.randn(3, 2, 16)
    triton_gdn.gated_delta_rule_triton(*on_device(q, k, v, -torch.rand(3, 2), torch.rand(3, 2)), state, meta)
    triton_gdn.causal_conv1d_triton(*on_device(torch.randn(3, 12), torch.randn(12, 4)), conv_state, meta)
    assert torch.equal(state[0], before[0]) and not torch.equal(state[1], before[1])
    assert torch.equal(conv_state[0], conv_before[0]) and not torch.equal(conv_state[1], conv_before[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_rotary_and_silu_and_mul(dtype):
    torch.manual_seed(4)
    x, gate, weight = torch.randn(13, 48).to(dtype), torch.randn(13, 48).to(dtype), torch.randn(48).to(dtype)
    for fast, ref, args in ((triton_elementwise.rms_norm_triton, norms.rms_norm, (x, weight, 1e-6)),
                            (triton_elementwise.rms_norm_zero_centered_triton, norms.rms_norm_zero_centered,
                             (x, weight, 1e-6)),
                            (triton_elementwise.gated_rms_norm_triton, norms.gated_rms_norm, (x, gate, weight, 1e-6))):
        got = fast(*on_device(*args[:-1]), args[-1])
        torch.testing.assert_close(got.cpu().float(), ref(*args).float(), **tol(dtype, 2e-5))
    heads = torch.randn(13, 3, 32).to(dtype)
    positions = torch.randint(0, 50, (3, 13))
    # Qwen2/2.5-VL: sections over the whole head; Qwen3.5: interleaved, over half of it
    for rot, sections, interleaved in ((32, [4, 6, 6], False), (16, [2, 3, 3], True)):
        cos, sin = mrope_cos_sin(positions, rope_inv_freq(rot, 10000.0), sections, interleaved)
        cos, sin = cos.to(dtype), sin.to(dtype)  # as the models pass them
        torch.testing.assert_close(triton_elementwise.apply_rotary_triton(*on_device(heads, cos, sin)).cpu().float(),
                                   rotary.apply_rotary(heads, cos, sin).float(), **tol(dtype, 2e-5))
    gate_up = torch.randn(13, 2 * 300).to(dtype)
    torch.testing.assert_close(triton_elementwise.silu_and_mul_triton(gate_up.to(DEVICE)).cpu().float(),
                               linear.silu_and_mul(gate_up).float(), **tol(dtype, 2e-5))


def test_token_bitmask():
    """Exactly the tokens whose bit is clear get -inf, in the rows named (a vocabulary
    that ends inside a word, the all-clear and all-set words)."""
    from vlmserve.kernels import sampling

    g = torch.Generator().manual_seed(0)
    vocab = 1500
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 47), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0, 3], bitmask[1, 5] = 0, -1
    logits = torch.randn(6, vocab, generator=g)
    rows = torch.tensor([5, 1, 2])
    want, got = logits.clone(), logits.to(DEVICE)
    sampling.apply_token_bitmask(want, rows, bitmask)
    triton_elementwise.apply_token_bitmask_triton(got, *on_device(rows, bitmask))
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("method,group", [("int8", 128), ("int4", 128), ("int4", 64), ("fp8", 128)])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_quantized_linear(method, group, rows):
    """Weight tiles dequantized in registers: the product with the dequantized weight, a
    ragged output width (48) and row count, with and without a bias; fp8 as an FP8
    checkpoint holds it (block scales), with subnormal values among its weights."""
    torch.manual_seed(rows)
    weight, x = torch.randn(48, 256), torch.randn(rows, 256)
    if method == "fp8":
        weight[:, :8] *= 1e-3  # subnormal in e4m3 after scaling by the block's largest
        fp8, scale = fp8_blocks(weight)
        qw = QuantizedWeight("fp8", (48, 256), torch.float32, fp8, scale.repeat_interleave(128, 0)[:48].contiguous())
    else:
        qw = quantize(weight, method, group)  # 64: a published checkpoint's group size
    on_gpu = dataclasses.replace(qw, **{f.name: getattr(qw, f.name).to(DEVICE) for f in dataclasses.fields(qw)
                                        if isinstance(getattr(qw, f.name), torch.Tensor)})
    for bias in (None, torch.randn(48)):
        out = triton_quantized_linear.quantized_linear_triton(x.to(DEVICE), on_gpu,
                                                              None if bias is None else bias.to(DEVICE))
        torch.testing.assert_close(out.cpu(), torch.nn.functional.linear(x, dequantize(qw), bias), atol=2e-4,
                                   rtol=2e-5)


# -- real widths: a GPU only ---------------------------------------------------------------
def big_pool_case(num_computed: list[int], query_lens: list[int], kv_heads: int, d: int, block_size: int,
                  dtype: torch.dtype, seed: int = 0):
    """Caches on the device in a pool of more than 2^31 elements, every sequence's blocks
    among the last ones (so a 32-bit offset would wrap), the history written by the
    portable write; the history and this step's keys and values kept for the reference."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    needed = [-(-(c + q) // block_size) for c, q in zip(num_computed, query_lens)]
    per_block = kv_heads * d * block_size
    num_blocks = (1 << 31) // per_block + sum(needed) + 2
    k_shape, v_shape = attention.kv_cache_shapes(num_blocks, block_size, kv_heads, d)
    k_cache = torch.zeros(k_shape, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros(v_shape, dtype=dtype, device=DEVICE)
    top = np.random.default_rng(seed).permutation(np.arange(num_blocks - sum(needed), num_blocks))
    tables = np.zeros((len(needed), max(needed) + 1), dtype=np.int64)
    history, used = [], 0
    for i, (c, n) in enumerate(zip(num_computed, needed)):
        tables[i, :n] = top[used : used + n]
        used += n
        keys = torch.randn(c, kv_heads, d, generator=gen, device=DEVICE).to(dtype)
        values = torch.randn(c, kv_heads, d, generator=gen, device=DEVICE).to(dtype)
        pos = np.arange(c)
        slots = torch.from_numpy(tables[i][pos // block_size] * block_size + pos % block_size).to(DEVICE)
        attention.write_kv_cache(keys, values, k_cache, v_cache, slots)
        history.append((keys, values))
    total = sum(query_lens)
    new_k = torch.randn(total, kv_heads, d, generator=gen, device=DEVICE).to(dtype)
    new_v = torch.randn(total, kv_heads, d, generator=gen, device=DEVICE).to(dtype)
    return k_cache, v_cache, tables, history, new_k, new_v


def dense_attention_fp32(q, keys, values, scale, window=None):
    """dense_attention on the device in fp32 (a 32k-token sequence in float64 would be slow)."""
    n, length = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    k = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * scale
    q_pos = torch.arange(length - n, length, device=q.device)[:, None]
    k_pos = torch.arange(length, device=q.device)[None, :]
    visible = (k_pos <= q_pos) & (k_pos > q_pos - (window or length + 1))
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 4096])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_paged_attention_at_real_widths(head_dim, block_size, window, dtype):
    """GQA 8 (16 query heads on 2 KV heads): a decode at the end of a 32k-token sequence, a
    512-token chunk after 30k cached, a fresh 700-token prefill, short ones; the cache pool
    past 2^31 elements."""
    torch.backends.cuda.matmul.allow_tf32 = False
    q_heads, kv_heads = 16, 2
    num_computed, query_lens = [32767, 30000, 0, 100, 4000], [1, 512, 700, 1, 37]
    k_cache, v_cache, tables, history, new_k, new_v = big_pool_case(num_computed, query_lens, kv_heads, head_dim,
                                                                    block_size, dtype)
    meta = attention.build_attention_metadata(tables, num_computed, query_lens, block_size, window, upload)
    q = torch.randn(sum(query_lens), q_heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim**-0.5
    out = triton_attention.paged_attention_triton(q, new_k, new_v, k_cache, v_cache, meta, scale)
    start = 0
    for (keys, values), n in zip(history, query_lens):
        ref = dense_attention_fp32(q[start : start + n], torch.cat([keys, new_k[start : start + n]]),
                                   torch.cat([values, new_v[start : start + n]]), scale, window)
        torch.testing.assert_close(out[start : start + n].float(), ref, **tol(dtype, 1e-4))
        start += n


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_delta_rule_and_conv1d_at_real_widths(dtype):
    """Qwen3.5's delta-rule heads (16 key / 32 value heads of 128) and its conv channels
    (8192): a fresh 4096-token prefill, a 1000-token chunk resuming a state, a 63-token
    one, decodes and a verification query, against the portable forms on the device."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(11)
    hk, h, dk, dv, channels, num_slots = 16, 32, 128, 128, 8192, 12
    slots, num_computed, query_lens = [0, 1, 2, 3, 4, 5], [100, 7, 0, 500, 20, 30], [1, 1, 4096, 1000, 63, 4]
    checkpoints = [[]] * 5 + [[9, 10, 11]]
    meta = gdn.build_recurrent_metadata(slots, num_computed, query_lens, upload, checkpoints)
    t = sum(query_lens)
    q, k = torch.randn(t, hk, dk, device=DEVICE).to(dtype), torch.randn(t, hk, dk, device=DEVICE).to(dtype)
    v = torch.randn(t, h, dv, device=DEVICE).to(dtype)
    g, beta = -torch.rand(t, h, device=DEVICE), torch.rand(t, h, device=DEVICE)
    state = torch.randn(num_slots, h, dk, dv, device=DEVICE) * 0.1
    ref_state, rec_state = state.clone(), state.clone()
    out = triton_gdn.gated_delta_rule_triton(q, k, v, g, beta, state, meta)
    ref = gdn.gated_delta_rule(q, k, v, g, beta, ref_state, meta)
    rec = triton_gdn.gated_delta_rule_recurrent_triton(q, k, v, g, beta, rec_state, meta)
    torch.testing.assert_close(out.float(), ref.float(), **tol(dtype, 1e-3))
    torch.testing.assert_close(state, ref_state, **tol(dtype, 1e-3))
    torch.testing.assert_close(out.float(), rec.float(), **tol(dtype, 1e-3))
    x = torch.randn(t, channels, device=DEVICE).to(dtype)
    weight = torch.randn(channels, 4, device=DEVICE).to(dtype)
    conv_state = torch.randn(num_slots, channels, 3, device=DEVICE).to(dtype)
    ref_conv = conv_state.clone()
    y = triton_gdn.causal_conv1d_triton(x, weight, conv_state, meta)
    torch.testing.assert_close(y.float(), gdn.causal_conv1d(x, weight, ref_conv, meta).float(), **tol(dtype, 1e-4))
    torch.testing.assert_close(conv_state, ref_conv, **tol(dtype, 0.0))


HOPPER_SHARED_MEMORY = 232448  # bytes a block may take on an H100/H200 (227 KB)
COMPILE_FOR_HOPPER = """
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vlmserve.kernels import triton_gdn

STORAGE = {"q_ptr", "k_ptr", "v_ptr", "out_ptr"}  # in the model's dtype; the rest fp32 or int32
FP32 = {"g_ptr", "beta_ptr", "u_ptr", "w_ptr", "gcum_ptr", "state_ptr"}
shared = {}
for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
    for kernel_name, (kernel, options) in triton_gdn.chunked_launches(128, 128, dtype, chunk=64).items():
        constexprs = {k: v for k, v in options.items() if not k.startswith("num_")}
        signature = {arg: "constexpr" if arg in constexprs else (f"*{name}" if arg in STORAGE else
                     "*fp32" if arg in FP32 else "*i32" if arg.endswith("_ptr") else "i32")
                     for arg in kernel.arg_names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={k: v for k, v in options.items() if k.startswith("num_")})
        shared[f"{kernel_name} {name}"] = compiled.metadata.shared
print(json.dumps(shared))
"""


def test_chunked_delta_rule_fits_hopper_shared_memory():
    """The chunked delta rule's kernels at Qwen3.5's head width (128), compiled for an
    H100/H200 (sm_90; Triton compiles without a GPU), take at most the shared memory a
    block gets there: the default 3-stage pipeline of the scan once asked for 272-297 KB
    and failed to launch on the H200 (gpu_check, 2026-12-04)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(shared) == {"prepare fp32", "scan fp32", "prepare bf16", "scan bf16"}
    assert all(0 < used <= HOPPER_SHARED_MEMORY for used in shared.values()), shared
