"""The model's side of LoRA: each adaptable layer holds its slots' low-rank weights, and
every such layer reads the one `LoRABatch` that the runner sets before each forward."""

from __future__ import annotations

import torch

from vlmserve.kernels import ops
from vlmserve.kernels.lora import LoRAMapping


class LoRABatch:
    """Which adapter slot each token of the forward about to run uses (None: no token
    uses one); shared by all the model's LoRA layers."""

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None


class LinearLoRA:
    """A layer's slots: A [slots, shards * max_rank, in] and B [slots, out, shards * max_rank].
    A fused layer's projections (q, k, v) each have their own block of ranks: B is
    block-diagonal, so one product serves them all. Unused ranks and slots are zero."""

    def __init__(self, batch: LoRABatch, num_slots: int, in_features: int, shard_sizes: list[int], max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.batch = batch
        self.max_rank = max_rank
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.shard_sizes = shard_sizes
        ranks = max_rank * len(shard_sizes)
        self.a = torch.zeros(num_slots, ranks, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, sum(shard_sizes), ranks, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set_shard(self, slot: int, shard: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Puts one projection's A [rank, in] and scaled B [shard out, rank] in a slot."""
        rank, start = a.shape[0], shard * self.max_rank
        out = self.shard_offsets[shard]
        self.a[slot, start : start + rank].copy_(a)
        self.b[slot, out : out + self.shard_sizes[shard], start : start + rank].copy_(b)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        mapping = self.batch.mapping
        if mapping is None:
            return out
        flat = out.view(-1, out.shape[-1])
        ops.add_lora(flat, x.reshape(-1, x.shape[-1]), self.a, self.b, mapping)
        return out
