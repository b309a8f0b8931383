"""An FP8 KV cache's scales from a checkpoint: one for each attention layer's keys and one
for its values (vLLM's per-tensor k_scale and v_scale), as FP8 checkpoints made with
llm-compressor and older exports name them. A value is stored as x / scale; without them
every scale is 1.0, as in vLLM. An unquantized KV cache ignores them (vLLM: 1.0 under auto)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from vlmserve.errors import ConfigError
from vlmserve.models.layers import PagedAttention

logger = logging.getLogger(__name__)

# the name's end -> which of the layer's scales it sets ("" for the query's: not used)
KV_SCALE_NAMES = {
    ".self_attn.k_scale": "k", ".self_attn.v_scale": "v",
    ".self_attn.kv_scale": "kv",  # one scale for both (vLLM duplicates it)
    ".self_attn.k_proj.output_scale": "k", ".self_attn.v_proj.output_scale": "v",  # compressed-tensors' older names
    ".self_attn.q_scale": "", ".self_attn.q_proj.output_scale": "", ".self_attn.prob_output_scale": "",
}


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Sets the attention layer's scale that the checkpoint tensor `name` is; False when it
    is none. Per-tensor scales only: scales per head are noted, and refused by check_kv_scales
    when an FP8 cache would read them (a bf16 cache ignores them)."""
    suffix = next((s for s in KV_SCALE_NAMES if name.endswith(s)), None)
    if suffix is None:
        return False
    which = KV_SCALE_NAMES[suffix]
    if not which:
        return True
    attention = model.get_submodule(name[: -len(suffix)] + ".self_attn")
    if not isinstance(attention, PagedAttention):
        raise ValueError(f"{name}: a KV cache scale for a layer without paged attention")
    if tensor.numel() != 1:  # refused only if an FP8 cache would use them (check_kv_scales)
        attention.per_head_kv_scales = name
        return True
    value = float(tensor.float().reshape(()))
    if not value > 0:
        raise ValueError(f"{name}: a KV cache scale must be positive, got {value}")
    if "k" in which:
        attention.k_scale = value
    if "v" in which:
        attention.v_scale = value
    return True


def check_kv_scales(model: nn.Module) -> None:
    """ConfigError where the checkpoint gives scales per head, which an FP8 cache would need
    and vlmserve's kernels do not take (vLLM takes them on its FlashAttention backend alone)."""
    per_head = [m.per_head_kv_scales for m in model.modules()
                if isinstance(m, PagedAttention) and m.per_head_kv_scales]
    if per_head:
        raise ConfigError(f"--kv-cache-dtype fp8: the checkpoint's KV cache scales are per head ({per_head[0]} and "
                          f"{len(per_head) - 1} more layers); vlmserve takes one per tensor (vLLM's k_scale and "
                          f"v_scale): use --kv-cache-dtype auto")


def describe_kv_scales(model: nn.Module) -> str:
    """What an FP8 KV cache is scaled by, for the log."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    given = [m for m in layers if (m.k_scale, m.v_scale) != (1.0, 1.0)]
    if not given:
        return "scales 1.0 (the checkpoint gives none: keys and values past +-448 are saturated)"
    return f"scales from the checkpoint for {len(given)} of {len(layers)} attention layers"
