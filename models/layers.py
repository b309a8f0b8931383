"""Building blocks shared by the model families."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.distributed import TensorParallel
from vlmserve.kernels import ops
from vlmserve.kernels.decode_layers import AttentionWeights, DecoderLayerWeights, Projection
from vlmserve.kernels.quantized_linear import QuantizedWeight, concat_rows, dequantize, quantizable, quantize
from vlmserve.models.lora import LinearLoRA, LoRABatch
from vlmserve.models.tensor_parallel import VocabPart, split_input, split_output, split_vocab

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it), in one pass: a layer's residual sum and its next norm
        (no delta: x and its norm)."""
        if delta is None:
            return x, self(x)
        return ops.add_rms_norm(x, delta, self.weight, self.eps)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), weight initialised at zero (Qwen3-Next, Qwen3.5)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm_zero_centered(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, this norm of it), in one pass: a layer's residual sum and its next norm
        (no delta: x and its norm)."""
        if delta is None:
            return x, self(x)
        return ops.add_rms_norm_zero_centered(x, delta, self.weight, self.eps)


def freed(weight: nn.Parameter) -> nn.Parameter:
    """What stands for a weight whose memory another form took over (a packed copy, a
    quantized one): empty, with the weight's dtype and device."""
    return nn.Parameter(weight.new_empty(0), requires_grad=False)


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be an output head's weight (tied embeddings): where the
    head's packed copy takes the table's place (`read_packed`), rows are read from it. Split
    across ranks, each holds a share of the vocabulary: a token's row comes from the rank
    that has it (the others give zeros), summed."""

    packed_weight: torch.Tensor | None = None
    vocab_part: VocabPart | None = None

    def read_packed(self, packed: torch.Tensor) -> None:
        self.packed_weight = packed
        self.weight = freed(self.weight)

    def split_for_ranks(self, tp: TensorParallel, expert_parallel: bool) -> None:
        self.vocab_part = split_vocab(self, tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        part = self.vocab_part
        if part is None:
            return ops.weight_rows(input_ids, self.weight, self.packed_weight)
        local = input_ids - part.start
        elsewhere = (local < 0) | (local >= part.rows)
        rows = ops.weight_rows(local.masked_fill(elsewhere, 0), self.weight, self.packed_weight)
        return part.tp.all_reduce(rows.masked_fill(elsewhere[:, None], 0))


class Linear(nn.Linear):
    """nn.Linear through `ops.linear`, so that a device can run it on a prepacked copy of
    the weight (`pack()`), or on a low-bit copy in its place (`quantize()`); either is
    called once after the weights are loaded. With LoRA slots (`enable_lora()`), each
    token's adapter adds its low-rank product to the output."""

    packed_weight: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None
    quantized_parts: dict[int, QuantizedWeight] | None = None  # a fused layer's shards, while loading
    lora: LinearLoRA | None = None
    sum_over: TensorParallel | None = None  # row-parallel: the ranks' outputs are summed
    # counts the layers given LoRA slots in this process: a plan made of the weights before
    # (MRoPEDecoder.decode_plan) is made again
    lora_generation: ClassVar[int] = 0

    @property
    def shard_sizes_out(self) -> list[int]:
        """The output rows of each projection it computes (one, unless fused)."""
        return [self.out_features]

    def enable_lora(self, batch: LoRABatch, num_slots: int, max_rank: int) -> LinearLoRA:
        if self.lora is None:
            dtype = self.weight.dtype if self.quantized is None else self.quantized.dtype
            self.lora = LinearLoRA(batch, num_slots, self.in_features, self.shard_sizes_out, max_rank, dtype,
                                   self.weight.device)
            Linear.lora_generation += 1
        return self.lora

    def pack(self, in_place: bool = True) -> bool:
        """Makes the packed copy; True where it takes the weight's place (serving every row
        count: one copy, not two), then made in the weight's own memory unless not
        `in_place` (another module reads the weight too)."""
        if self.quantized is not None:
            return False
        replaces = ops.packed_copy_replaces_weight(self.weight)
        self.packed_weight = ops.pack_linear_weight(self.weight, in_place=replaces and in_place)
        if not replaces or self.packed_weight is None:
            return False
        self.weight = freed(self.weight)
        return True

    def quantize(self, method: str) -> bool:
        """Replaces the weight by its quantized form (weight-only: activations keep their
        dtype); False where the layer's shape doesn't suit the method."""
        if not quantizable(self.weight, method):
            return False
        row_absmax = None
        if self.sum_over is not None and method == "int8":  # a rank's columns: the whole rows' scales
            row_absmax = self.sum_over.max_over_ranks(self.weight.detach().float().abs().amax(dim=1))
        self._set_quantized(quantize(self.weight, method, row_absmax=row_absmax))
        return True

    def add_quantized_shard(self, part: QuantizedWeight, index: int = 0) -> None:
        """A row block of the weight (the whole weight, unfused), quantized in the
        checkpoint; kept until `finish_loading`."""
        if self.quantized_parts is None:
            self.quantized_parts = {}
        self.quantized_parts[index] = part

    def finish_loading(self, shard_sizes: list[int]) -> None:
        """Every shard is in: all quantized, they become the quantized weight; mixed with
        plain ones (already in the weight), the quantized ones are dequantized into it."""
        parts, self.quantized_parts = self.quantized_parts or {}, None
        if len(parts) == len(shard_sizes):
            self._set_quantized(concat_rows([parts[i] for i in range(len(shard_sizes))]))
            return
        with torch.no_grad():
            for index, part in parts.items():
                start = sum(shard_sizes[:index])
                self.weight[start : start + shard_sizes[index]].copy_(dequantize(part))

    def prepare_quantized(self) -> None:
        """The quantized weight in the layout its device's kernel reads (once, after loading)."""
        if self.quantized is not None:
            self.quantized = ops.prepare_quantized_weight(self.quantized)

    def _apply(self, fn, recurse: bool = True):
        # the quantized weight is no parameter: it moves with the module (model.to(device))
        if self.quantized is not None:
            self.quantized = self.quantized.apply(fn)
        return super()._apply(fn, recurse)

    def _set_quantized(self, weight: QuantizedWeight) -> None:
        self.quantized = weight
        self.weight = freed(self.weight)

    def decode_projection(self) -> Projection | None:
        """Its weight (quantized, if it is), bias and packed copy, for ops.decode_layers; None
        with LoRA slots (their products are added here)."""
        if self.lora is not None or self.sum_over is not None:
            return None
        return Projection(self.weight if self.quantized is None else self.quantized, self.bias, self.packed_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            out = ops.quantized_linear(x, self.quantized, self.bias)
        else:
            out = ops.linear(x, self.weight, self.bias, self.packed_weight)
        if self.lora is not None:
            out = self.lora.add_to(out, x)
        return out if self.sum_over is None else self.sum_over.all_reduce(out)


class FusedLinear(Linear):
    """Several projections of the checkpoint computed as one matmul (fewer, larger ops
    run faster on CPU); `shard_sizes` tells the weight loader where each one goes."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)

    @property
    def shard_sizes_out(self) -> list[int]:
        return self.shard_sizes


# A prompt chunk's gate/up activations are the engine's largest temporaries (4,096 rows at
# Qwen2.5-VL-3B's widths: 180 MB, their product 90 MB), and the allocator keeps the process's
# peak (allocator.py): longer inputs go through the MLP in slices of this many rows
# (the matmuls read the weights once per 128 rows either way). Peak RSS of 32 chats at 3B
# widths: 4.66 -> 4.29 GB, as fast.
MLP_SLICE_ROWS = 1024


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]

    def split_for_ranks(self, tp: TensorParallel, expert_parallel: bool) -> None:
        """The rank's share of the intermediate width."""
        split_output(self.gate_up_proj, tp, [((self.intermediate, 1),)] * 2)
        split_input(self.down_proj, tp, self.intermediate, 1)
        self.intermediate = self.down_proj.in_features

    def decode_weights(self) -> tuple[Projection, Projection] | None:
        """(gate_up, down) for ops.decode_layers, which runs silu only."""
        gate_up, down = self.gate_up_proj.decode_projection(), self.down_proj.decode_projection()
        return None if self.act is not F.silu or gate_up is None or down is None else (gate_up, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows <= MLP_SLICE_ROWS or self.gate_up_proj.lora is not None:  # LoRA maps adapters to all the rows
            return self._forward(x)
        flat = x.reshape(rows, x.shape[-1])
        out = flat.new_empty(rows, self.down_proj.out_features)
        for start in range(0, rows, MLP_SLICE_ROWS):
            out[start : start + MLP_SLICE_ROWS] = self._forward(flat[start : start + MLP_SLICE_ROWS])
        return out.view(*x.shape[:-1], out.shape[-1])

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu:
            return self.down_proj(ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, sections: list[int], interleaved: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [tokens, 2 * len(inv_freq)] for M-RoPE positions [3, tokens].

    Each frequency takes its angle from one of the temporal/height/width positions:
    in consecutive sections (Qwen2-VL, Qwen2.5-VL) or interleaved t,h,w,t,h,w,...
    with the temporal axis keeping the remainder (Qwen3-VL, Qwen3.5).
    """
    freqs = positions.float()[:, :, None] * inv_freq[None, None, :]  # [3, tokens, dim/2]
    if interleaved:
        merged = freqs[0].clone()
        for axis in (1, 2):
            idx = slice(axis, sections[axis] * 3, 3)
            merged[..., idx] = freqs[axis][..., idx]
    else:
        merged = torch.cat([freqs[i % 3][..., part] for i, part in enumerate(_section_slices(sections))], dim=-1)
    emb = torch.cat((merged, merged), dim=-1)
    return emb.cos(), emb.sin()


def mrope_positions(
    token_ids: list[int], features, spatial_merge_size: int, video_time_scale: float | None = 1.0
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions [3, len(token_ids)] and the delta that continues them in decode,
    as transformers' get_rope_index computes them.

    Text advances all three axes by one per token. A media item at position p gets
    (p + t * interval, p + row, p + col) over its merged grid — interval is 1 for images
    and video_time_scale * seconds-per-grid-step for videos (1 again when the scale is
    None: Qwen2-VL counts grid steps) — and the text after it resumes at p + max(rows, cols).
    """
    n = len(token_ids)
    pos = torch.empty(3, n, dtype=torch.long)
    cur, idx = 0, 0
    for f in features:
        pos[:, idx : f.offset] = torch.arange(f.offset - idx) + cur
        cur += f.offset - idx
        t, h, w = (int(x) for x in f.data["grid_thw"])
        rows, cols = h // spatial_merge_size, w // spatial_merge_size
        interval: float | torch.Tensor = 1
        if f.modality == "video" and video_time_scale is not None and "second_per_grid_t" in f.data:
            # fp32, as transformers computes it, so the truncation below agrees
            interval = video_time_scale * torch.tensor(f.data["second_per_grid_t"], dtype=torch.float32)
        tpos = (torch.arange(t) * interval).long() + cur
        grid = torch.meshgrid(tpos, torch.arange(rows) + cur, torch.arange(cols) + cur, indexing="ij")
        pos[:, f.offset : f.end] = torch.stack(grid).reshape(3, -1)
        cur += max(h, w) // spatial_merge_size
        idx = f.end
    pos[:, idx:] = torch.arange(n - idx) + cur
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta


def _section_slices(sections: list[int]) -> list[slice]:
    slices, start = [], 0
    for size in sections:
        slices.append(slice(start, start + size))
        start += size
    return slices


class PagedAttention(nn.Module):
    """Causal self-attention of one decoder layer over its KV cache group: q, k, v from one
    fused projection, the rotary on q and k, attention over the paged cache, the output
    projection (Qwen2's, as released; the families that differ override `rotate`)."""

    # an FP8 KV cache's scales for this layer's keys and values (vLLM's k_scale, v_scale):
    # 1.0 unless the checkpoint gives them (load_kv_scale); other caches ignore them
    k_scale: float = 1.0
    v_scale: float = 1.0
    per_head_kv_scales: str | None = None  # the checkpoint's name of scales per head (refused with FP8)

    def __init__(
        self,
        layer_id: int,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool = False,
        query_gate: bool = False,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        # with a query gate (Qwen3.5), the query projection also yields the output gate
        q_out = 2 * self.q_size if query_gate else self.q_size
        self.qkv_proj = FusedLinear(hidden, [q_out, self.kv_size, self.kv_size], bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)

    def split_for_ranks(self, tp: TensorParallel, expert_parallel: bool) -> None:
        """The rank's query heads and the key/value heads they read (replicated where there
        are fewer than ranks)."""
        q_unit = self.qkv_proj.shard_sizes[0] // self.num_heads  # a head's query (and gate)
        kv = ((self.num_kv_heads, self.head_dim),)
        split_output(self.qkv_proj, tp, [((self.num_heads, q_unit),), kv, kv])
        split_input(self.o_proj, tp, self.num_heads, self.head_dim)
        self.num_heads = self.o_proj.in_features // self.head_dim
        self.num_kv_heads = self.qkv_proj.shard_sizes[1] // self.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        n = h.shape[0]
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotate(q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
                           cos, sin)
        return self.o_proj(self.attend(q, k, v.view(n, self.num_kv_heads, self.head_dim), ctx))

    def decode_weights(self) -> AttentionWeights | None:
        """Its weights for ops.decode_layers (None: a family's attention that computes more)."""
        qkv, o = self.qkv_proj.decode_projection(), self.o_proj.decode_projection()
        if qkv is None or o is None or self.qkv_proj.out_features != self.q_size + 2 * self.kv_size:
            return None  # LoRA slots, or a query gate
        return AttentionWeights(self.layer_id, qkv, o, self.num_heads, self.num_kv_heads, self.head_dim, self.scale,
                                k_scale=self.k_scale, v_scale=self.v_scale)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim], rotated."""
        return ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx) -> torch.Tensor:
        """Writes k and v into this layer's cache and attends over it: [tokens, q_size]."""
        kv_cache, meta = ctx.kv_caches[self.layer_id], ctx.attn_metadata[self.layer_id]
        out = ops.paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.k_scale, self.v_scale)
        return out.reshape(q.shape[0], self.q_size)


class QKNormAttention(PagedAttention):
    """Attention with a norm over each head's queries and keys before the rotary (Qwen3's
    RMSNorm; Gemma 3's zero-centred one, with its own query scale)."""

    def __init__(self, cfg, layer_id: int, norm_cls: type[nn.Module] = RMSNorm, scale: float | None = None,
                 query_gate: bool = False) -> None:
        super().__init__(layer_id, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, query_gate=query_gate)
        self.scale = scale or self.scale
        self.q_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = norm_cls(cfg.head_dim, cfg.rms_norm_eps)

    def decode_weights(self) -> AttentionWeights | None:
        weights = super().decode_weights()
        if weights is None or not isinstance(self.q_norm, RMSNorm) or self.q_norm.eps != self.k_norm.eps:
            return None  # ops.decode_layers runs plain RMSNorms of one eps
        weights.q_norm, weights.k_norm, weights.qk_eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        return weights

    def rotate(self, q, k, cos, sin):
        return ops.apply_rotary(self.q_norm(q), cos, sin), ops.apply_rotary(self.k_norm(k), cos, sin)


class PreNormDecoderLayer(nn.Module):
    """x + attention(norm(x)), then x + feed-forward(norm(x)): the Qwen families' layer
    (checkpoint names self_attn, mlp, input_layernorm, post_attention_layernorm).

    Like every decoder layer here it takes the hidden state as (x, delta), x + delta (delta
    None before the first layer), and returns its own that way: the feed-forward's sum is
    left to the next layer's norm, which adds it in the same pass (`add_and_norm`), one op a
    layer fewer when decoding, where each op's fixed cost counts."""

    def __init__(self, cfg, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def decode_weights(self) -> DecoderLayerWeights | None:
        """Its weights for ops.decode_layers (None: it computes something that does not run)."""
        attention, mlp = self.self_attn.decode_weights(), self.mlp.decode_weights()
        eps = self.input_layernorm.eps
        if attention is None or mlp is None or self.post_attention_layernorm.eps != eps:
            return None
        return DecoderLayerWeights(self.input_layernorm.weight, self.post_attention_layernorm.weight, eps, attention,
                                   *mlp)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, ctx,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """keep_rows (the last layer): the rows that go on past the attention, which
        every row needs for the cache; the others' feed-forward would be read by nothing."""
        x, h = self.input_layernorm.add_and_norm(x, delta)
        x, h = self.post_attention_layernorm.add_and_norm(*kept(keep_rows, x, self.self_attn(h, cos, sin, ctx)))
        return x, self.mlp(h)


def kept(rows: torch.Tensor | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The given rows of each tensor (all of them where rows is None)."""
    return tensors if rows is None else tuple(t[rows] for t in tensors)
