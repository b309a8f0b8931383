"""Every Triton kernel against the torch version of its op, in fp32 on small shapes, run
by Triton's interpreter on CPU tensors (no GPU here; the interpreter has no bf16 dot, so
bf16 waits for a GPU). Tolerances: 2e-5 for attention, norms, rotary and silu-and-mul;
1e-4 for the delta rule (a recurrence against a chunked triangular solve)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_kernels import assert_equals_dense, bidirectional_case, dense_attention, paged_case
from vlmserve.kernels import attention, gdn, linear, norms, rotary
from vlmserve.kernels import (  # conftest turned the interpreter on
    triton_attention,
    triton_elementwise,
    triton_gdn,
    triton_quantized_linear,
)
from vlmserve.kernels.quantized_linear import dequantize, quantize
from vlmserve.models.layers import mrope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.slow  # the interpreter runs each program in numpy


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
def test_paged_attention(block_size, window, q_heads, kv_heads):
    """Decodes, a fresh prefill, a chunk over a cached prefix, one crossing several query
    tiles; the tables' padding is the null block; a window edge inside a block."""
    torch.manual_seed(0)
    d = 16
    num_computed = [0, 7, 33, 0, 40, 5]
    query_lens = [1, 1, 1, 23, 17, 40]
    k_cache, v_cache, tables, history, new_k, new_v = paged_case(num_computed, query_lens, kv_heads, d, block_size,
                                                                 num_blocks=64)
    meta = attention.build_attention_metadata(tables, num_computed, query_lens, block_size, window)
    q = torch.randn(sum(query_lens), q_heads, d)
    out = triton_attention.paged_attention_triton(q, new_k, new_v, k_cache, v_cache, meta, d**-0.5)
    start = 0
    for (keys, values), n in zip(history, query_lens):
        ref = dense_attention(q[start : start + n], torch.cat([keys, new_k[start : start + n]]),
                              torch.cat([values, new_v[start : start + n]]), d**-0.5, window)
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=2e-5, rtol=2e-5)
        start += n


@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_with_pictures_that_attend_both_ways(window):
    num_computed, query_lens, case, key_ends = bidirectional_case(16)
    k_cache, v_cache, tables, history, new_k, new_v = case
    meta = attention.build_attention_metadata(tables, num_computed, query_lens, 16, window,
                                              key_ends=np.concatenate(key_ends))
    q = torch.randn(sum(query_lens), 4, 16, generator=torch.Generator().manual_seed(3))
    out = triton_attention.paged_attention_triton(q, new_k, new_v, k_cache, v_cache, meta, 0.25)
    assert_equals_dense(out, q, history, new_k, new_v, query_lens, 0.25, window, key_ends)


def test_kv_cache_write_and_varlen_attention():
    torch.manual_seed(1)
    k_shape, v_shape = attention.kv_cache_shapes(8, 16, 2, 16)
    caches, ref = [torch.zeros(k_shape), torch.zeros(v_shape)], [torch.zeros(k_shape), torch.zeros(v_shape)]
    slots = torch.tensor([17, 3, 100, 80, 81, 16])
    k, v = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    triton_attention.write_kv_cache_triton(k, v, *caches, slots)
    attention.write_kv_cache(k, v, *ref, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    seq_lens = [7, 40, 1, 16]
    q, kk, vv = (torch.randn(sum(seq_lens), 4, 16) for _ in range(3))
    torch.testing.assert_close(triton_attention.varlen_attention_triton(q, kk, vv, seq_lens, 0.25),
                               attention.varlen_attention(q, kk, vv, seq_lens, 0.25), atol=2e-5, rtol=2e-5)


def recurrent_case(seed: int):
    torch.manual_seed(seed)
    hk, h, dk, dv, c, kernel, num_slots = 2, 8, 16, 16, 20, 4, 14
    # the last two: verification queries (speculative decoding), a checkpoint slot per draft
    slots, num_computed, query_lens = [3, 0, 7, 5, 2, 1, 6], [10, 4, 0, 30, 0, 20, 15], [1, 1, 5, 70, 130, 3, 4]
    checkpoints = [[]] * 5 + [[10, 11], [12, 13, 4]]
    meta = gdn.build_recurrent_metadata(slots, num_computed, query_lens, checkpoint_slots=checkpoints)
    t = sum(query_lens)
    return dict(meta=meta, q=torch.randn(t, hk, dk), k=torch.randn(t, hk, dk), v=torch.randn(t, h, dv),
                g=-torch.rand(t, h), beta=torch.rand(t, h), state=torch.randn(num_slots, h, dk, dv),
                x=torch.randn(t, c), weight=torch.randn(c, kernel), conv_state=torch.randn(num_slots, c, kernel - 1))


def test_gated_delta_rule_and_conv1d_of_a_mixed_batch():
    """Decodes and prefills (several 64-token chunks), fresh and resuming states, a GQA
    ratio of 4 between value and key heads, verification queries writing checkpoints:
    the states in every slot, and the outputs."""
    a, b = recurrent_case(0), recurrent_case(0)
    out = triton_gdn.gated_delta_rule_triton(a["q"], a["k"], a["v"], a["g"], a["beta"], a["state"], a["meta"])
    ref = gdn.gated_delta_rule(b["q"], b["k"], b["v"], b["g"], b["beta"], b["state"], b["meta"])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a["state"], b["state"], atol=1e-4, rtol=1e-4)
    y = triton_gdn.causal_conv1d_triton(a["x"], a["weight"], a["conv_state"], a["meta"])
    torch.testing.assert_close(y, gdn.causal_conv1d(b["x"], b["weight"], b["conv_state"], b["meta"]), atol=2e-5,
                               rtol=2e-5)
    torch.testing.assert_close(a["conv_state"], b["conv_state"])


