"""LoRA's low-rank product added to a layer's output, for a batch whose tokens use
different adapters: out[t] += (x[t] A_s^T) B_s^T with s the slot of token t's adapter.

Every adapter in use sits in a slot of the layer's stacked A [slots, R, in] and
B [slots, out, R]; the batch's tokens come as groups that share a slot. On the CPU each
group is two small matmuls over its rows (a slice where the group's tokens are
contiguous, as a request's are); never a weight merged per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlmserve.kernels.registry import register


@dataclass
class LoRAMapping:
    """Which slot each token of a forward uses: per token (-1: no adapter; None: every
    row uses the one group's slot), and as groups of rows (a slice, or an index tensor)
    per slot in use."""

    token_slots: torch.Tensor | None  # [tokens] int32
    groups: list[tuple[int, slice | torch.Tensor]]
    derived: dict[Any, Any] = field(default_factory=dict)  # what a kernel computes from it once per forward

    def slots_of(self, num_rows: int, device: torch.device) -> torch.Tensor:
        if self.token_slots is not None:
            return self.token_slots
        return torch.full((num_rows,), self.groups[0][0], dtype=torch.int32, device=device)


@register("add_lora")
def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mapping: LoRAMapping) -> None:
    """out [tokens, out] += each token's adapter's product, in place."""
    for slot, rows in mapping.groups:
        delta = (x[rows] @ a[slot].T) @ b[slot].T
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)
