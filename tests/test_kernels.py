"""The CPU kernels against plain dense references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlmserve.kernels import cpu_extension, gdn
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.attention import build_attention_metadata
from vlmserve.kernels.linear import GEMV_OVER_PACKED_ROWS
from vlmserve.models.layers import Linear


def dense_attention(q, keys, values, scale, window=None, key_ends=None):
    """Every query of a sequence over its keys/values [L, kv_heads, d] (the queries are the
    last len(q) positions), causal and windowed, GQA by repetition, in float64; with
    key_ends, query i sees up to max(its position, key_ends[i])."""
    n, L = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, L, d]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, n, L]
    q_pos = torch.arange(L - n, L)[:, None]
    k_pos = torch.arange(L)[None, :]
    last = q_pos if key_ends is None else torch.maximum(q_pos, torch.as_tensor(key_ends)[:, None])
    visible = (k_pos <= last) & (k_pos > q_pos - (window or L + 1))
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [n, heads, d]


def paged_case(num_computed, query_lens, kv_heads, d, block_size, num_blocks=256, dtype=torch.float32, seed=0):
    """Caches holding num_computed[i] tokens of request i in scattered blocks (block 0 is
    the null block, in the tables' padding), and this step's new keys and values."""
    from vlmserve.kernels.attention import kv_cache_shapes, write_kv_cache

    gen = torch.Generator().manual_seed(seed)
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, kv_heads, d)
    k_cache, v_cache = torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)
    free = list(np.random.default_rng(seed).permutation(np.arange(1, num_blocks)))
    width = max(-(-(c + q) // block_size) for c, q in zip(num_computed, query_lens)) + 1
    tables = np.zeros((len(num_computed), width), dtype=np.int64)
    history = []
    for i, (c, q) in enumerate(zip(num_computed, query_lens)):
        n_blocks = -(-(c + q) // block_size)
        tables[i, :n_blocks] = [free.pop() for _ in range(n_blocks)]
        keys = torch.randn(c, kv_heads, d, generator=gen).to(dtype)
        values = torch.randn(c, kv_heads, d, generator=gen).to(dtype)
        slots = torch.from_numpy(tables[i][np.arange(c) // block_size] * block_size + np.arange(c) % block_size)
        write_kv_cache(keys, values, k_cache, v_cache, slots)
        history.append((keys, values))
    total = sum(query_lens)
    new_k = torch.randn(total, kv_heads, d, generator=gen).to(dtype)
    new_v = torch.randn(total, kv_heads, d, generator=gen).to(dtype)
    return k_cache, v_cache, tables, history, new_k, new_v


def test_the_kernels_show_in_torchs_profiler_under_their_names():
    """The kernels are the extension module's functions, not torch ops; each records itself
    as an op would (vlmserve_cpu::<name>), so a torch profile still names every kernel."""
    from torch.profiler import profile

    x, weight = torch.randn(2, 64), torch.rand(64)
    with profile() as prof:
        out = cpu_kernels().rms_norm(x, weight, 1e-6, False, None)
    assert "vlmserve_cpu::rms_norm" in {event.key for event in prof.key_averages()}
    torch.testing.assert_close(out, F.rms_norm(x, (64,), weight, 1e-6))


@pytest.mark.parametrize("impl", ["portable", "cpu"])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_paged_attention_equals_dense_attention(impl, q_heads, kv_heads, window, block_size):
    """A mixed batch: decodes, a fresh prefill, a chunk over a cached prefix, a long
    prefill crossing tiles; with and without a window, GQA, three block sizes."""
    from vlmserve.kernels import cpu_extension
    from vlmserve.kernels.attention import paged_attention, paged_attention_cpu

    assert cpu_extension.available()  # a compiler is on these machines
    torch.manual_seed(0)
    d = 16
    num_computed = [0, 7, 16, 33, 0, 40, 5]
    query_lens = [1, 1, 1, 1, 23, 17, 70]
    k_cache, v_cache, tables, history, new_k, new_v = paged_case(num_computed, query_lens, kv_heads, d, block_size)
    meta = build_attention_metadata(tables, num_computed, query_lens, block_size, window)
    q = torch.randn(sum(query_lens), q_heads, d)
    fn = paged_attention if impl == "portable" else paged_attention_cpu
    out = fn(q, new_k, new_v, k_cache, v_cache, meta, d**-0.5)
    start = 0
    for (keys, values), n in zip(history, query_lens):
        ref = dense_attention(q[start : start + n], torch.cat([keys, new_k[start : start + n]]),
                              torch.cat([values, new_v[start : start + n]]), d**-0.5, window)
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=2e-5, rtol=2e-5)
        start += n


def assert_equals_dense(out, q, history, new_k, new_v, query_lens, scale, window=None, key_ends=None, tol=2e-5):
    """Each sequence's rows of a paged attention's output against dense_attention."""
    start = 0
    for i, ((keys, values), n) in enumerate(zip(history, query_lens)):
        ref = dense_attention(q[start : start + n], torch.cat([keys, new_k[start : start + n]]),
                              torch.cat([values, new_v[start : start + n]]), scale, window,
                              None if key_ends is None else key_ends[i])
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=tol, rtol=tol)
        start += n


def bidirectional_case(block_size: int):
    """Sequences whose step holds pictures that attend both ways: a run inside the step,
    one whose start is in the cached prefix (a prefix hit mid-picture), a run longer
    than the window, two runs in one step, decodes after a picture. Returns the case and
    key_ends (the last key each query sees)."""
    num_computed = [0, 12, 3, 40, 50]
    query_lens = [40, 28, 45, 1, 30]
    runs = [[(10, 26)], [(8, 24)], [(5, 35)], [], [(52, 60), (64, 72)]]
    case = paged_case(num_computed, query_lens, 2, 16, block_size)
    key_ends = []
    for c, n, seq_runs in zip(num_computed, query_lens, runs):
        ends = np.arange(c, c + n)
        for lo, hi in seq_runs:
            inside = (ends >= lo) & (ends < hi)
            ends = np.where(inside, hi - 1, ends)
        key_ends.append(ends)
    return num_computed, query_lens, case, key_ends


@pytest.mark.parametrize("impl", ["portable", "cpu"])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_with_pictures_that_attend_both_ways(impl, window, block_size):
    """Gemma 3's mask: causal, or within the query's picture; the window bounds only from below."""
    from vlmserve.kernels.attention import paged_attention, paged_attention_cpu

    num_computed, query_lens, case, key_ends = bidirectional_case(block_size)
    k_cache, v_cache, tables, history, new_k, new_v = case
    meta = build_attention_metadata(tables, num_computed, query_lens, block_size, window,
                                    key_ends=np.concatenate(key_ends))
    q = torch.randn(sum(query_lens), 4, 16, generator=torch.Generator().manual_seed(3))
    fn = paged_attention if impl == "portable" else paged_attention_cpu
    out = fn(q, new_k, new_v, k_cache, v_cache, meta, 0.25)
    assert_equals_dense(out, q, history, new_k, new_v, query_lens, 0.25, window, key_ends)
    causal = fn(q, new_k, new_v, k_cache, v_cache,
                build_attention_metadata(tables, num_computed, query_lens, block_size, window), 0.25)
    assert not torch.allclose(causal, out)  # the mask made a difference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kv_cache_write_of_cpp_equals_torchs(dtype):
    from vlmserve.kernels import cpu_extension
    from vlmserve.kernels.attention import kv_cache_shapes, read_kv_cache, write_kv_cache

    assert cpu_extension.available()
    k_shape, v_shape = kv_cache_shapes(10, 16, 2, 64)
    caches = [torch.zeros(k_shape, dtype=dtype), torch.zeros(v_shape, dtype=dtype)]
    ref = [torch.zeros_like(c) for c in caches]
    slots = torch.tensor([17, 3, 159, 80, 81, 16])
    k, v = torch.randn(6, 2, 64).to(dtype), torch.randn(6, 2, 64).to(dtype)
    cpu_kernels().write_kv_cache(k, v, *caches, slots, 1.0, 1.0)
    write_kv_cache(k, v, *ref, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])
    keys, values = read_kv_cache(*caches, slots // 16, slots % 16)
    assert torch.equal(keys, k) and torch.equal(values, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 2)])
def test_long_prompt_chunks_take_flash_attention_and_equal_dense_attention(dtype, q_heads, kv_heads):
    """Chunks of FLASH_MIN_QUERY tokens or more (a fresh prompt, one over a cached prefix
    that crosses blocks) go to torch's flash attention, the rest of the batch (decodes, a
    short chunk) to the paged kernel: every row equals the float64 reference. (Flash
    attention takes them on CPUs with AMX; the split is tested on every CPU.)"""
    from vlmserve.kernels import attention, cpu_extension

    assert cpu_extension.available()
    n = attention.FLASH_MIN_QUERY
    num_computed, query_lens = [0, 5, n + 37, 0, 60], [n + 3, 1, n, 20, 1]
    k_cache, v_cache, tables, history, new_k, new_v = paged_case(num_computed, query_lens, kv_heads, 16, 16,
                                                                 num_blocks=128, dtype=dtype)
    meta = build_attention_metadata(tables, num_computed, query_lens, 16)
    q = torch.randn(sum(query_lens), q_heads, 16).to(dtype)
    out = attention.attend_cpu(q, new_k, new_v, k_cache, v_cache, meta, 0.25, flash_from=n)
    assert out.dtype == dtype
    assert_equals_dense(out, q, history, new_k, new_v, query_lens, 0.25, tol=1e-2 if dtype == torch.bfloat16 else 2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 256, 80])
def test_paged_attention_at_the_head_sizes_of_released_models(d, dtype):
    """The head sizes compiled in (64, 128, 256) and one that is not (80): bf16 storage
    with fp32 accumulation equals the float64 reference of the same bf16 numbers within
    bf16 rounding of the output; fp32 within 2e-5."""
    from vlmserve.kernels import cpu_extension
    from vlmserve.kernels.attention import paged_attention_cpu

    assert cpu_extension.available()  # a compiler is on these machines
    num_computed, query_lens = [30, 0, 100], [1, 40, 9]
    k_cache, v_cache, tables, history, new_k, new_v = paged_case(num_computed, query_lens, 2, d, 16, dtype=dtype)
    meta = build_attention_metadata(tables, num_computed, query_lens, 16)
    q = torch.randn(sum(query_lens), 8, d).to(dtype)
    out = paged_attention_cpu(q, new_k, new_v, k_cache, v_cache, meta, d**-0.5)
    assert out.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-5
    start = 0
    for (keys, values), n in zip(history, query_lens):
        ref = dense_attention(q[start : start + n], torch.cat([keys, new_k[start : start + n]]),
                              torch.cat([values, new_v[start : start + n]]), d**-0.5)
        torch.testing.assert_close(out[start : start + n].double(), ref, atol=tol, rtol=tol)
        start += n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_masks_at_a_compiled_head_size(window, dtype):
    """Windows and pictures that attend both ways at a head size and block size the
    vectorised paths take (128, 16): keys hidden at both ends of a block."""
    from vlmserve.kernels import cpu_extension
    from vlmserve.kernels.attention import paged_attention_cpu

    assert cpu_extension.available()
    num_computed, query_lens = [0, 12, 40, 50], [40, 28, 1, 30]
    runs = [[(10, 26)], [(8, 24)], [], [(52, 60), (64, 72)]]
    k_cache, v_cache, tables, history, new_k, new_v = paged_case(num_computed, query_lens, 2, 128, 16, dtype=dtype)
    key_ends = []
    for c, n, seq_runs in zip(num_computed, query_lens, runs):
        ends = np.arange(c, c + n)
        for lo, hi in seq_runs:
            ends = np.where((ends >= lo) & (ends < hi), hi - 1, ends)
        key_ends.append(ends)
    meta = build_attention_metadata(tables, num_computed, query_lens, 16, window, key_ends=np.concatenate(key_ends))
    q = torch.randn(sum(query_lens), 8, 128, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = paged_attention_cpu(q, new_k, new_v, k_cache, v_cache, meta, 128**-0.5)
    assert_equals_dense(out, q, history, new_k, new_v, query_lens, 128**-0.5, window, key_ends,
                        tol=1e-2 if dtype == torch.bfloat16 else 2e-5)


@pytest.mark.parametrize("rows", [1, GEMV_OVER_PACKED_ROWS, GEMV_OVER_PACKED_ROWS + 1, 32, 300])
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


@pytest.mark.skipif(not (cpu_extension.available() and (cpu_extension.has_bf16_dot() or cpu_extension.widens_bf16())),
                    reason="vlmserve's bf16 GEMV is not built here")
def test_one_bf16_row_reads_the_same_in_streams_or_in_one(gemv_streams):
    """One row of x over 8 weight rows a step, each prefetched (streams), or over 4 (one
    stream, the hardware prefetcher ahead): each output is the same sum in the same order
    (AVX512-BF16's dot products, or the weight widened to fp32)."""
    torch.manual_seed(1)
    weight = torch.randn(8 * 37 + 5, 320).to(torch.bfloat16)  # whole steps of 8 and of 4, a tail
    x = torch.randn(1, 320).to(torch.bfloat16)
    got = cpu_kernels().bf16_gemv(x, weight, None)
    cpu_kernels().set_gemv_streams(not gemv_streams)
    torch.testing.assert_close(got, cpu_kernels().bf16_gemv(x, weight, None), atol=0, rtol=0)
    torch.testing.assert_close(got.float(), F.linear(x.float(), weight.float()), atol=0.05, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 12, 13, 16, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_decode_linear_equals_an_fp32_product_rounded_once(rows, bias):
    """Up to 16 rows of a bf16 layer with no packed copy take the matrix-vector kernel
    (AVX512-BF16 CPUs; from 4 rows in tiles of rows, of unequal sizes at 13), up to 64 on
    CPUs without it (the weight widened in registers; tiles of up to 3 rows on AVX2, 4 on
    AVX-512F): fp32 sums of the
    exact bf16 products, rounded to bf16 once, as oneDNN's path does."""
    from vlmserve.kernels import cpu_extension, linear

    torch.manual_seed(0)
    out_features = 4 * 37 + 3  # full bands of four (eight for one row of x) weight rows and a tail
    weight = torch.randn(out_features, 320).to(torch.bfloat16)
    b = torch.randn(out_features).to(torch.bfloat16) if bias else None
    x = torch.randn(2, rows, 320).to(torch.bfloat16)[:1]  # a view: not contiguous in memory
    got = linear.linear_cpu(x, weight, b)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, out_features)
    torch.testing.assert_close(got.float(), want, atol=0.05, rtol=1e-2)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=0.05, rtol=1e-2)
    amx = rows > linear.GEMV_OVER_PACKED_ROWS and cpu_extension.has_amx()  # AMX's kernel takes these there
    uses_kernel = ((rows <= linear.BF16_GEMV_MAX_ROWS and not amx and cpu_extension.has_bf16_dot()
                    and cpu_extension.available())
                   or (rows <= linear.WIDENING_GEMV_MAX_ROWS and cpu_extension.widens_bf16()))
    if uses_kernel:
        torch.testing.assert_close(got, cpu_kernels().bf16_gemv(x, weight, b), atol=0, rtol=0)
        if b is not None:  # a bias in fp32 is added to the fp32 sums as it is
            got = cpu_kernels().bf16_gemv(x, weight, b.float() + 1e-3)
            torch.testing.assert_close(got.float(), (want + 1e-3).to(torch.bfloat16).float(), atol=0.05, rtol=1e-2)