def test_recurrent_state_carries_from_a_prefill_into_decodes():
    """A prompt in two chunks, then three decode steps, each a launch of its own: the
    outputs equal one launch over the whole sequence (the portable recurrence)."""
    torch.manual_seed(3)
    t, hk, h, dk, dv = 70, 1, 4, 16, 16
    q, k, v = torch.randn(t, hk, dk), torch.randn(t, hk, dk), torch.randn(t, h, dv)
    g, beta = -torch.rand(t, h), torch.rand(t, h)
    x, weight = torch.randn(t, 12), torch.randn(12, 4)
    state, conv_state = torch.zeros(2, h, dk, dv), torch.zeros(2, 12, 3)
    outs, ys, done = [], [], 0
    for n in (40, 27, 1, 1, 1):
        meta = gdn.build_recurrent_metadata([1], [done], [n])
        part = slice(done, done + n)
        outs.append(triton_gdn.gated_delta_rule_triton(q[part], k[part], v[part], g[part], beta[part], state, meta))
        ys.append(triton_gdn.causal_conv1d_triton(x[part], weight, conv_state, meta))
        done += n
    whole = gdn.build_recurrent_metadata([0], [0], [t])
    ref_state, ref_conv = torch.zeros(1, h, dk, dv), torch.zeros(1, 12, 3)
    torch.testing.assert_close(torch.cat(outs), gdn.gated_delta_rule(q, k, v, g, beta, ref_state, whole), atol=1e-4,
                               rtol=1e-4)
    torch.testing.assert_close(state[1], ref_state[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(ys), gdn.causal_conv1d(x, weight, ref_conv, whole), atol=2e-5, rtol=2e-5)


def test_norms_rotary_and_silu_and_mul():
    torch.manual_seed(4)
    x, gate, weight = torch.randn(13, 48), torch.randn(13, 48), torch.randn(48)
    for fast, ref, args in ((triton_elementwise.rms_norm_triton, norms.rms_norm, (x, weight, 1e-6)),
                            (triton_elementwise.rms_norm_zero_centered_triton, norms.rms_norm_zero_centered,
                             (x, weight, 1e-6)),
                            (triton_elementwise.gated_rms_norm_triton, norms.gated_rms_norm, (x, gate, weight, 1e-6))):
        torch.testing.assert_close(fast(*args), ref(*args), atol=2e-5, rtol=2e-5)
    heads = torch.randn(13, 3, 32)
    positions = torch.randint(0, 50, (3, 13))
    # Qwen2/2.5-VL: sections over the whole head; Qwen3.5: interleaved, over half of it
    for rot, sections, interleaved in ((32, [4, 6, 6], False), (16, [2, 3, 3], True)):
        cos, sin = mrope_cos_sin(positions, rope_inv_freq(rot, 10000.0), sections, interleaved)
        torch.testing.assert_close(triton_elementwise.apply_rotary_triton(heads, cos, sin),
                                   rotary.apply_rotary(heads, cos, sin), atol=2e-5, rtol=2e-5)
    gate_up = torch.randn(13, 2 * 300)
    torch.testing.assert_close(triton_elementwise.silu_and_mul_triton(gate_up), linear.silu_and_mul(gate_up),
                               atol=2e-5, rtol=2e-5)


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
    want, got = logits.clone(), logits.clone()
    sampling.apply_token_bitmask(want, rows, bitmask)
    triton_elementwise.apply_token_bitmask_triton(got, rows, bitmask)
    assert torch.equal(got, want)


@pytest.mark.parametrize("method,group", [("int8", 128), ("int4", 128), ("int4", 64)])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_quantized_linear(method, group, rows):
    """Weight tiles dequantized in registers: the product with the dequantized weight, a
    ragged output width (48) and row count, with and without a bias."""
    torch.manual_seed(rows)
    weight, x = torch.randn(48, 256), torch.randn(rows, 256)
    qw = quantize(weight, method, group)  # 64: a published checkpoint's group size
    for bias in (None, torch.randn(48)):
        out = triton_quantized_linear.quantized_linear_triton(x, qw, bias)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, dequantize(qw), bias), atol=2e-4, rtol=2e-5)
