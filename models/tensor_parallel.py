"""Splitting a built model across the ranks of a tensor-parallel group, as Megatron-LM
laid it out and vLLM and SGLang split the same checkpoints: each layer's input projections
keep the rank's heads (or the rank's share of the MLP's width) — column-parallel — and its
output projection the matching input columns — row-parallel — whose partial outputs the
ranks sum. The embedding table and the output head keep the rank's share of the vocabulary
(rows looked up where the rank has them and summed; logits gathered). Key/value heads
fewer than the ranks are replicated, as vLLM does. The vision tower is not split: every
rank runs it whole.

A split layer gets new, smaller parameters before the checkpoint is read, and records for
each the part of the checkpoint's tensor it holds (`rank_parts`): the loader cuts that part
from the memory-mapped tensor, so no rank reads the whole checkpoint into memory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from vlmserve.distributed import TensorParallel
from vlmserve.errors import ConfigError
from vlmserve.kernels.quantized_linear import QuantizedWeight


def units_of_rank(units: int, tp: TensorParallel, what: str = "heads") -> tuple[int, int]:
    """(first, count) of the units (heads, experts, columns) a rank holds: an equal share,
    or, with fewer units than ranks, the one unit its group of ranks shares."""
    if units % tp.size == 0:
        share = units // tp.size
        return tp.rank * share, share
    if tp.size % units == 0:
        return tp.rank * units // tp.size, 1
    raise ConfigError(f"--tensor-parallel-size {tp.size} does not divide the model's {units} {what} (nor they it)")


@dataclass(frozen=True)
class RankPart:
    """A rank's part of a checkpoint tensor: along `dim` the tensor is consecutive blocks of
    (units, unit size); of each block the rank holds its units (units_of_rank), in order."""

    dim: int
    blocks: tuple[tuple[int, int], ...]
    tp: TensorParallel

    def length(self) -> int:
        return sum(units_of_rank(units, self.tp)[1] * size for units, size in self.blocks)

    def whole(self) -> int:
        """The checkpoint tensor's length along dim (every rank's parts together)."""
        return sum(units * size for units, size in self.blocks)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        whole = self.whole()
        if whole != tensor.shape[self.dim]:
            raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)}: expected {whole} along dim {self.dim}")
        return self._narrow(tensor, self.dim, 1)

    def _narrow(self, tensor: torch.Tensor, dim: int, per: int) -> torch.Tensor:
        """The rank's part of tensor along dim, where one element there stands for `per`
        of the weight's (packed int4 values, a scale's group); ValueError where a part
        would cut an element."""
        pieces, start = [], 0
        for units, size in self.blocks:
            first, count = units_of_rank(units, self.tp)
            offset, length = start + first * size, count * size
            if offset % per or length % per:
                raise ValueError(f"a rank's part ({length} at {offset}) does not hold whole groups of {per}")
            pieces.append(tensor.narrow(dim, offset // per, length // per))
            start += units * size
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    def take_quantized(self, qw: QuantizedWeight) -> QuantizedWeight:
        """The rank's rows or columns of a weight quantized in the checkpoint, kept quantized:
        its values, and its scales (and zeros) where they vary along the split dimension."""
        if qw.layout != "plain":
            raise ValueError(f"a {qw.layout} layout is not split")
        data = self._narrow(qw.data, self.dim, 2 if qw.method == "int4" and self.dim == 1 else 1)

        def scales(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or (self.dim == 1 and t.dim() == 1):  # per-row scales hold for a row's columns
                return t
            return self._narrow(t, self.dim, qw.group if self.dim == 1 else 1)

        shape = list(qw.shape)
        shape[self.dim] = self.length()
        return dataclasses.replace(qw, shape=tuple(shape), data=data, scales=scales(qw.scales), zeros=scales(qw.zeros))


@dataclass(frozen=True)
class VocabPart:
    """A rank's rows of the vocabulary: an equal share of it padded up to a multiple of the
    ranks (the last rank's padding rows are zeros: their logits are cut off)."""

    vocab: int
    tp: TensorParallel

    @property
    def rows(self) -> int:
        return -(-self.vocab // self.tp.size)

    @property
    def start(self) -> int:
        return self.tp.rank * self.rows

    def length(self) -> int:
        return self.rows

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        part = tensor[self.start : self.start + self.rows]
        if part.shape[0] == self.rows:
            return part
        return torch.cat([part, part.new_zeros(self.rows - part.shape[0], *part.shape[1:])])

    def take_quantized(self, qw: QuantizedWeight) -> QuantizedWeight:
        raise ValueError("a quantized vocabulary is split in the model's dtype")


@dataclass(frozen=True)
class FirstRankOnly:
    """A row-parallel layer's bias: added once, by rank 0 (the others hold zeros)."""

    tp: TensorParallel

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)

    def take_quantized(self, qw: QuantizedWeight) -> QuantizedWeight:
        raise ValueError("a bias is not quantized")


def set_part(module: nn.Module, leaf: str, part, shape: tuple[int, ...], index: int | None = None) -> None:
    """Gives module.leaf a new (empty) parameter of the rank's shape and records its part
    of the checkpoint's tensor (of shard `index` of a fused layer)."""
    old = getattr(module, leaf)
    if index is None or index == 0:
        setattr(module, leaf, nn.Parameter(old.new_empty(shape), requires_grad=False))
    if not hasattr(module, "rank_parts"):
        module.rank_parts = {}
    module.rank_parts[(leaf, index)] = part


def split_output(linear: nn.Module, tp: TensorParallel, blocks: list[tuple[tuple[int, int], ...]]) -> None:
    """Column-parallel: each of the layer's projections (one unless fused) keeps the rank's
    output rows; blocks[i] describes projection i as RankPart does."""
    parts = [RankPart(0, b, tp) for b in blocks]
    sizes = [p.length() for p in parts]
    fused = hasattr(linear, "shard_sizes")
    for i, part in enumerate(parts):
        index = i if fused else None
        set_part(linear, "weight", part, (sum(sizes), linear.in_features), index)
        if linear.bias is not None:
            set_part(linear, "bias", part, (sum(sizes),), index)
    linear.out_features = sum(sizes)
    if fused:
        linear.shard_sizes = sizes


def split_input(linear: nn.Module, tp: TensorParallel, units: int, unit_size: int) -> None:
    """Row-parallel: the layer keeps the rank's input columns; the ranks' outputs are summed."""
    part = RankPart(1, ((units, unit_size),), tp)
    set_part(linear, "weight", part, (linear.out_features, part.length()))
    if linear.bias is not None:
        set_part(linear, "bias", FirstRankOnly(tp), (linear.out_features,))
    linear.in_features = part.length()
    linear.sum_over = tp


def weight_part(linear: nn.Module, shard: int = 0) -> RankPart | None:
    """The rank's part of a split linear layer's weight (of projection `shard` of a fused
    one); None where the layer is whole."""
    parts = getattr(linear, "rank_parts", {})
    part = parts.get(("weight", shard)) or parts.get(("weight", None))
    return part if isinstance(part, RankPart) else None


def split_vocab(module: nn.Module, tp: TensorParallel) -> VocabPart:
    """An embedding table or an output head: the rank's rows of the vocabulary."""
    part = VocabPart(module.weight.shape[0], tp)
    set_part(module, "weight", part, (part.rows, module.weight.shape[1]))
    if hasattr(module, "out_features"):
        module.out_features = part.rows
    else:
        module.num_embeddings = part.rows
    return part


def shard_model(model: nn.Module, tp: TensorParallel, expert_parallel: bool = False) -> None:
    """Splits the language model of a just-built model (its weights not read yet) for the
    rank `tp.rank`: every module of it that knows how (`split_for_ranks`: attention, MLPs,
    experts, DeltaNet layers, the embedding table), and the output head."""
    if tp.size == 1:
        return
    decoder = model.model.language_model
    for module in list(decoder.modules()):  # the embedding table among them
        if hasattr(module, "split_for_ranks"):
            module.split_for_ranks(tp, expert_parallel)
    if model.lm_head is not None:
        split_vocab(model.lm_head, tp)
    model.tp = tp