@pytest.mark.skipif(not cpu_extension.available(), reason="vlmserve's CPU kernels are not built here")
@pytest.mark.parametrize("kernel", ["gemv", "pairs"])
@pytest.mark.parametrize("rows", [1, 8])
def test_bf16_kernels_round_their_sums_to_nearest_even_as_torch(rows, kernel):
    """The kernels' fp32 sums (the GEMV's on the plain weight, the pair layout's) go to bf16
    as torch rounds them (to nearest, ties to even; a NaN stays one), by AVX512-BF16's
    instruction or, without it, by integer arithmetic (16 or 8 lanes at a time): each x
    picks two weight columns, whose sum fp32 holds exactly, many of them ties."""
    from vlmserve.kernels import linear

    torch.manual_seed(rows)
    weight = torch.randn(3 * 64, 64).to(torch.bfloat16)
    weight[:, 1] = weight[:, 0] * 2**-8  # w0 + w1 lies halfway between two bf16 values
    weight[7, 2] = float("nan")
    x = torch.zeros(rows, 64, dtype=torch.bfloat16)
    picks = [(0, 1), (0, 2), (3, 4), (5, 6)] * rows
    for m in range(rows):
        x[m, list(picks[m])] = 1
    want = (x.float() @ weight.float().t()).to(torch.bfloat16)  # exact in fp32: two terms, zeros (0 x NaN: NaN)
    if kernel == "gemv":
        got = cpu_kernels().bf16_gemv(x, weight, None)
    elif linear._pairs_fit(weight):
        packed = torch.empty(3, 32, 64, 2, dtype=torch.bfloat16)
        cpu_kernels().bf16_pair_pack(weight, packed)
        got = cpu_kernels().bf16_batch_linear(x, packed, None)
    else:
        pytest.skip("the pair kernel needs AVX-512 or AVX2 (and no AMX)")
    assert got[:, 7].isnan().all() and not got[:, :7].isnan().any()
    torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_rows_past_the_widening_gemv_run_as_fp32_matmuls_over_widened_blocks(monkeypatch, bias):
    """On CPUs without AVX512-BF16, more rows than the widening GEMV takes run as fp32 matmuls
    over the bf16 weight widened a block of rows at a time (here three blocks, the last
    short), the bias added before the one rounding."""
    from vlmserve.kernels import linear

    if not linear.widens_bf16_layers():
        pytest.skip("the widening path is for CPUs without bf16 arithmetic (AVX2, AVX-512F alone)")
    monkeypatch.setattr(linear, "WIDEN_BLOCK", 64 * 330)
    torch.manual_seed(0)
    weight = torch.randn(150, 330).to(torch.bfloat16)  # inputs no multiple of 32 (the vision MLP's 3420)
    b = torch.randn(150).to(torch.bfloat16) if bias else None
    x = torch.randn(3, linear.WIDENING_GEMV_MAX_ROWS, 330).to(torch.bfloat16)
    with torch.inference_mode():  # the reused buffer, made by an engine's step, is written again outside it
        linear.linear_cpu(x, weight, b)
    got = linear.linear_cpu(x, weight, b)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float()).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (3, linear.WIDENING_GEMV_MAX_ROWS, 150)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)  # at most a last bit apart (summation order)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 6, 7, 13, 32, 33, 64, 300, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_packed_layer_on_the_pair_kernel(rows, bias):
    """A packed bf16 layer on CPUs with AVX-512 or AVX2 and no AMX: the pair layout's kernel
    (its pairs widened to fp32 where there is no AVX512-BF16) at every row count, over
    several blocks of 64 columns (split between the threads), two chunks of input channels,
    one row tile (the weight streamed as it comes) or several of unequal sizes (each asking
    for its share of the stream ahead) and, past 128 rows, several passes over the weight:
    fp32 sums of the exact bf16 products, rounded to bf16 once. A layer whose output size
    is no multiple of 64 keeps oneDNN's copy, or none where bf16 layers run widened."""
    from vlmserve.kernels import cpu_extension, linear

    if not linear._pairs_fit(torch.empty(64, 2, dtype=torch.bfloat16)):
        pytest.skip("the pair kernel needs AVX-512 or AVX2 (and no AMX)")
    torch.manual_seed(rows)
    layer = Linear(1100, 3 * 64, bias=bias).to(torch.bfloat16)
    weight = layer.weight.detach().clone()  # the copy may take its place
    layer.pack()
    assert layer.packed_weight is not None and layer.packed_weight.shape == (3, 550, 64, 2)
    x = torch.randn(2, rows, 1100).to(torch.bfloat16)[:1]  # a view: not contiguous in memory
    with torch.inference_mode():  # as in an engine
        got = layer(x)
    want = F.linear(x.float(), weight.float(), None if layer.bias is None else layer.bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 3 * 64)
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), atol=0.02, rtol=8e-3)
    if bias:  # a bias in fp32 is added to the fp32 sums as it is
        got = cpu_kernels().bf16_batch_linear(x, layer.packed_weight, layer.bias.float() + 1e-3)
        torch.testing.assert_close(got.float(), (want + 1e-3).to(torch.bfloat16).float(), atol=0.02, rtol=8e-3)
    odd = Linear(64, 100).to(torch.bfloat16)
    odd.pack()
    if linear.widens_bf16_layers():
        assert odd.packed_weight is None and cpu_extension.available()
    else:
        assert odd.packed_weight is not None and odd.packed_weight.dim() != 4 and cpu_extension.available()


