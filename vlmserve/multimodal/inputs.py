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
    piece: int = 0  # an item split over several placeholder runs (frame groups, crops): which; 0 starts it
    # its tokens attend to each other both ways (Gemma 3): a step never stops inside it
    bidirectional: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end
