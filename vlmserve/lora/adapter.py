"""Reading a PEFT LoRA adapter (`adapter_config.json` + `adapter_model.safetensors`) and
checking it against the layers a model can adapt.

Each adapted layer gets A [rank, in] and B [out, rank], B already multiplied by PEFT's
scaling (alpha / rank, or alpha / sqrt(rank) with rsLoRA; per-module alpha and rank from
`alpha_pattern` / `rank_pattern`), so the layer adds (x A^T) B^T to its output.
What vlmserve cannot serve as PEFT would compute it is refused with one line: DoRA, LoRA
biases, whole trained modules (`modules_to_save`), adapted embeddings or output head,
parameters instead of modules, a layer the model doesn't have, a rank over the limit.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

PEFT_PREFIX = "base_model.model."
SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


class LoRAError(ValueError):
    """An adapter that cannot be served, and why, in one line."""


@dataclass(frozen=True)
class LoRATarget:
    """A layer an adapter may adapt, under its checkpoint name."""

    in_features: int
    out_features: int
    vision: bool  # in the vision tower (or its projector): adapted pictures are the adapter's own


@dataclass
class LoRAAdapter:
    """A checked adapter: per adapted layer (checkpoint name), A and the scaled B (None
    when only the shapes were read)."""

    path: str
    rank: int  # the largest of its layers'
    modules: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]
    touches_vision: bool


MAX_CONFIG_BYTES = 1 << 20  # PEFT writes a few KB
MAX_PATTERN_CHARS = 256


def configured_rank(path: str) -> int | None:
    """The largest rank an adapter's config gives (None: no readable config)."""
    try:
        config = read_config(path)
    except LoRAError:
        return None
    return max([config.get("r", 8), *(config.get("rank_pattern") or {}).values()])


def read_config(path: str) -> dict:
    """adapter_config.json, read within a size bound and checked field by field."""
    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAError(f"{path}: no adapter_config.json (expected a PEFT LoRA adapter folder)")
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoRAError(f"{path}: adapter_config.json is over {MAX_CONFIG_BYTES >> 20} MB; PEFT writes a few KB")
    try:
        config = json.loads(config_file.read_bytes())
    except (ValueError, RecursionError):
        raise LoRAError(f"{path}: adapter_config.json is not valid JSON (or nested too deep)") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{path}: adapter_config.json must hold a JSON object, not a {type(config).__name__}")
    _check_numbers(path, config)
    _check_config(path, config)
    return config


def _check_numbers(path: str, config: dict) -> None:
    """The settings vlmserve computes with: ranks whole and positive, alphas finite numbers,
    per-module patterns module names (a pattern is a regex in PEFT: plain names only, so a
    config cannot make matching take exponential time)."""
    def rank(value: object, where: str) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LoRAError(f"{path}: {where} must be a whole number of at least 1, got {value!r}")

    def alpha(value: object, where: str) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise LoRAError(f"{path}: {where} must be a finite number, got {value!r}")

    rank(config.get("r", 8), "r")
    alpha(config.get("lora_alpha", 8), "lora_alpha")
    for field, check in (("rank_pattern", rank), ("alpha_pattern", alpha)):
        patterns = config.get(field) or {}
        if not isinstance(patterns, dict):
            raise LoRAError(f"{path}: {field} must be an object of module name -> value")
        for key, value in patterns.items():
            if len(key) > MAX_PATTERN_CHARS or not re.fullmatch(r"[\w.\-]+", key):
                raise LoRAError(f"{path}: {field} key {key[:64]!r} is not a module name")
            check(value, f"{field}[{key!r}]")
    if not isinstance(config.get("use_rslora", False), bool):
        raise LoRAError(f"{path}: use_rslora must be true or false")


