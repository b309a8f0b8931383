"""Host-to-device transfer of a step's small inputs (token ids, positions, metadata).

On CUDA each input goes through a pinned host buffer kept from step to step (grown when
too small) and is copied without blocking the host; on the CPU the numpy array is the
tensor (no copy at all). The runner uploads through one of these, whatever the device.

A copy is queued on the stream, not made at once: with a step in flight (asynchronous
scheduling) the next step's inputs must not overwrite a buffer whose copy may not have
run yet, so each step writes to one of two sets of buffers in turn (`next_step`).
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._sets: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        self._buffers = self._sets[0]

    def next_step(self) -> None:
        """A new step's uploads: into the other set of buffers than the last step's."""
        self._buffers = self._sets[1] if self._buffers is self._sets[0] else self._sets[0]

    def upload(self, name: str, array: np.ndarray) -> torch.Tensor:
        """The array on the device. `name` identifies the buffer reused for it next step."""
        host = torch.from_numpy(np.ascontiguousarray(array))
        if not self.pinned:
            return host.to(self.device)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < host.numel() or buffer.dtype != host.dtype:
            buffer = torch.empty(max(host.numel(), 1024), dtype=host.dtype, pin_memory=True)
            self._buffers[name] = buffer
        staged = buffer[: host.numel()].view(host.shape)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)