@pytest.mark.parametrize("rows", [0, 1, 3, 7, 600])
def test_a_pair_copy_that_takes_the_weights_place_serves_every_row_count(rows):
    """On a CPU without AMX (AVX512-BF16, AVX-512F or AVX2) a packed bf16 layer keeps its
    pair-layout copy alone (the plain weight goes), and no row (a step whose rows another
    layer took), one row, a batch and a prompt of over 512 rows all run on it: fp32 sums of
    the exact bf16 products, rounded once. With AMX the plain weight stays beside oneDNN's
    packed copy."""
    from vlmserve.kernels import linear

    torch.manual_seed(rows)
    layer = Linear(1100, 3 * 64, bias=True).to(torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    replaces = linear.packed_copy_replaces_weight_cpu(layer.weight)
    memory = layer.weight.data_ptr()
    layer.pack()
    if not replaces:
        assert torch.equal(layer.weight, weight)
        pytest.skip("packed copies take the weight's place on CPUs without AMX")
    assert layer.weight.numel() == 0 and layer.weight.dtype == torch.bfloat16 and layer.packed_weight.dim() == 4
    assert layer.packed_weight.data_ptr() == memory  # packed in the weight's own memory: never two copies
    x = torch.randn(rows, 1100).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
    want = F.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), atol=0.02, rtol=8e-3)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_a_long_input_goes_through_the_mlp_in_slices(monkeypatch, act):
    """Past MLP_SLICE_ROWS rows the gated MLP runs slice by slice (its activations are a
    prompt chunk's largest temporaries): the same output as all rows at once, in the
    input's shape, the last slice partial."""
    from vlmserve.models import layers

    torch.manual_seed(0)
    mlp = layers.GatedMLP(64, 192, act, bias=True).to(torch.bfloat16)
    for m in (mlp.gate_up_proj, mlp.down_proj):
        m.pack()
    x = torch.randn(1, 45, 64).to(torch.bfloat16)
    whole = mlp(x)
    monkeypatch.setattr(layers, "MLP_SLICE_ROWS", 8)
    rows = []
    mlp.gate_up_proj.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    sliced = mlp(x)
    assert rows == [8, 8, 8, 8, 8, 5]
    assert sliced.shape == (1, 45, 64) and sliced.dtype == torch.bfloat16
    torch.testing.assert_close(sliced.float(), whole.float(), atol=0.02, rtol=8e-3)


