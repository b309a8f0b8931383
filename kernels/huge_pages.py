"""Tensors on transparent huge pages (2 MB), for weights a decode step streams.

Reading a gigabyte-sized weight once per step, a CPU takes a TLB miss every 4 KB page
and its prefetchers stop at each page's end; on 2 MB pages the quantized GEMVs stream
3-8% faster (measured, docs/quantization.md). Linux gives huge pages to memory that asks
for them (`madvise`, the usual THP setting) before its pages are first touched, so the
tensor gets a private anonymous mapping of its own, advised before it is written. Where
that is not possible (another OS, THP off) it is an ordinary tensor.

The tensors are zero-filled, and not by writing them: the kernel zero-fills an anonymous
mapping's pages as they are first touched, so a KV cache takes memory (and the time to
clear it: 0.5 GB took 1.5 s at start on a cloud VM) as its blocks are first used.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 4 * HUGE_PAGE  # below this, a mapping of its own is not worth it


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous tensor whose memory is advised onto huge pages (none of it
    touched here)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < MIN_BYTES or advice is None:
        return torch.zeros(shape, dtype=dtype)
    # one huge page more than needed, so that the tensor can start on a 2 MB boundary; only
    # its whole huge pages are advised (a partly used last one would add up to 2 MB of RSS),
    # and the pages around it are never touched
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while it lives
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(advice, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP not built into this kernel
        pass
    return whole[start : start + nbytes].view(dtype).view(shape)
