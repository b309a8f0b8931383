"""The host tier's bytes (core/host_kv_tier.py keeps its books): a slot holds one KV block
of every attention layer, keys and values, as the device cache lays it out. Each step's
saves (device -> host) run before its loads (host -> device), both before its forward."""

from __future__ import annotations

import torch

from vlmserve.core.host_kv_tier import KVTransfers


class HostKVStore:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        """kv_caches: the attention layers' key and value caches, block id first (each
        tensor once)."""
        # bytes, whatever the cache's dtype (an FP8 cache has no index ops of its own)
        self.device_caches = [t.view(torch.uint8) for t in kv_caches]
        pin = kv_caches[0].device.type == "cuda"
        self.host_caches = [torch.empty((num_slots, *t.shape[1:]), dtype=torch.uint8, pin_memory=pin)
                            for t in self.device_caches]
        self.bytes_per_block = sum(t[0].numel() for t in self.host_caches)

    def apply(self, transfers: KVTransfers) -> None:
        if transfers.saves:
            blocks, slots = zip(*transfers.saves)
            self._copy(self.device_caches, blocks, self.host_caches, slots)
        if transfers.loads:
            slots, blocks = zip(*transfers.loads)
            self._copy(self.host_caches, slots, self.device_caches, blocks)

    @staticmethod
    def _copy(sources: list[torch.Tensor], rows: tuple[int, ...], destinations: list[torch.Tensor],
              to_rows: tuple[int, ...]) -> None:
        src_index = torch.tensor(rows, dtype=torch.int64, device=sources[0].device)
        dst_index = torch.tensor(to_rows, dtype=torch.int64, device=destinations[0].device)
        for src, dst in zip(sources, destinations):
            dst.index_copy_(0, dst_index, src.index_select(0, src_index).to(dst.device))
