"""Every knob of an engine, in one place, shared by the LLM class, the server and the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from vlmserve.multimodal.media import MediaLimits


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"  # the checkpoint's (half precision as bf16 where the CPU has fast bf16, else fp32)
    device: str = "cpu"
    seed: int = 0
    # a prepacked copy of each linear weight (oneDNN layout on CPU): faster batched matmuls,
    # taken only when the copies fit in a quarter of the machine's memory
    pack_weights: bool = True
    # scheduling
    max_model_len: int | None = None  # default: the model's, capped by the KV cache
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_n: int = 16  # completions one request may ask for (n); each counts as a request in flight
    enable_chunked_prefill: bool = True
    # KV cache
    block_size: int = 16
    kv_cache_memory_gb: float = 0.5
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # hybrid models: recurrent-state snapshots kept for prefix caching (default: up to a
    # quarter of the KV memory, at most 8 per running request)
    num_state_snapshots: int | None = None
    # vision encoder, in embedding tokens
    encoder_compute_budget: int = 8192
    encoder_cache_size: int = 16384
    # media
    allowed_local_media_path: str | None = None  # local files only under this folder
    allowed_media_domains: list[str] = field(default_factory=list)  # hosts http(s) media may come from
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 16, "video": 2})
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 64 << 20
    max_video_bytes: int = 200 << 20
    media_fetch_timeout: float = 10.0
    image_background: tuple[int, int, int] = (255, 255, 255)  # under transparent pixels, as transformers
    processor_cache_gb: float = 0.25
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)  # defaults for every item
    processing_threads: int = 4
    # run the engine core (scheduler, model) in a process of its own, so that its step
    # loop never waits for the front end's HTTP, media and detokenizing work (the servers)
    engine_process: bool = False
    time_steps: bool = False  # accumulate wall seconds per phase of each step (LLMEngine.step_phases)

    def media_limits(self) -> MediaLimits:
        """The size and source checks every reader of this engine's media applies."""
        return MediaLimits(
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
            max_video_bytes=self.max_video_bytes,
            allowed_local_media_path=self.allowed_local_media_path,
            allowed_media_domains=list(self.allowed_media_domains),
            fetch_timeout=self.media_fetch_timeout,
            background=tuple(self.image_background),
        )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}")
        return cls(**kwargs)
