"""LoRA adapters made offline with PEFT on a test checkpoint: random, non-zero A and B
(large enough to change greedy answers), saved in PEFT's own format."""

from __future__ import annotations

from pathlib import Path

import torch


def write_lora_adapter(base: str | Path, out: str | Path, rank: int, target_modules: list[str] | str, seed: int,
                       alpha: float | None = None, use_rslora: bool = False, std: float = 0.15,
                       dtype: torch.dtype = torch.float32, **config) -> Path:
    """An adapter of the checkpoint at `base` (loaded in dtype) in `out`; `target_modules`
    as PEFT takes them (names, or a regex of full module names); other LoraConfig
    settings pass."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(base), dtype=dtype)
    lora_config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                             target_modules=target_modules, use_rslora=use_rslora, init_lora_weights=False,
                             **config)
    peft_model = get_peft_model(model, lora_config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(str(out))
    return Path(out)