def read_adapter(path: str, targets: dict[str, LoRATarget], max_rank: int, canonical: Callable[[str], str],
                 weights: bool = True) -> LoRAAdapter:
    """The adapter in `path`, checked against the model's `targets`; LoRAError if it
    cannot be served. With weights=False its tensors are read and checked, and only their
    shapes kept."""
    folder = Path(path)
    config = read_config(path)
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        what = "only adapter_model.bin: save it as safetensors" if (folder / "adapter_model.bin").is_file() else \
            "no adapter_model.safetensors"
        raise LoRAError(f"{path}: {what}")
    pieces = _read_tensors(path, weights_file, canonical, weights)
    modules, rank = {}, 0
    for module, parts in pieces.items():
        target = targets.get(module)
        if target is None:
            raise LoRAError(f"{path}: adapts {module}, which vlmserve cannot adapt (it adapts the linear layers of "
                            f"the decoder and the vision tower)")
        if set(parts) != {"A", "B"}:
            raise LoRAError(f"{path}: {module} has lora_{'B' if 'A' in parts else 'A'} missing")
        a_shape, b_shape = (_as_matrix(tuple(p.shape) if isinstance(p, torch.Tensor) else p)
                            for p in (parts["A"], parts["B"]))
        r = a_shape[0]
        if a_shape != (r, target.in_features) or b_shape != (target.out_features, r):
            raise LoRAError(f"{path}: {module} has lora_A {list(a_shape)} and lora_B {list(b_shape)}, which do not fit "
                            f"the layer's {target.in_features} inputs and {target.out_features} outputs")
        if r > max_rank:
            raise LoRAError(f"{path}: rank {r} (at {module}) is over --max-lora-rank {max_rank}")
        rank = max(rank, r)
        a, b = parts["A"], parts["B"]
        if weights:  # a convolution's (the patch embedding's) as the linear layer it is
            a, b = a.reshape(a_shape), b.reshape(b_shape) * _scaling(config, module, r)
        modules[module] = (a if weights else None, b if weights else None)
    if not modules:
        raise LoRAError(f"{path}: the adapter has no LoRA weights")
    return LoRAAdapter(path, rank, modules, any(targets[m].vision for m in modules))


def _read_tensors(path: str, weights_file: Path, canonical: Callable[[str], str],
                  keep: bool) -> dict[str, dict[str, torch.Tensor | tuple[int, ...]]]:
    """module -> {"A": ..., "B": ...}: each tensor, checked finite, kept or (keep=False) only
    its shape."""
    pieces: dict[str, dict[str, torch.Tensor | tuple[int, ...]]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():
                module, part = _split_key(path, key)
                tensor = f.get_tensor(key)
                if not torch.isfinite(tensor).all():
                    raise LoRAError(f"{path}: {key} holds NaN or infinite values")
                pieces.setdefault(canonical(module + ".weight").removesuffix(".weight"), {})[part] = \
                    tensor if keep else tuple(tensor.shape)
    except LoRAError:
        raise
    except Exception:  # safetensors' own error type, or an OS error: the file is what is wrong
        raise LoRAError(f"{path}: adapter_model.safetensors is not a readable safetensors file (truncated, "
                        f"damaged or not safetensors)") from None
    return pieces


def _as_matrix(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A convolution's LoRA weight [rank, in, *kernel] or [out, rank, 1, ...] as the
    matrix it is on flattened patches."""
    if len(shape) <= 2:
        return shape
    if all(d == 1 for d in shape[2:]):
        return shape[:2]
    return shape[0], math.prod(shape[1:])


def _check_config(path: str, config: dict) -> None:
    refusals = [
        (config.get("peft_type", "LORA") != "LORA", f"is a {config.get('peft_type')} adapter; vlmserve serves LoRA"),
        (config.get("use_dora"), "uses DoRA (use_dora), which vlmserve does not serve"),
        (config.get("bias", "none") != "none" or config.get("lora_bias"), "trains biases; vlmserve serves "
                                                                         "LoRA weights only"),
        (config.get("modules_to_save"), f"trains whole modules (modules_to_save: {config.get('modules_to_save')}); "
                                        f"vlmserve serves LoRA weights only"),
        (config.get("target_parameters"), "adapts parameters (target_parameters), not linear layers"),
        (config.get("fan_in_fan_out"), "stores transposed weights (fan_in_fan_out), as only GPT-2-style layers do"),
        (config.get("layer_replication"), "replicates layers (layer_replication)"),
    ]
    for refused, why in refusals:
        if refused:
            raise LoRAError(f"{path}: the adapter {why}")


def _split_key(path: str, key: str) -> tuple[str, str]:
    name = key.removeprefix(PEFT_PREFIX)
    for suffix, part in SUFFIXES.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], part
    if "lora_embedding" in name:
        raise LoRAError(f"{path}: adapts the token embeddings ({key}), which vlmserve does not serve")
    if name.endswith(".base_layer.weight"):
        raise LoRAError(f"{path}: carries the whole weight of {name.removesuffix('.base_layer.weight')} ({key}); "
                        f"vlmserve serves LoRA weights only")
    raise LoRAError(f"{path}: unexpected tensor {key} (expected <module>.lora_A.weight and <module>.lora_B.weight)")


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling of a module: its alpha (alpha_pattern, else lora_alpha) over its rank,
    or over the rank's square root with rsLoRA."""
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """A per-module setting as PEFT matches it: a key is a regex of the module name's tail."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
