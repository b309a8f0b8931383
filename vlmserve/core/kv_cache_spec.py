"""What state each layer keeps, and how layers are grouped into KV cache groups."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vlmserve.config import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from vlmserve.core.mooncake_pool import PoolSettings


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int

    def max_blocks_for(self, num_tokens: int, query_len: int = 1) -> int:
        """Most blocks one request of num_tokens holds in this group at once, computing
        up to query_len tokens a step."""
        return math.ceil(num_tokens / self.block_size)


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (keys and values)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * elem


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    pass


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int  # a query sees itself and the sliding_window - 1 tokens before it

    def max_blocks_for(self, num_tokens: int, query_len: int = 1) -> int:
        # the first query token's window, through the last query token; it can straddle
        # one more block than it covers
        span = self.sliding_window + query_len - 1
        return min(super().max_blocks_for(num_tokens), math.ceil(span / self.block_size) + 1)


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """Recurrent layers (Gated DeltaNet): a constant-size state per request — the conv
    window and the delta-rule state — however long the sequence. It takes no KV blocks;
    it lives in state slots, and prefix caching keeps snapshots of it at block
    boundaries."""

    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    dtype: torch.dtype  # of the conv window; the delta-rule state is always fp32

    @property
    def slot_bytes(self) -> int:
        """Bytes of one state slot of one layer."""
        conv = math.prod(self.conv_shape) * torch.empty((), dtype=self.dtype).element_size()
        return conv + math.prod(self.ssm_shape) * 4

    def max_blocks_for(self, num_tokens: int, query_len: int = 1) -> int:
        return 0


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers with equal specs; they share block ids (each in its own tensor)."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype attention layers keep their keys and values in, by its --kv-cache-dtype name:
    the model's, or float8 e4m3fn (one byte a value, with a scale per layer for keys and one
    for values: kernels/attention.py)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: one of {', '.join(KV_CACHE_DTYPES)}")
    return model_dtype if name == "auto" else torch.float8_e4m3fn


def with_kv_cache_dtype(layer_specs: dict[int, KVCacheSpec], dtype: torch.dtype) -> dict[int, KVCacheSpec]:
    """The attention layers' specs with their keys and values in dtype (an FP8 cache's pages
    are half a bf16 cache's: twice the blocks in the same memory); recurrent layers' states
    keep theirs."""
    return {layer: dataclasses.replace(spec, dtype=dtype) if isinstance(spec, AttentionSpec) else spec
            for layer, spec in layer_specs.items()}


def group_layers(layer_specs: dict[int, KVCacheSpec]) -> list[KVCacheGroup]:
    """Groups layers by spec, in order of first appearance."""
    groups: dict[KVCacheSpec, list[int]] = {}
    for layer_id, spec in layer_specs.items():
        groups.setdefault(spec, []).append(layer_id)
    return [KVCacheGroup(spec, tuple(ids)) for spec, ids in groups.items()]


@dataclass
class KVCacheConfig:
    """The layout the KV cache manager and the model runner agree on.

    One block pool is shared by all groups; block id b of group g lives in the tensors
    of g's layers. Tensor slot j is shared by the j-th layer of every group, which
    works because a block id belongs to one group at a time — so the memory budget is
    num_blocks x page size x (layers in the largest group), whatever the mix of groups.
    """

    num_blocks: int
    groups: list[KVCacheGroup]
    num_state_slots: int = 0  # for recurrent groups: live states plus prefix-cache snapshots
    num_state_snapshots: int = 0  # of those, the most that snapshots hold at once
    num_host_blocks: int = 0  # the host tier's slots for evicted blocks (--kv-offloading-size)
    pool: PoolSettings | None = None  # a Mooncake pool shared by engines (--kv-transfer-config)

    @property
    def num_tensor_slots(self) -> int:
        return max((len(g.layer_ids) for g in self.groups if isinstance(g.spec, AttentionSpec)), default=0)

    def tensor_slot_of_layer(self) -> dict[int, int]:
        return {layer: j for g in self.groups for j, layer in enumerate(g.layer_ids)}


def state_slot_bytes(groups: list[KVCacheGroup], layers: range | None = None) -> int:
    """Bytes of one state slot across every recurrent layer (of `layers`: a pipeline
    stage's; None: all)."""
    return sum(sum(layers is None or i in layers for i in g.layer_ids) * g.spec.slot_bytes
               for g in groups if isinstance(g.spec, MambaSpec))


def blocks_for_memory(groups: list[KVCacheGroup], memory_bytes: int, extra_bytes_per_block: int = 0,
                      layers: range | None = None) -> int | None:
    """Blocks that fit memory_bytes; extra_bytes_per_block: what other layers on the same
    block ids take (a draft model's). layers: those a pipeline stage holds (None: all),
    in the tensor slots they use (KVCacheConfig.tensor_slot_of_layer); None where they
    hold no attention."""
    attention = [g for g in groups if isinstance(g.spec, AttentionSpec)]
    slots = {j for g in attention for j, i in enumerate(g.layer_ids) if layers is None or i in layers}
    if not slots:
        return None
    page = max(g.spec.page_size_bytes for g in attention)
    return max(2, memory_bytes // (page * len(slots) + extra_bytes_per_block))
