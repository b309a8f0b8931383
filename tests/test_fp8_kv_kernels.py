"""FP8 KV caches in the CPU kernels: the write quantizes as torch does (ties to even,
saturated at +-448), and paged attention over an FP8 cache equals the float64 reference over
the numbers the cache holds, on every path the C++ kernel has (AVX512-BF16's pairs, AVX2,
the sizes compiled in and not; tests/older_cpus.py runs this file again for the older
instruction sets) and in the portable version, which is the reference of the others."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_kernels import assert_equals_dense, bidirectional_case, paged_case
from vlmserve.kernels import attention, cpu_extension
from vlmserve.kernels.attention import (FP8_KV_DTYPE, build_attention_metadata, dequantize_kv, kv_cache_shapes,
                                        quantize_kv, read_kv_cache, write_kv_cache)
from vlmserve.kernels.cpu_extension import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_extension.available(), reason="needs vlmserve's CPU kernels")

SCALES = [(1.0, 1.0), (0.25, 2.0)]  # powers of two: x / scale is exact, in C++ as in torch


def fp8_case(num_computed, query_lens, kv_heads, d, block_size, dtype, k_scale, v_scale, num_blocks=256, seed=0):
    """paged_case with FP8 caches (its history quantized by the scales, as the write does),
    and everything the reference attends to as the numbers the cache holds."""
    k_cache, v_cache, tables, history, new_k, new_v = paged_case(num_computed, query_lens, kv_heads, d, block_size,
                                                                 num_blocks, dtype, seed)
    # the caches' layouts are elementwise: quantizing the whole cache is writing each value quantized
    k8, v8 = quantize_kv(k_cache, k_scale), quantize_kv(v_cache, v_scale)

    def held(x, scale):
        return dequantize_kv(quantize_kv(x, scale), scale)

    history = [(held(k, k_scale), held(v, v_scale)) for k, v in history]
    return k8, v8, tables, history, new_k, new_v, (held(new_k, k_scale), held(new_v, v_scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_the_fp8_write_quantizes_as_torch_does(dtype, k_scale, v_scale):
    """Byte for byte, C++ against the portable write: ties to even, subnormals, values past
    +-448 saturated (a plain cast makes them NaN), a NaN kept NaN."""
    k_shape, v_shape = kv_cache_shapes(10, 16, 2, 64)
    caches = [torch.zeros(k_shape, dtype=FP8_KV_DTYPE), torch.zeros(v_shape, dtype=FP8_KV_DTYPE)]
    ref = [torch.zeros_like(c) for c in caches]
    slots = torch.tensor([17, 3, 159, 80, 81, 16])
    k, v = torch.randn(6, 2, 64) * 4, torch.randn(6, 2, 64)
    special = torch.tensor([2.625, -2.625, 0.65625, 5.25, 3 * 2**-11, 2**-10, 1e-5, 0.0, 447.0, 460.0, 1000.0,
                            -1e6, 1e30, float("nan"), 2**-6, 2**-7 * 1.5])
    k[0, 0, : len(special)] = special * k_scale
    v[1, 1, : len(special)] = special * v_scale
    k, v = k.to(dtype), v.to(dtype)
    cpu_kernels().write_kv_cache(k, v, *caches, slots, k_scale, v_scale)
    write_kv_cache(k, v, *ref, slots, k_scale, v_scale)
    for got, want in zip(caches, ref):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    keys, values = read_kv_cache(*caches, slots // 16, slots % 16)
    assert dequantize_kv(keys, k_scale).abs().nan_to_num().max() <= 448 * k_scale  # saturated, not infinite
    held = dequantize_kv(values[1, 1, : len(special)], v_scale)
    assert held[10].item() == 448 * v_scale and held[11].item() == -448 * v_scale and held[13].isnan()
    assert held[0].item() == 2.5 * v_scale and held[4].item() == 2**-9 * v_scale  # ties to even; a subnormal


@pytest.mark.parametrize("impl", ["portable", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,block_size", [(16, 4), (16, 16), (64, 16), (128, 16), (128, 32), (256, 16), (80, 16)])
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_over_an_fp8_cache_equals_dense_attention(impl, dtype, d, block_size, window):
    """A mixed batch (decodes, a fresh prefill, a chunk over a cached prefix, one crossing
    query tiles) over FP8 caches with scales: the head and block sizes that take the
    AVX512-BF16 path (bf16, blocks of 16, heads a multiple of 16), the AVX2 one (fp32, and
    bf16 on older CPUs), those compiled in (blocks of 32) and not (blocks of 4, heads of 80)."""
    num_computed, query_lens = [0, 7, 33, 0, 40, 5, 100], [1, 1, 1, 23, 17, 70, 9]
    k_scale, v_scale = 0.25, 2.0
    k8, v8, tables, history, new_k, new_v, held_new = fp8_case(num_computed, query_lens, 2, d, block_size, dtype,
                                                               k_scale, v_scale)
    meta = build_attention_metadata(tables, num_computed, query_lens, block_size, window)
    q = torch.randn(sum(query_lens), 8, d, generator=torch.Generator().manual_seed(d)).to(dtype)
    fn = attention.paged_attention if impl == "portable" else attention.paged_attention_cpu
    out = fn(q, new_k, new_v, k8, v8, meta, d**-0.5, k_scale, v_scale)
    assert out.dtype == dtype
    assert_equals_dense(out, q, history, *held_new, query_lens, d**-0.5, window,
                        tol=1e-2 if dtype == torch.bfloat16 else 2e-5)


@pytest.mark.parametrize("impl", ["portable", "cpu"])
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
def test_fp8_pictures_that_attend_both_ways(impl, k_scale, v_scale):
    """Gemma 3's mask over FP8 caches, unit scales and others."""
    num_computed, query_lens, case, key_ends = bidirectional_case(16)
    k_cache, v_cache, tables, history, new_k, new_v = case
    held = [(dequantize_kv(quantize_kv(k, k_scale), k_scale), dequantize_kv(quantize_kv(v, v_scale), v_scale))
            for k, v in history + [(new_k, new_v)]]
    meta = build_attention_metadata(tables, num_computed, query_lens, 16, 20, key_ends=np.concatenate(key_ends))
    q = torch.randn(sum(query_lens), 4, 16, generator=torch.Generator().manual_seed(3))
    fn = attention.paged_attention if impl == "portable" else attention.paged_attention_cpu
    out = fn(q, new_k, new_v, quantize_kv(k_cache, k_scale), quantize_kv(v_cache, v_scale), meta, 0.25, k_scale,
             v_scale)
    assert_equals_dense(out, q, held[:-1], *held[-1], query_lens, 0.25, 20, key_ends)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_long_chunks_on_flash_attention_see_the_cached_numbers(dtype):
    """The split of attend_cpu (long chunks by flash attention, on CPUs with AMX): a chunk
    attends to its own keys and values as the FP8 cache holds them, as the paged kernel does."""
    n = attention.FLASH_MIN_QUERY
    num_computed, query_lens = [0, 5, n + 37, 0], [n + 3, 1, n, 20]
    k8, v8, tables, history, new_k, new_v, held_new = fp8_case(num_computed, query_lens, 2, 16, 16, dtype, 0.5, 2.0,
                                                               num_blocks=128)
    meta = build_attention_metadata(tables, num_computed, query_lens, 16)
    q = torch.randn(sum(query_lens), 8, 16).to(dtype)
    out = attention.attend_cpu(q, new_k, new_v, k8, v8, meta, 0.25, flash_from=n, k_scale=0.5, v_scale=2.0)
    assert_equals_dense(out, q, history, *held_new, query_lens, 0.25, tol=1e-2 if dtype == torch.bfloat16 else 2e-5)


