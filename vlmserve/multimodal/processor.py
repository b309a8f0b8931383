"""Turns read media into what the model's encoder consumes, with the HF processor of the
checkpoint (so pixels, grids, frame sampling and placeholder text match transformers
exactly), behind a processor cache keyed by mm_hash."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AutoProcessor

from vlmserve.multimodal.hashing import mm_hash
from vlmserve.multimodal.media import MediaError, MediaLoader, RawMedia

# OpenAI's detail="low": a small pixel budget (256 patches of 14 px before merging)
LOW_DETAIL_MAX_PIXELS = 256 * 14 * 14
_SETTINGS = {"min_pixels", "max_pixels", "fps", "do_pan_and_scan"}
MAX_PIXELS_SETTING = 1 << 30


@dataclass
class ProcessedMedia:
    modality: str
    mm_hash: str
    replacement: str  # what the placeholder token becomes in the prompt text
    data: dict[str, Any]  # pixel_values, grid_thw, ...
    num_tokens: int  # embeddings it becomes: the pad tokens of its replacement

    @property
    def nbytes(self) -> int:
        return self.data["pixel_values"].nbytes


@dataclass
class ProcessorCacheStats:
    hits: int = 0
    misses: int = 0


class ProcessorCache:
    """Size-bounded LRU of processed media by mm_hash: a repeated image skips decoding
    and resizing."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.size = 0
        self.items: OrderedDict[str, ProcessedMedia] = OrderedDict()
        self.stats = ProcessorCacheStats()
        self.lock = threading.Lock()  # processing runs in a pool of threads

    def get(self, key: str) -> ProcessedMedia | None:
        with self.lock:
            item = self.items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            self.items.move_to_end(key)
            self.stats.hits += 1
            return item

    def clear(self) -> None:
        with self.lock:
            self.items.clear()
            self.size = 0

    def put(self, item: ProcessedMedia) -> None:
        if item.nbytes > self.capacity:
            return
        with self.lock:
            if item.mm_hash in self.items:
                return
            self.items[item.mm_hash] = item
            self.size += item.nbytes
            while self.size > self.capacity:
                _, old = self.items.popitem(last=False)
                self.size -= old.nbytes