def test_no_packed_layout_where_there_is_none():
    assert Linear(8, 8).packed_weight is None  # not packed until asked
    half = Linear(8, 8).to(torch.float16)
    assert not half.pack()
    assert half.packed_weight is None  # oneDNN packing is for fp32/bf16 only; fp16 stays plain
    x = torch.randn(16, 8, dtype=torch.float16)
    torch.testing.assert_close(half(x), F.linear(x, half.weight, half.bias))


def test_packing_is_skipped_when_the_copy_would_not_fit():
    from vlmserve.worker import model_loader

    model = torch.nn.Sequential(Linear(64, 64), Linear(64, 64))
    assert model_loader.pack_linear_weights(model, memory_share=1e-12) == 0
    assert all(m.packed_weight is None for m in model)
    assert model_loader.pack_linear_weights(model) == 2 * 64 * 64 * 4
    assert all(m.packed_weight is not None for m in model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tied_output_head_gets_a_packed_copy_and_the_same_logits(tmp_path, dtype):
    """The output head that shares the embedding table is packed like the layers (fp32
    decoding and bf16 batches run on the packed copy), and still reads the table's values;
    where its pair-layout copy takes the table's place, lookups read their rows there."""
    from vlmserve.kernels import kernel_table, linear, use_kernels
    from vlmserve.testing.checkpoints import build_qwen2_5_vl
    from vlmserve.worker.model_loader import load_model

    path = build_qwen2_5_vl(tmp_path / "tied", tie_word_embeddings=True)
    model, _ = load_model(path, dtype, kernel_table("cpu"))
    unpacked, _ = load_model(path, dtype, kernel_table("cpu"), pack_weights=False)
    assert unpacked.lm_head is None  # no copy asked for: the table serves as the head
    table = unpacked.model.language_model.embed_tokens.weight
    embedding = model.model.language_model.embed_tokens
    if dtype == "float32" or not linear.widens_bf16_layers() or linear._pairs_fit(table):
        assert model.lm_head.packed_weight is not None
    if linear._pairs_fit(table):  # one copy: the head's, in the pair layout
        assert embedding.packed_weight is model.lm_head.packed_weight
        assert embedding.weight.numel() == 0 and model.lm_head.weight.numel() == 0
    else:
        assert model.lm_head.weight is embedding.weight
    ids = torch.tensor([[0, 5, table.shape[0] - 1], [64, 63, 127]])
    with use_kernels(kernel_table("cpu")):
        assert torch.equal(model.embed_input_ids(ids), table[ids])
        for rows in (1, 8):
            hidden = torch.randn(rows, table.shape[1]).to(table.dtype)
            want = F.linear(hidden.float(), table.float())
            torch.testing.assert_close(model.compute_logits(hidden).float(), want, atol=0.05, rtol=1e-2)


def test_a_tied_table_is_packed_in_its_own_memory():
    """The head's pair-layout copy is made in the table's memory (no second copy), and the
    table's lookups read it."""
    from vlmserve.kernels import kernel_table, linear, use_kernels
    from vlmserve.models.layers import Embedding
    from vlmserve.worker import model_loader

    if not linear._pairs_fit(torch.empty(64, 2, dtype=torch.bfloat16)):
        pytest.skip("the pair layout is for CPUs with AVX-512 or AVX2 and no AMX")

    model = torch.nn.Module()
    model.embed, model.head = Embedding(256, 64, dtype=torch.bfloat16), Linear(64, 256, bias=False)
    model.head.weight = model.embed.weight
    table, address = model.embed.weight.detach().clone(), model.embed.weight.data_ptr()
    with use_kernels(kernel_table("cpu")):
        model_loader.pack_linear_weights(model)
        assert model.head.packed_weight.data_ptr() == address
        ids = torch.arange(256).flip(0)
        assert torch.equal(model.embed(ids), table[ids])


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
    out, final = gdn.chunk_gated_delta_rule(q, k, v, g, beta, state)
    s = state if with_state else torch.zeros(b, h, dk, dv)
    for i in range(t):
        o, s = gdn.recurrent_gated_delta_rule(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s)
        torch.testing.assert_close(out[:, i], o, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(final, s, atol=2e-4, rtol=2e-4)

    c, kernel = 6, 4
    x, weight = torch.randn(b, t, c), torch.randn(c, kernel)
    conv_state = torch.randn(b, c, kernel - 1) if with_state else None
    y, new_state = gdn.causal_conv1d_prefill(x, weight, conv_state)
    carried = conv_state if with_state else torch.zeros(b, c, kernel - 1)
    for i in range(t):
        yi, carried = gdn.causal_conv1d_decode(x[:, i], weight, carried)
        torch.testing.assert_close(y[:, i], yi, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, carried)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dk,dv,c", [(16, 8, 12), (32, 64, 300), (16, 128, 520)])
def test_recurrent_ops_of_a_mixed_batch_equal_the_portable_ones(dtype, dk, dv, c):
    """The C++ conv1d and gated delta rule (the recurrence, token by token) against the
    portable ones (chunked): decodes and prefills, fresh and resuming states in their
    slots, several 64-token chunks, grouped key heads; and two verification queries of
    speculative decoding, whose states after each draft go to checkpoint slots. Value
    heads of 64 and 128 take the kernel's fixed-size paths, others the generic one; over
    256 channels the conv splits a sequence's channels between work items."""
    from vlmserve.kernels import cpu_extension
    from vlmserve.kernels.gdn import (
        build_recurrent_metadata,
        causal_conv1d,
        causal_conv1d_cpu,
        gated_delta_rule,
        gated_delta_rule_cpu,
    )

    assert cpu_extension.available()
    torch.manual_seed(0)
    hk, h, kernel, num_slots = 2, 4, 4, 14
    slots, num_computed, query_lens = [3, 0, 7, 5, 2, 8, 1, 6], [10, 4, 0, 30, 0, 70, 20, 15], [1, 1, 5, 40, 130, 64, 3, 4]
    checkpoints = [[]] * 6 + [[10, 11], [12, 13, 4]]
    meta = build_recurrent_metadata(slots, num_computed, query_lens, checkpoint_slots=checkpoints)
    assert len(meta.draft_groups) == 2
    t = sum(query_lens)
    q, k = torch.randn(t, hk, dk).to(dtype), torch.randn(t, hk, dk).to(dtype)
    v = torch.randn(t, h, dv).to(dtype)
    g, beta = -torch.rand(t, h), torch.rand(t, h)
    state = torch.randn(num_slots, h, dk, dv)
    x, weight = torch.randn(t, c).to(dtype), torch.randn(c, kernel).to(dtype)
    conv_state = torch.randn(num_slots, c, kernel - 1).to(dtype)
    ref_state, ref_conv_state = state.clone(), conv_state.clone()
    out = gated_delta_rule_cpu(q, k, v, g, beta, state, meta)
    ref = gated_delta_rule(q, k, v, g, beta, ref_state, meta)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(state, ref_state, atol=tol, rtol=tol)  # every slot: the untouched ones too
    y = causal_conv1d_cpu(x, weight, conv_state, meta)
    y_ref = causal_conv1d(x, weight, ref_conv_state, meta)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(conv_state, ref_conv_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_elementwise_ops_equal_the_portable_ones(dtype):
    """RMSNorm (plain, zero-centred, gated; the weight in x's dtype or fp32; after a
    residual addition, bit for bit as adding then norming), rotary (whole and partial heads
    of q and k as views of one projection; cos/sin in fp32 or x's dtype) and silu-and-mul:
    the one-pass C++ ops against torch's chains, in fp32 and bf16."""
    from vlmserve.kernels import cpu_extension, linear, norms, rotary

    assert cpu_extension.available()
    torch.manual_seed(0)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    x, gate, weight = torch.randn(37, 96).to(dtype), torch.randn(37, 96).to(dtype), torch.randn(96).to(dtype)
    for w in (weight, weight.float()):
        for fast, ref, args in ((norms.rms_norm_cpu, norms.rms_norm, (x, w, 1e-6)),
                                (norms.rms_norm_zero_centered_cpu, norms.rms_norm_zero_centered, (x, w, 1e-6)),
                                (norms.gated_rms_norm_cpu, norms.gated_rms_norm, (x, gate, w, 1e-6))):
            out = fast(*args)
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), ref(x.float(), *args[1:]).float(), **tol)
        for fused, norm in ((norms.add_rms_norm_cpu, norms.rms_norm_cpu),
                            (norms.add_rms_norm_zero_centered_cpu, norms.rms_norm_zero_centered_cpu)):
            total, normed = fused(x, gate, w, 1e-6)  # the residual sum and its norm: as adding, then norming
            assert torch.equal(total, x + gate) and torch.equal(normed, norm(x + gate, w, 1e-6))
    fused = torch.randn(37, 7 * 64).to(dtype)  # q (5 heads) and k (2) of one projection
    for heads in (fused[:, :5 * 64].view(37, 5, 64), fused[:, 5 * 64:].view(37, 2, 64)):  # views, not copies
        for rot in (64, 32):
            angles = torch.rand(37, rot // 2) * 6
            cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
            for tables in ((cos, sin), (cos.to(dtype), sin.to(dtype))):
                out = rotary.apply_rotary_cpu(heads, *tables)
                assert out.dtype == dtype and out.is_contiguous()
                want = rotary.apply_rotary(heads.float(), *(t.float() for t in tables))
                torch.testing.assert_close(out.float(), want, **tol)
    gate_up = torch.randn(37, 2 * 80).to(dtype)
    torch.testing.assert_close(linear.silu_and_mul_cpu(gate_up).float(), linear.silu_and_mul(gate_up.float()), **tol)


@pytest.mark.parametrize("rows", [4, 5, 16, 17, 32, 33])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("depth", [320, 2080])
def test_bf16_batched_decode_linear_equals_an_fp32_product_rounded_once(rows, bias, depth):
    """4 to 32 rows of a bf16 layer take the AMX kernel (CPUs with AMX-BF16): fp32 sums of
    the exact bf16 products, rounded to bf16 once, over several blocks of 32 weight rows
    (and, at 2,080 inputs, x rearranged by both threads in unequal parts)."""
    from vlmserve.kernels import cpu_extension, linear

    torch.manual_seed(rows)
    weight = torch.randn(3 * 32, depth).to(torch.bfloat16)
    b = torch.randn(3 * 32).to(torch.bfloat16) if bias else None
    x = torch.randn(2, rows, depth).to(torch.bfloat16)[:1]  # a view: not contiguous in memory
    got = linear.linear_cpu(x, weight, b)
    want = F.linear(x.float(), weight.float(), None if b is None else b.float())
    assert got.dtype == torch.bfloat16 and got.shape == (1, rows, 3 * 32)
    torch.testing.assert_close(got.float(), want, atol=0.05 * (depth / 320) ** 0.5, rtol=1e-2)
    if rows <= linear.AMX_MAX_ROWS and cpu_extension.has_amx():
        # the kernel's own: equal to the fp32 product rounded once, up to the order of its sums
        torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), atol=0.02, rtol=8e-3)
        torch.testing.assert_close(got, cpu_kernels().amx_linear(x, weight, b), atol=0, rtol=0)