def test_an_fp8_cache_is_read_by_the_kernel_as_the_portable_version_reads_it():
    """The C++ kernel's widening of FP8 blocks (a vector at a time, its tail one by one) over
    every byte value but NaN's, at a head size whose blocks have a tail (80 x 4 = 320 values)."""
    k_shape, v_shape = kv_cache_shapes(4, 4, 1, 80)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN's codes: a NaN key would make every output NaN
    k8 = codes.repeat(8)[: int(np.prod(k_shape))].reshape(k_shape).view(FP8_KV_DTYPE)
    v8 = codes.flip(0).repeat(8)[: int(np.prod(v_shape))].reshape(v_shape).view(FP8_KV_DTYPE)
    k8, v8 = k8.clone(), v8.clone()
    tables = np.array([[1, 2, 3]])
    meta = build_attention_metadata(tables, [10], [1], 4)
    q = torch.randn(1, 2, 80) * 1e-3  # small scores: every value weighs in
    none = torch.zeros(1, 1, 80)  # this step's key and value: zero bytes, written to slot 10
    ref = attention.paged_attention(q, none, none, k8.clone(), v8.clone(), meta, 1.0, 0.5, 1.0)
    out = attention.paged_attention_cpu(q, none, none, k8, v8, meta, 1.0, 0.5, 1.0)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
