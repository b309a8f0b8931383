"""Reading HF safetensors checkpoints into vlmserve's modules."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

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

    Fused parameters (a FusedLinear's weight and bias) are filled shard by shard.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.loaded: set[str] = set()
        self.shards_loaded: dict[str, set[int]] = {}
        self.pieces_loaded: dict[str, set] = {}

    def copy(self, name: str, tensor: torch.Tensor) -> None:
        param = self._param(name)
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        self.loaded.add(name)

    def copy_shard(self, name: str, tensor: torch.Tensor, index: int) -> None:
        param = self._param(name)
        sizes = self.model.get_submodule(name.rsplit(".", 1)[0]).shard_sizes
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

    def _param(self, name: str) -> nn.Parameter:
        if name not in self.params:
            raise KeyError(f"checkpoint weight {name!r} has no place in {type(self.model).__name__}")
        return self.params[name]

    def check_all_loaded(self) -> None:
        missing = sorted(set(self.params) - self.loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
