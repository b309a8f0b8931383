"""Reading HF safetensors checkpoints into vlmserve's modules."""

from __future__ import annotations

import json
from collections.abc import Iterator
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
        with safe_open(str(model_dir / file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class WeightLoader:
    """Copies checkpoint tensors into parameters, checking shapes and completeness.

    Fused parameters (a FusedLinear's weight and bias) are filled shard by shard. A weight
    quantized in the checkpoint (a QuantizedWeight) goes to its Linear as it is; anywhere
    else it is dequantized.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.loaded: set[str] = set()
        self.shards_loaded: dict[str, set[int]] = {}
        self.pieces_loaded: dict[str, set] = {}

    def copy(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> None:
        if isinstance(tensor, QuantizedWeight):
            if self._load_quantized(name, tensor, 0, 1, None):
                return
            tensor = dequantize(tensor)
        param = self._param(name)
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        self.loaded.add(name)

    def copy_shard(self, name: str, tensor: torch.Tensor | QuantizedWeight, index: int) -> None:
        sizes = self.model.get_submodule(name.rsplit(".", 1)[0]).shard_sizes
        if isinstance(tensor, QuantizedWeight):
            if self._load_quantized(name, tensor, index, len(sizes), sizes[index]):
                return
            tensor = dequantize(tensor)
        param = self._param(name)
        start = sum(sizes[:index])
        if tensor.shape[0] != sizes[index] or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"{name} shard {index}: checkpoint shape {tuple(tensor.shape)} does not fit")
        with torch.no_grad():
            param[start : start + sizes[index]].copy_(tensor)
        done = self.shards_loaded.setdefault(name, set())
        done.add(index)
        if len(done) == len(sizes):
            self.loaded.add(name)

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
            self.loaded.add(name)

    def _load_quantized(self, name: str, weight: QuantizedWeight, index: int, shards: int, rows: int | None) -> bool:
        """Hands a quantized weight (or one shard of it) to its Linear; False where the
        parameter is not a Linear's weight."""
        module_name, _, leaf = name.rpartition(".")
        module = self.model.get_submodule(module_name) if module_name else None
        if leaf != "weight" or not isinstance(module, Linear):
            return False
        self._param(name)  # a name the model has
        rows = module.out_features if rows is None else rows
        if weight.shape != (rows, module.in_features):
            raise ValueError(f"{name}: checkpoint shape {weight.shape} does not fit ({rows}, {module.in_features})")
        if module.load_quantized(weight, index, shards):
            self.loaded.add(name)
        return True

    def _param(self, name: str) -> nn.Parameter:
        if name not in self.params:
            raise KeyError(f"checkpoint weight {name!r} has no place in {type(self.model).__name__}")
        return self.params[name]

    def check_all_loaded(self) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