def normalize_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Per-request processing settings in canonical form (they enter the mm_hash)."""
    if not isinstance(settings, dict):
        raise ValueError(f"media processing settings must be an object, got {type(settings).__name__}")
    settings = dict(settings)
    detail = settings.pop("detail", None)
    if detail not in (None, "auto", "high", "low"):
        raise ValueError(f"detail must be 'auto', 'high' or 'low', got {detail!r}")
    unknown = set(settings) - _SETTINGS
    if unknown:
        raise ValueError(f"unsupported media processing setting(s) {sorted(unknown)}; supported: {sorted(_SETTINGS)}")
    out = {}
    for key, value in settings.items():
        if value is None:
            continue
        if key == "do_pan_and_scan":  # Gemma 3: the picture plus crops of its long side
            if not isinstance(value, bool):
                raise ValueError(f"do_pan_and_scan must be true or false, got {value!r}")
            out[key] = value
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        if key != "fps":  # pixel counts: whole numbers, at most a gigapixel
            ok = ok and float(value).is_integer() and value <= MAX_PIXELS_SETTING
        if not ok:
            kind = "a finite number" if key == "fps" else f"a whole number up to {MAX_PIXELS_SETTING}"
            raise ValueError(f"{key} must be {kind} above 0, got {value!r}")
        out[key] = float(value) if key == "fps" else int(value)
    if "min_pixels" in out and "max_pixels" in out and out["min_pixels"] > out["max_pixels"]:
        raise ValueError(f"min_pixels ({out['min_pixels']}) is larger than max_pixels ({out['max_pixels']})")
    if detail == "low":  # a cap under the model's own one, whatever that is: applied in _size_kwargs
        out["detail"] = "low"
    return out


class MultiModalProcessor:
    def __init__(self, model_path: str, hf_config, media_loader: MediaLoader, cache_bytes: int = 256 << 20,
                 pixel_dtype: torch.dtype = torch.float32) -> None:
        self.hf_processor = AutoProcessor.from_pretrained(model_path)
        self.image_processor = self.hf_processor.image_processor
        self.video_processor = getattr(self.hf_processor, "video_processor", None)
        self.loader = media_loader
        self.image_token = self.hf_processor.image_token
        self.video_token = getattr(self.hf_processor, "video_token", None)
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = getattr(hf_config, "video_token_id", None)
        self.tokenizer = self.hf_processor.tokenizer
        # what the HF processor passes its image processor unless told otherwise (Gemma 3's
        # pan-and-scan settings: they take precedence over the image processor's own config)
        self.image_defaults = dict(getattr(type(self.hf_processor), "images_kwargs", None) or {})
        self.cache = ProcessorCache(cache_bytes)
        self.pixel_dtype = pixel_dtype  # what pixel_values are kept in

    def process(self, source: Any, modality: str, settings: dict[str, Any] | None = None) -> ProcessedMedia:
        """Reads, hashes, and (unless cached) decodes and processes one media item."""
        settings = normalize_settings(settings or {})
        if modality == "video" and self.video_processor is None:
            raise MediaError("this model does not take videos")
        raw = self.loader.read(source, modality)
        key = mm_hash(modality, raw.content, settings)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        item = self._process_image(raw, key, settings) if modality == "image" else self._process_video(raw, key, settings)
        self.cache.put(item)
        return item

    def _process_image(self, raw: RawMedia, key: str, settings: dict[str, Any]) -> ProcessedMedia:
        kwargs = {**self.image_defaults, **self._size_kwargs(self.image_processor, settings)}
        if "do_pan_and_scan" in settings:
            if not hasattr(self.image_processor, "do_pan_and_scan"):
                raise MediaError("do_pan_and_scan: this model's processor has no pan-and-scan crops")
            kwargs["do_pan_and_scan"] = settings["do_pan_and_scan"]
        with self.loader.decoding(raw) as image:
            try:
                out = self.image_processor(images=[image], return_tensors="pt", **kwargs)
            except ValueError as e:  # the processor refuses some shapes (an aspect ratio over 200)
                raise MediaError(f"{raw.what}: {e}") from None
        data = {"pixel_values": out["pixel_values"].to(self.pixel_dtype)}  # Gemma 3: the picture, then its crops
        if "image_grid_thw" in out:  # Qwen: patches of a grid
            data["grid_thw"] = tuple(int(x) for x in out["image_grid_thw"][0])
        replacement = self.hf_processor.replace_image_token(out, 0)
        return ProcessedMedia("image", key, replacement, data, self._count(replacement, self.image_token_id))

    def _process_video(self, raw: RawMedia, key: str, settings: dict[str, Any]) -> ProcessedMedia:
        from transformers.video_utils import VideoMetadata

        def meta_of(n: int, rate: float | None, h: int = 0, w: int = 0) -> VideoMetadata:
            fps = rate or float(settings.get("fps", self.video_processor.fps or 2))
            return VideoMetadata(total_num_frames=n, fps=fps, width=w, height=h, duration=n / fps)

        def choose(n: int, rate: float | None) -> np.ndarray:
            """The frames the model sees: the processor's own sampling (fps, min/max
            frames) as transformers applies it, or all of them."""
            if not (self.video_processor.do_sample_frames or "fps" in settings):
                return np.arange(n)
            sampling = {"fps": settings["fps"]} if "fps" in settings else {}
            try:
                return np.asarray(self.video_processor.sample_frames(metadata=meta_of(n, rate), **sampling)).astype(int)
            except (ValueError, TypeError) as e:
                raise MediaError(f"{raw.what}: cannot sample frames ({e})") from None

        with self.loader.decoding(raw, choose) as video:
            n, (h, w) = video.num_frames, video.frames.shape[1:3]
            meta = meta_of(n, video.fps, h, w)
            indices = choose(n, video.fps)
            out = self._run_video_processor(raw.what, video.select(indices), meta, indices, settings)
        grid = out["video_grid_thw"]
        data = {
            "pixel_values": out["pixel_values_videos"].to(self.pixel_dtype),
            "grid_thw": tuple(int(x) for x in grid[0]),
            # seconds of video per temporal grid step (Qwen2.5-VL's M-RoPE time axis)
            "second_per_grid_t": self.video_processor.temporal_patch_size / meta.sampled_fps,
        }
        replacement = self.hf_processor.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
        return ProcessedMedia("video", key, replacement, data, self._count(replacement, self.video_token_id))

    def _run_video_processor(self, what: str, frames: np.ndarray, meta, indices: np.ndarray,
                             settings: dict[str, Any]) -> dict[str, Any]:
        temporal = self.video_processor.temporal_patch_size
        if len(indices) < temporal:
            raise MediaError(f"{what} has {meta.total_num_frames} frame(s); the model needs at least {temporal}")
        meta.frames_indices = indices.tolist()
        kwargs = dict(self._size_kwargs(self.video_processor, settings), video_metadata=[meta],
                      do_sample_frames=False, return_tensors="pt")
        if hasattr(type(self.video_processor), "cap_pixels_per_frame"):
            # Qwen3-VL style: None means False, with a warning on every call
            kwargs["cap_pixels_per_frame"] = self.video_processor.cap_pixels_per_frame or False
        try:
            return self.video_processor(videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], **kwargs)
        except ValueError as e:
            raise MediaError(f"{what}: {e}") from None

    def _count(self, replacement: str, pad_id: int) -> int:
        return self.tokenizer.encode(replacement, add_special_tokens=False).count(pad_id)

    @staticmethod
    def _size_kwargs(processor, settings: dict[str, Any]) -> dict[str, Any]:
        """Per-request pixel bounds, on top of the processor's own."""
        if not {"min_pixels", "max_pixels", "detail"} & set(settings) or "height" in processor.size:
            return {}  # (a model that takes one fixed size, as Gemma 3, has no pixel bounds to move)
        size = dict(processor.size)
        if "min_pixels" in settings:
            size["shortest_edge"] = settings["min_pixels"]
        if "max_pixels" in settings:
            size["longest_edge"] = settings["max_pixels"]
        if settings.get("detail") == "low":  # never more pixels than without it
            size["longest_edge"] = min(size.get("longest_edge", LOW_DETAIL_MAX_PIXELS), LOW_DETAIL_MAX_PIXELS)
            if "shortest_edge" in size:
                size["shortest_edge"] = min(size["shortest_edge"], size["longest_edge"])
        return {"size": size}
