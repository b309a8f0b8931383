"""The runner's LoRA adapters: read from their folders on first use, kept in memory (up
to max_cpu_loras), and put into one of `max_loras` slots of the model's layers when a
step needs them; least recently used slots are reused. The scheduler never runs more
adapters at once than there are slots, so a step's adapters always fit.

Before each forward the runner tells the layers which slot each token uses."""

from __future__ import annotations

from collections import OrderedDict

import torch

from vlmserve.kernels.lora import LoRAMapping
from vlmserve.lora.adapter import LoRAAdapter, LoRATarget, read_adapter
from vlmserve.lora.request import LoRARequest
from vlmserve.models.layers import Linear
from vlmserve.models.lora import LoRABatch
from vlmserve.models.tensor_parallel import weight_part


def lora_targets(model: torch.nn.Module) -> dict[str, LoRATarget]:
    """What an adapter of this model may adapt: checkpoint name -> shapes, the whole
    layer's where it is split across ranks (the front end checks adapters against it)."""
    out = {}
    for name, (layer, shard) in model.lora_layers().items():
        part = weight_part(layer, shard)
        rows = part.whole() if part is not None and part.dim == 0 else layer.shard_sizes_out[shard]
        columns = part.whole() if part is not None and part.dim == 1 else layer.in_features
        out[name] = LoRATarget(columns, rows, model.is_vision_layer(name))
    return out


def rank_share(layer: Linear, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's A and B as this rank applies them: a column-parallel layer keeps B's rows
    of its outputs; a row-parallel one A's columns of its inputs (the ranks' partial
    products are summed with the layer's own, x A^T B^T being linear in x's parts)."""
    part = weight_part(layer, shard)
    if part is None:
        return a, b
    return (a, part.take(b)) if part.dim == 0 else (part.take(a), b)


class LoRASlots:
    def __init__(self, model: torch.nn.Module, num_slots: int, max_rank: int, max_cpu_loras: int | None,
                 device: torch.device) -> None:
        self.model = model
        self.layers: dict[str, tuple[Linear, int]] = model.lora_layers()
        self.targets = lora_targets(model)
        self.num_slots, self.max_rank = num_slots, max_rank
        self.max_cpu_loras = max(max_cpu_loras or num_slots, num_slots)
        self.device = device
        self.batch = LoRABatch()
        self.slot_ids: list[int | None] = [None] * num_slots  # the adapter (lora_int_id) in each slot
        self.slot_used = [0] * num_slots  # when each slot was last used (a step count)
        self.clock = 0
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # read adapters, least recent first
        self.adapted: set[Linear] = set()  # layers that have slots

    def touches_vision(self, lora: LoRARequest) -> bool:
        return self.load(lora).touches_vision

    # -- the mapping of a forward ---------------------------------------------------------
    def set_tokens(self, loras: list[LoRARequest | None], counts: list[int]) -> None:
        """The next forward's tokens: counts[i] tokens of a request under loras[i] (None:
        the base model), in order."""
        self.clock += 1
        in_use = {lora.lora_int_id for lora in loras if lora}
        slots = [self._slot(lora, in_use) if lora else -1 for lora in loras]
        if all(s < 0 for s in slots):
            self.batch.mapping = None
            return
        token_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int32), torch.tensor(counts))
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot in sorted(set(slots) - {-1}):
            rows = (token_slots == slot).nonzero().flatten()
            first, last = int(rows[0]), int(rows[-1])
            # a slot's tokens in one run (a lone request, or neighbours): a slice, no gather
            groups.append((slot, slice(first, last + 1) if last - first + 1 == len(rows) else rows.to(self.device)))
        self.batch.mapping = LoRAMapping(token_slots.to(self.device), groups)

    def set_all(self, lora: LoRARequest | None) -> None:
        """Every row of the next forward under one adapter (or none): an encoder run, whose
        layers see patches, then merged patches."""
        self.clock += 1
        self.batch.mapping = None if lora is None else \
            LoRAMapping(None, [(self._slot(lora, {lora.lora_int_id}), slice(None))])

    def clear(self) -> None:
        self.batch.mapping = None

    # -- slots ----------------------------------------------------------------------------
    def _slot(self, lora: LoRARequest, in_use: set[int]) -> int:
        """The slot holding the adapter, filled now if none does (the least recently used
        slot that no adapter of this forward needs)."""
        if lora.lora_int_id in self.slot_ids:
            slot = self.slot_ids.index(lora.lora_int_id)
        else:
            free = [i for i, held in enumerate(self.slot_ids) if held is None or held not in in_use]
            if not free:
                raise RuntimeError(f"{len(in_use)} adapters in one step, over the {self.num_slots} LoRA slots")
            slot = min(free, key=lambda i: (self.slot_ids[i] is not None, self.slot_used[i]))
            self._fill(slot, self.load(lora))
            # used by a step: the most recent (steps are the same on every rank, so every
            # rank keeps the same adapters)
            self.adapters.move_to_end(lora.lora_int_id)
            self.slot_ids[slot] = lora.lora_int_id
        self.slot_used[slot] = self.clock
        return slot

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer in self.adapted:
            layer.lora.clear(slot)
        for name, (a, b) in adapter.modules.items():
            layer, shard = self.layers[name]
            if layer not in self.adapted:
                layer.enable_lora(self.batch, self.num_slots, self.max_rank)
                self.adapted.add(layer)
            layer.lora.set_shard(slot, shard, *rank_share(layer, shard, a, b))

    def load(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter's weights, read from its folder the first time (checked by the
        front end already: a failure here is the folder changing under the server)."""
        adapter = self.adapters.get(lora.lora_int_id)
        if adapter is None:
            adapter = read_adapter(lora.lora_path, self.targets, self.max_rank, self.model.canonical_name)
            self.add(lora, adapter)
        return adapter

    def add(self, lora: LoRARequest, adapter: LoRAAdapter) -> None:
        """Keeps an adapter read elsewhere (by rank 0, for the other ranks), as the most
        recently used."""
        self.adapters[lora.lora_int_id] = adapter
        self.adapters.move_to_end(lora.lora_int_id)
        while len(self.adapters) > self.max_cpu_loras:
            self.adapters.popitem(last=False)
