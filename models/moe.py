"""Mixture-of-experts feed-forward layers (Qwen3-VL-MoE, Qwen3.5-MoE): a softmax router
picks each token's top-k experts (their weights renormalised to sum to one, as the
reference does), the experts run over the whole batch at once — tokens grouped by
expert, one gate/up and one down matmul per active expert (`ops.linear`: the device's
matmuls for a few rows and for bf16 on CPUs without bf16 arithmetic) — and Qwen3.5-MoE adds
a shared expert scaled by a sigmoid gate.

The experts' weights are kept as transformers 5 keeps them: gate_up_proj
[experts, 2 * intermediate, hidden] and down_proj [experts, hidden, intermediate].
Checkpoints store them that way, transposed (Qwen's releases of Qwen3-VL-MoE), or one
expert at a time (`experts.<e>.gate_proj/up_proj/down_proj.weight`); load_expert_weight
takes all three.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.distributed import TensorParallel
from vlmserve.kernels import ops
from vlmserve.models.layers import ACTIVATIONS, GatedMLP, Linear
from vlmserve.models.tensor_parallel import RankPart, set_part, units_of_rank
from vlmserve.models.weights import WeightLoader


def feed_forward(cfg, layer_id: int) -> nn.Module:
    """The layer's MLP: routed experts where the config puts them, dense elsewhere."""
    sparse_step = getattr(cfg, "decoder_sparse_step", None) or 1
    if (getattr(cfg, "num_experts", 0) and layer_id not in (getattr(cfg, "mlp_only_layers", None) or [])
            and (layer_id + 1) % sparse_step == 0):
        return SparseMoE(cfg)
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)


class Experts(nn.Module):
    """Split across ranks, each rank holds a share of every expert's intermediate width
    (tensor parallel), or with expert parallelism whole experts, a share of them; either
    way the ranks' outputs are summed."""

    sum_over: TensorParallel | None = None

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden, self.intermediate = hidden, intermediate  # the checkpoint's (whole) sizes
        self.first_expert, self.local_experts = 0, num_experts  # the experts this rank holds
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.act = ACTIVATIONS[act]

    def split_for_ranks(self, tp: TensorParallel, expert_parallel: bool) -> None:
        n, width = self.num_experts, self.intermediate
        if expert_parallel:
            self.first_expert, self.local_experts = units_of_rank(n, tp, "experts")
            experts = RankPart(0, ((n, 1),), tp)
            set_part(self, "gate_up_proj", experts, (self.local_experts, 2 * width, self.hidden))
            set_part(self, "down_proj", experts, (self.local_experts, self.hidden, width))
        else:
            gate_up = RankPart(1, ((width, 1), (width, 1)), tp)
            set_part(self, "gate_up_proj", gate_up, (n, gate_up.length(), self.hidden))
            set_part(self, "down_proj", RankPart(2, ((width, 1),), tp), (n, self.hidden, gate_up.length() // 2))
        self.sum_over = tp

    def piece_part(self, part: str) -> RankPart | None:
        """The rank's part of one expert's gate_proj/up_proj ([width, hidden]) or down_proj
        ([hidden, width]) in a checkpoint that stores them one by one (None: all of it)."""
        if self.sum_over is None or self.local_experts < self.num_experts:
            return None
        return RankPart(0 if part != "down_proj" else 1, ((self.intermediate, 1),), self.sum_over)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [tokens, hidden]; experts, weights [tokens, k]: the weighted sum of each
        token's experts."""
        if not x.shape[0]:
            return x.clone()  # no tokens (the last layer of a step whose output nobody reads)
        k = experts.shape[1]
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        # this rank's experts' (token, slot) pairs: all of them unless experts are split by rank
        begin = sum(counts[: self.first_expert])
        local = counts[self.first_expert : self.first_expert + self.local_experts]
        order = order[begin : begin + sum(local)]
        tokens = order // k
        grouped = x[tokens]
        outs, start = [], 0
        for e, count in enumerate(local):
            if count:
                gate_up = ops.linear(grouped[start : start + count], self.gate_up_proj[e], None)
                outs.append(ops.linear(self._act_and_mul(gate_up), self.down_proj[e], None))
            start += count
        out = torch.zeros_like(x)
        if outs:
            out.index_add_(0, tokens, torch.cat(outs) * weights.flatten()[order, None])
        return out if self.sum_over is None else self.sum_over.all_reduce(out)

    def _act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.act is F.silu:
            return ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


class SparseMoE(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Module()  # the router, under the checkpoint's name
        self.gate.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        shared = getattr(cfg, "shared_expert_intermediate_size", None)
        self.shared_expert = GatedMLP(cfg.hidden_size, shared, cfg.hidden_act) if shared else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if shared else None

    def decode_weights(self) -> None:
        """None: ops.decode_layers runs dense feed-forwards only (see GatedMLP)."""
        return

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = ops.linear(x, self.gate.weight, None)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = self.experts(x, experts, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


_ONE_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def load_expert_weight(loader: WeightLoader, name: str, tensor: torch.Tensor) -> bool:
    """Loads an experts' weight in any of the layouts checkpoints use; False when the
    name is not one."""
    one = _ONE_EXPERT.match(name)
    if one:
        prefix, e, part = one.group(1), int(one.group(2)), one.group(3)
        experts: Experts = loader.model.get_submodule(prefix)
        e -= experts.first_expert
        if not 0 <= e < experts.local_experts:
            return True  # another rank's expert
        rank_part = experts.piece_part(part)
        tensor = tensor if rank_part is None else rank_part.take(tensor)
        pieces = experts.local_experts * (1 if part == "down_proj" else 2)
        if part == "down_proj":
            loader.copy_piece(f"{prefix}.down_proj", (e, part), (e,), tensor, pieces)
        else:
            rows = experts.gate_up_proj.shape[1] // 2
            region = (e, slice(0, rows) if part == "gate_proj" else slice(rows, 2 * rows))
            loader.copy_piece(f"{prefix}.gate_up_proj", (e, part), region, tensor, pieces)
        return True
    if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        experts: Experts = loader.model.get_submodule(name.rsplit(".", 1)[0])
        whole = (experts.num_experts, 2 * experts.intermediate, experts.hidden) if name.endswith("gate_up_proj") \
            else (experts.num_experts, experts.hidden, experts.intermediate)
        if tensor.shape != whole and tensor.transpose(1, 2).shape == whole:
            tensor = tensor.transpose(1, 2)  # Qwen's release layout: [experts, in, out]
        loader.copy(name, tensor)
        return True
    return False
