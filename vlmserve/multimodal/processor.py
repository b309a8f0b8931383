"""Turns loaded media into what the model's encoder consumes, with the HF processor of
the checkpoint (so pixels match transformers exactly)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import AutoProcessor

from vlmserve.multimodal.hashing import mm_hash
from vlmserve.multimodal.media import LoadedImage


@dataclass
class ProcessedMedia:
    modality: str
    mm_hash: str
    num_tokens: int  # placeholder tokens (= encoder output embeddings)
    data: dict[str, Any]  # pixel_values, grid_thw, ...


class MultiModalProcessor:
    def __init__(self, model_path: str, hf_config) -> None:
        self.hf_processor = AutoProcessor.from_pretrained(model_path)
        self.image_processor = self.hf_processor.image_processor
        self.merge_size = self.image_processor.merge_size
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = getattr(hf_config, "video_token_id", None)

    def process_image(self, loaded: LoadedImage, settings: dict[str, Any] | None = None) -> ProcessedMedia:
        settings = normalize_settings(settings or {})
        out = self.image_processor(images=[loaded.image], return_tensors="pt", **self._resize_kwargs(settings))
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return ProcessedMedia(
            modality="image",
            mm_hash=mm_hash("image", loaded.content, settings),
            num_tokens=_num_tokens(grid, self.merge_size),
            data={"pixel_values": out["pixel_values"], "grid_thw": grid},
        )

    def _resize_kwargs(self, settings: dict[str, Any]) -> dict[str, Any]:
        """Per-request pixel bounds, on top of the processor's own."""
        if settings.get("min_pixels") is None and settings.get("max_pixels") is None:
            return {}
        size = dict(self.image_processor.size)
        if settings.get("min_pixels") is not None:
            size["shortest_edge"] = int(settings["min_pixels"])
        if settings.get("max_pixels") is not None:
            size["longest_edge"] = int(settings["max_pixels"])
        return {"size": size}


# OpenAI's detail="low": a small pixel budget (about 256 patches of 14 px before merging)
LOW_DETAIL_MAX_PIXELS = 256 * 28 * 28 // 4
_SETTINGS = {"min_pixels", "max_pixels"}


def normalize_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Per-request processing settings in canonical form (they enter the mm_hash)."""
    settings = dict(settings)
    detail = settings.pop("detail", None)
    if detail not in (None, "auto", "high", "low"):
        raise ValueError(f"detail must be 'auto', 'high' or 'low', got {detail!r}")
    if detail == "low":
        cap = settings.get("max_pixels")
        settings["max_pixels"] = LOW_DETAIL_MAX_PIXELS if cap is None else min(int(cap), LOW_DETAIL_MAX_PIXELS)
    unknown = set(settings) - _SETTINGS
    if unknown:
        raise ValueError(f"unsupported media processing setting(s) {sorted(unknown)}; supported: {sorted(_SETTINGS)}")
    for key in _SETTINGS & set(settings):
        if settings[key] is None:
            del settings[key]
        elif int(settings[key]) <= 0:
            raise ValueError(f"{key} must be positive, got {settings[key]}")
        else:
            settings[key] = int(settings[key])
    return settings


def _num_tokens(grid: tuple[int, int, int], merge: int) -> int:
    t, h, w = grid
    return t * h * w // (merge * merge)


