"""Reading HF safetensors checkpoints into vlmserve's modules."""

from __future__ import annotations

import ctypes
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from vlmserve.kernels.quantized_linear import QuantizedWeight, dequantize
from vlmserve.models.layers import Linear

# checkpoint projection -> (fused module, shard index): q/k/v and gate/up run as one matmul
FUSED_PROJECTIONS = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    for file in files:
        path = str(model_dir / file)
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
        for name in names:
            # a tensor is a view of the file mapped into memory, and every page read stays
            # in this process's RSS while the file is open: one mapping per tensor keeps
            # loading's peak at the weights' size, not twice it
            with safe_open(path, framework="pt") as f:
                yield name, f.get_tensor(name)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's
    except (OSError, AttributeError):
        return None


def return_freed_memory() -> None:
    """Hands the heap's free pages back to the system. glibc keeps a freed block's pages
    when it sits below live ones: layer after layer quantized while loading, those holes
    would add up to the full-precision size that quantizing saves."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class WeightLoader:
    """Copies checkpoint tensors into parameters, checking shapes and completeness.

    Fused parameters (a FusedLinear's weight and bias) are filled shard by shard. A weight
    quantized in the checkpoint (a QuantizedWeight) goes to its Linear as it is; anywhere
    else it is dequantized. A Linear in `quantize` (layer -> method) is quantized as soon
    as its weight is complete, so that the full-precision weights are never all resident.
    """

    def __init__(self, model: nn.Module, quantize: dict[Linear, str] | None = None) -> None:
        self.model = model
        targets = quantize or {}
        for module in targets:  # allocated when its first part arrives, freed once quantized
            module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
        self.params = dict(model.named_parameters())
        self.quantize_when_loaded = {f"{name}.weight": (module, targets[module])
                                     for name, module in model.named_modules() if module in targets}
        self.loaded: set[str] = set()
        self.shards_loaded: dict[str, set[int]] = {}
        self.pieces_loaded: dict[str, set] = {}

    def copy(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> None:
        tensor = self._rank_part(name, tensor)
        linear = self._quantized_target(name, tensor)
        if linear is not None:
            if tensor.shape != (linear.out_features, linear.in_features):
                raise ValueError(f"{name}: checkpoint shape {tensor.shape} != model shape {tuple(linear.weight.shape)}")
            linear.add_quantized_shard(tensor)
            linear.finish_loading([linear.out_features])
            self._mark_loaded(name)
            return
        tensor = dequantize(tensor) if isinstance(tensor, QuantizedWeight) else tensor
        param = self._param(name)
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        self._mark_loaded(name)

    def copy_shard(self, name: str, tensor: torch.Tensor | QuantizedWeight, index: int) -> None:
        module = self.model.get_submodule(name.rsplit(".", 1)[0])
        tensor = self._rank_part(name, tensor, index)
        sizes = module.shard_sizes
        param = self._param(name)
        if tensor.shape[0] != sizes[index] or tuple(tensor.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"{name} shard {index}: checkpoint shape {tuple(tensor.shape)} does not fit")
        if self._quantized_target(name, tensor) is not None:
            module.add_quantized_shard(tensor, index)
        else:
            tensor = dequantize(tensor) if isinstance(tensor, QuantizedWeight) else tensor
            start = sum(sizes[:index])
            with torch.no_grad():
                param[start : start + sizes[index]].copy_(tensor)
        done = self.shards_loaded.setdefault(name, set())
        done.add(index)
        if len(done) == len(sizes):
            self._mark_loaded(name)
            if name.endswith(".weight") and getattr(module, "quantized_parts", None) is not None:
                module.finish_loading(sizes)

    def copy_piece(self, name: str, key, region: tuple, tensor: torch.Tensor, pieces: int) -> None:
        """Fills param[region] (one of `pieces` parts, named by `key`: an expert's
        projection, say); the parameter counts as loaded once every part is."""
        target = self._param(name)[region]
        if target.shape != tensor.shape:
            raise ValueError(f"{name} {key}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        done = self.pieces_loaded.setdefault(name, set())
        done.add(key)
        if len(done) == pieces:
            self._mark_loaded(name)

    def _rank_part(self, name: str, tensor: torch.Tensor | QuantizedWeight, index: int | None = None
                   ) -> torch.Tensor | QuantizedWeight:
        """The part of a checkpoint tensor this rank holds, where the model is split across
        ranks (models/tensor_parallel.py): cut from the memory-mapped tensor, so only that
        part is read."""
        module_name, _, leaf = name.rpartition(".")
        try:
            parts = getattr(self.model.get_submodule(module_name), "rank_parts", {})
        except AttributeError:  # no such module: _param says so
            parts = {}
        part = parts.get((leaf, index))
        if part is None:
            return tensor
        if isinstance(tensor, QuantizedWeight):
            try:
                return part.take_quantized(tensor)  # kept quantized
            except ValueError:  # a part that cuts the format's groups: split in the model's dtype
                tensor = dequantize(tensor)
        return part.take(tensor)

    def _mark_loaded(self, name: str) -> None:
        self.loaded.add(name)
        if name in self.quantize_when_loaded:
            module, method = self.quantize_when_loaded.pop(name)
            if module.quantize(method):
                self.params[name] = module.weight  # the full-precision one is freed: no reference here
                return_freed_memory()

    def _quantized_target(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> Linear | None:
        """The Linear whose weight a quantized checkpoint tensor is (None for a plain
        tensor, or a quantized one meant for anything else: it is dequantized)."""
        module_name, _, leaf = name.rpartition(".")
        if not isinstance(tensor, QuantizedWeight) or leaf != "weight" or not module_name:
            return None
        self._param(name)  # a name the model has
        module = self.model.get_submodule(module_name)
        return module if isinstance(module, Linear) else None

    def _param(self, name: str) -> nn.Parameter:
        if name not in self.params:
            raise KeyError(f"checkpoint weight {name!r} has no place in {type(self.model).__name__}")
        param = self.params[name]
        if param.is_meta:  # a weight to quantize: it exists in full precision only while it loads
            module_name, _, leaf = name.rpartition(".")
            param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype), requires_grad=False)
            setattr(self.model.get_submodule(module_name), leaf, param)
            self.params[name] = param
        return param

    def check_all_loaded(self) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
