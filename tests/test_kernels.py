"""The CPU kernels against plain dense references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlmserve.kernels import ops
from vlmserve.kernels.attention import build_attention_metadata
from vlmserve.kernels.linear import PACKED_MIN_ROWS
from vlmserve.models.layers import Linear


def dense_attention(q, keys, values, scale, window=None):
    """One query (the last position) over keys/values [L, kv_heads, d], GQA by repetition."""
    group = q.shape[0] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, L, d]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q[:, None, :] @ k.transpose(1, 2))[:, 0] * scale  # [heads, L]
    if window is not None:
        scores[:, : max(0, keys.shape[0] - window)] = float("-inf")
    return (scores.softmax(-1)[:, None, :] @ v)[:, 0]


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_attention_equals_dense_attention(q_heads, kv_heads, window):
    torch.manual_seed(0)
    block_size, d, num_blocks = 4, 16, 64
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, d)
    v_cache = torch.zeros_like(k_cache)
    lengths = [1, 7, 16, 33]  # tokens already cached per request
    rng = np.random.default_rng(0)
    free = list(rng.permutation(np.arange(1, num_blocks)))  # block 0 is the null block
    tables, history = [], []
    for n in lengths:
        table = np.array([free.pop() for _ in range(-(-(n + 1) // block_size))])
        keys, values = torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
        slots = torch.from_numpy(table[np.arange(n) // block_size] * block_size + np.arange(n) % block_size)
        k_cache.view(-1, kv_heads, d)[slots] = keys
        v_cache.view(-1, kv_heads, d)[slots] = values
        tables.append(table)
        history.append((keys, values))
    meta = build_attention_metadata(tables, lengths, [1] * len(lengths), block_size, window)
    q = torch.randn(len(lengths), q_heads, d)
    k_new, v_new = torch.randn(len(lengths), kv_heads, d), torch.randn(len(lengths), kv_heads, d)
    out = ops.paged_attention(q, k_new, v_new, k_cache, v_cache, meta, d**-0.5)
    for i, (keys, values) in enumerate(history):
        ref = dense_attention(q[i], torch.cat([keys, k_new[i : i + 1]]), torch.cat([values, v_new[i : i + 1]]),
                              d**-0.5, window)
        torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, PACKED_MIN_ROWS - 1, PACKED_MIN_ROWS, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_plain_linear(rows, bias):
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    plain = layer(x)
    layer.pack()
    assert layer.packed_weight is not None  # this CPU build has oneDNN
    torch.testing.assert_close(layer(x), plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x.view(1, rows, 96)), plain.view(1, rows, 160), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, F.linear(x, layer.weight, layer.bias))


def test_no_packed_layout_where_there_is_none():
    assert Linear(8, 8).pack() is None and Linear(8, 8).packed_weight is None  # not packed until asked
    half = Linear(8, 8).to(torch.float16)
    half.pack()
    assert half.packed_weight is None  # oneDNN packing is for fp32/bf16 only; fp16 stays plain
    assert half(torch.randn(16, 8, dtype=torch.float16)).shape == (16, 8)


def test_packing_is_skipped_when_the_copy_would_not_fit():
    from vlmserve.worker import model_loader

    model = torch.nn.Sequential(Linear(64, 64), Linear(64, 64))
    assert model_loader.pack_linear_weights(model, memory_share=1e-12) == 0
    assert all(m.packed_weight is None for m in model)
    assert model_loader.pack_linear_weights(model) == 2 * 64 * 64 * 4
    assert all(m.packed_weight is not None for m in model)


@pytest.mark.parametrize("t", [1, 63, 64, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_gated_delta_rule_equals_the_recurrence(t, with_state):
    """Prefill over several 64-token chunks, from zeros or a carried state, equals the
    decode recurrence run token by token; and the conv1d prefill equals its decode."""
    torch.manual_seed(t)
    b, hk, h, dk, dv = 2, 2, 4, 16, 8
    q, k = torch.randn(b, t, hk, dk), torch.randn(b, t, hk, dk)
    v = torch.randn(b, t, h, dv)
    g = -torch.rand(b, t, h)  # log decay, negative
    beta = torch.rand(b, t, h)
    state = torch.randn(b, h, dk, dv) if with_state else None
    out, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, state)
    s = state if with_state else torch.zeros(b, h, dk, dv)
    for i in range(t):
        o, s = ops.recurrent_gated_delta_rule(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s)
        torch.testing.assert_close(out[:, i], o, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(final, s, atol=2e-4, rtol=2e-4)

    c, kernel = 6, 4
    x, weight = torch.randn(b, t, c), torch.randn(c, kernel)
    conv_state = torch.randn(b, c, kernel - 1) if with_state else None
    y, new_state = ops.causal_conv1d_prefill(x, weight, conv_state)
    carried = conv_state if with_state else torch.zeros(b, c, kernel - 1)
    for i in range(t):
        yi, carried = ops.causal_conv1d_decode(x[:, i], weight, carried)
        torch.testing.assert_close(y[:, i], yi, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, carried)
