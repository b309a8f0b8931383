"""Builds a model from a checkpoint folder: config -> family class -> weights."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig

from vlmserve.models import get_model_class
from vlmserve.models.weights import iter_safetensors

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _skip_param_init(dtype: torch.dtype):
    """Creates parameters uninitialised, in dtype: the checkpoint overwrites them anyway,
    and random init of a large model costs seconds of startup."""
    saved = {}
    for cls in (nn.Linear, nn.Embedding, nn.LayerNorm, nn.Conv3d):
        saved[cls] = cls.reset_parameters
        cls.reset_parameters = lambda self: None
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old_dtype)
        for cls, fn in saved.items():
            cls.reset_parameters = fn


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """oneDNN bf16 kernels need AVX-512 (or AMX); without them torch falls back to a scalar
    bf16 gemm some 50x slower than fp32 (measured on an AVX2 CPU)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, hf_config) -> torch.dtype:
    """'auto' runs the checkpoint's own dtype, except that half precision runs as bfloat16
    where the CPU has fast bf16 matmuls (no CPU has fast fp16 ones), else as float32."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of {['auto', *_DTYPES]}, got {name!r}")
        return _DTYPES[name]
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = _DTYPES.get(saved)
    half = saved in (torch.bfloat16, torch.float16)
    return torch.bfloat16 if half and cpu_has_fast_bf16() else torch.float32


def load_model(model_path: str | Path, dtype: str | torch.dtype, device: str = "cpu") -> tuple[nn.Module, object]:
    start = time.perf_counter()
    hf_config = AutoConfig.from_pretrained(str(model_path))
    if not isinstance(dtype, torch.dtype):
        dtype = resolve_dtype(dtype, hf_config)
    model_cls = get_model_class(getattr(hf_config, "architectures", None) or [])
    with _skip_param_init(dtype):
        model = model_cls(hf_config)
    model.load_weights(iter_safetensors(model_path))
    model = model.to(device=device).eval()  # params were created in dtype; fp32 buffers stay fp32
    model.requires_grad_(False)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "loaded %s (%.1fM parameters, %s) in %.2fs",
        model_cls.__name__, num_params / 1e6, dtype, time.perf_counter() - start,
    )
    return model, hf_config
