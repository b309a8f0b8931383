"""What a request names to run under a LoRA adapter (vLLM's `LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: the name requests use, an id unique per loaded adapter (a reloaded one
    gets a new id, so nothing cached under the old weights is reused), and its folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be positive, got {self.lora_int_id}")

    @property
    def cache_key(self) -> str:
        """What keeps this adapter's KV blocks and adapted pictures apart from others'."""
        return f"lora:{self.lora_int_id}:{self.lora_name}"
