"""Engine settings shared by the scheduler, the runner and the entry points."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 64  # requests running at once
    max_model_len: int = 4096  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True
    # encoder budget of one step, and encoder cache capacity, in embedding tokens
    encoder_compute_budget: int = 8192
    encoder_cache_size: int = 16384

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