@pytest.mark.parametrize("seq_lens", [[7, 7, 7], [16, 15, 16, 14], [5, 9, 5, 12, 9, 1]])
def test_varlen_attention_attends_within_each_sequence(seq_lens):
    """The vision tower's attention: every token sees its own sequence both ways and no
    other, for sequences of one length (one batched call), of near lengths (padded, with
    a mask) and of far ones (one call per length), against the float64 reference."""
    from vlmserve.kernels.attention import varlen_attention

    torch.manual_seed(len(seq_lens))
    n = sum(seq_lens)
    q, k, v = (torch.randn(n, 4, 16) for _ in range(3))
    out = varlen_attention(q, k, v, seq_lens, 0.25)
    start = 0
    for length in seq_lens:
        rows = slice(start, start + length)
        ref = dense_attention(q[rows], k[rows], v[rows], 0.25, key_ends=[length - 1] * length)
        torch.testing.assert_close(out[rows].double(), ref, atol=2e-5, rtol=2e-5)
        start += length


@pytest.mark.parametrize("heads,head_dim,seq_lens", [
    (16, 80, [64, 64, 48, 64, 17]),  # Qwen2.5-VL's windows, edge windows shorter
    (2, 80, [700]),  # a frame past the query and key blocks (64, 128); its queries in shares, each packing the keys
    (3, 72, [5, 300, 1]),  # Qwen3-VL's head size: a part of a 16-lane group
    (2, 128, [33, 257]),  # more output lanes than the registers hold at once
])
def test_bf16_varlen_attention_kernel(heads, head_dim, seq_lens):
    """The C++ kernel for bf16 (both products on AVX512-BF16's dot product): each sequence
    attended both ways on its own, from views of one qkv tensor (strided rows), as close
    to the float64 reference as torch's own bf16 attention is."""
    from vlmserve.kernels import attention, cpu_extension

    if not (cpu_extension.available() and cpu_extension.has_bf16_dot()):
        pytest.skip("the kernel needs AVX512-BF16")
    torch.manual_seed(head_dim)
    n, scale = sum(seq_lens), head_dim**-0.5
    q, k, v = torch.randn(n, 3, heads, head_dim, dtype=torch.bfloat16).unbind(1)
    out = attention.varlen_attention_kernel(q, k, v, seq_lens, scale)
    own = attention.varlen_attention(q, k, v, seq_lens, scale)  # torch's, in bf16
    assert out.dtype == torch.bfloat16 and out.shape == (n, heads, head_dim)
    start = 0
    for length in seq_lens:
        rows = slice(start, start + length)
        ref = dense_attention(q[rows].double(), k[rows].double(), v[rows].double(), scale,
                              key_ends=[length - 1] * length)
        torch_error = (own[rows].double() - ref).abs().max().item()
        assert (out[rows].double() - ref).abs().max().item() <= 1.5 * torch_error + 1e-3
        start += length


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_equals_torchs_argmax(dtype):
    """Greedy decoding's argmax in C++: torch's index on every row — a real vocabulary's
    width and widths that leave a tail past the vectors, the first of tied maxima, a NaN
    counting as the largest (the first NaN), +inf, and rows that are -inf throughout."""
    from vlmserve.kernels import sampling

    torch.manual_seed(0)
    cases = [torch.randn(rows, vocab).to(dtype) for rows, vocab in ((1, 151_936), (33, 4099), (3, 7), (2, 1))]
    special = torch.full((6, 100), float("-inf")).to(dtype)
    special[1, [37, 80]] = 5.0  # tied: the first
    special[2, [10, 50, 90]] = torch.tensor([1e30, float("nan"), float("nan")]).to(dtype)  # NaN wins, the first
    special[3, 99] = -1.0  # the last index
    special[4, [3, 60]] = torch.tensor([float("inf"), 2.0]).to(dtype)
    special[5, 7] = float("nan")  # NaN in the tail past 96
    special[5, 97] = float("nan")
    cases.append(special)
    for logits in cases:
        got = sampling.argmax_rows_cpu(logits)
        assert got.dtype == torch.long and torch.equal(got, logits.argmax(dim=-1)), logits.shape
    assert sampling.argmax_rows_cpu(special).tolist() == [0, 37, 50, 99, 3, 7]


