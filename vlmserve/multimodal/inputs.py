"""Data that describes one processed media item inside a prompt."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MultiModalFeature:
    """One image or video of a prompt, processed and placed.

    `offset`/`length` are the placeholder token range in the prompt; every placeholder
    token receives one embedding of the encoder output, in order. `data` holds the
    model-specific processed tensors (pixel patches, grid) the encoder consumes.
    """

    modality: str  # "image" | "video"
    mm_hash: str
    offset: int
    length: int
    data: dict[str, Any] = field(repr=False)
    piece: int = 0  # a video split into frame groups (Qwen3.5): which group; 0 starts an item

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end