@pytest.mark.parametrize("nbytes", [4096, 24 << 20])  # a plain tensor; a mapping of its own, on 2 MB pages
def test_streamed_memory_is_zero_filled_without_being_written(nbytes):
    """The KV cache is not cleared at start: attention reads whole blocks, masked past each
    sequence's end, and a masked position must hold a finite number (0 * NaN is NaN)."""
    from vlmserve.kernels.huge_pages import zeros_on_huge_pages

    for dtype in (torch.bfloat16, torch.float32):
        t = zeros_on_huge_pages((nbytes // dtype.itemsize,), dtype)
        assert t.is_contiguous() and not t.any()
        t.fill_(float("nan"))  # memory handed back and taken again is cleared again
        del t


def test_each_copy_of_the_kernel_sources_builds_in_a_folder_of_its_own(tmp_path):
    """Two checkouts of the same sources (or an installed copy beside a checkout) build in
    folders of their own: sharing one, each one's build recompiled the other's and a process
    of the one waited minutes on the other's lock. The same copy always finds its folder,
    and a changed source takes a new one."""
    import shutil

    copies = [tmp_path / "a", tmp_path / "b"]
    for copy in copies:
        shutil.copytree(cpu_extension.CSRC, copy)
    names = [cpu_extension.build_name(copy) for copy in copies]
    assert names[0] != names[1] and cpu_extension.build_name(cpu_extension.CSRC) not in names
    assert cpu_extension.build_name(copies[0]) == names[0]
    (copies[0] / "gemv_bf16.cpp").write_text((copies[0] / "gemv_bf16.cpp").read_text() + "\n")
    changed = cpu_extension.build_name(copies[0])
    assert changed != names[0]
    (copies[0] / "split_off.cpp").write_text("")  # every .cpp in the folder is built, and counts
    assert cpu_extension.build_name(copies[0]) != changed
