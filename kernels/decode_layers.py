"""One user's decode step through a Qwen-style decoder's layers in one call.

A decode step streams every weight once, and each stream pushes everything else out of
the caches: run op by op from Python, each of a layer's dozen kernel calls first fetches
the interpreter's and torch's state from memory again (0.15-0.2 ms a projection on an AMD
EPYC; 5-10% of a step with bf16 weights, more with int4's). On the CPU the layers run
instead in kernels/csrc/decode_layers.cpp: the same kernels, in the same order, with the
same results. Elsewhere (no plan) the layers run their own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlmserve.kernels import cpu_extension
from vlmserve.kernels.attention import AttentionMetadata
from vlmserve.kernels.cpu_extension import cpu_kernels
from vlmserve.kernels.linear import one_row_on_bf16_gemv, one_row_on_pairs
from vlmserve.kernels.quantized_linear import QuantizedWeight
from vlmserve.kernels.registry import register


@dataclass
class Projection:
    weight: torch.Tensor | QuantizedWeight  # empty where the packed copy took its place
    bias: torch.Tensor | None
    packed: torch.Tensor | None = None  # the device's packed copy (Linear.pack)


@dataclass
class AttentionWeights:
    """Causal self-attention: q, k, v from one projection, q_norm/k_norm (or None) over
    each head's queries and keys, the rotary, attention over the layer's KV cache, o."""

    layer_id: int  # its KV cache and metadata in a step's ForwardContext
    qkv: Projection
    o: Projection
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float | None = None
    k_scale: float = 1.0  # an FP8 KV cache's scales (attention.py)
    v_scale: float = 1.0


@dataclass
class DecoderLayerWeights:
    """x + attention(norm(x)), then x + down(silu(gate) * up)(norm(x)), RMSNorms of one eps."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    eps: float
    attention: AttentionWeights
    gate_up: Projection
    down: Projection


@dataclass
class DecodePlan:
    layers: Any  # the kernels' DecodeLayers
    layer_ids: list[int]

    def shared_metadata(self, attn_metadata: dict[int, AttentionMetadata]) -> AttentionMetadata | None:
        """The step's attention metadata, when every layer has the same (one KV cache
        group, no window or bidirectional span of its own); None: they run layer by layer."""
        meta = attn_metadata[self.layer_ids[0]]
        if meta.key_ends is not None or any(attn_metadata[i] is not meta for i in self.layer_ids):
            return None
        return meta


@register("plan_decode_layers")
def plan_decode_layers(layers: list[DecoderLayerWeights | None]) -> DecodePlan | None:
    """What `decode_layers` takes for these layers, or None: they run op by op."""
    return None


@register("plan_decode_layers", "cpu", available=cpu_extension.available)
def plan_decode_layers_cpu(layers: list[DecoderLayerWeights | None]) -> DecodePlan | None:
    kernels = cpu_kernels()
    plan = kernels.DecodeLayers()
    for layer in layers:
        if layer is None:
            return None
        attn = layer.attention
        projections = [_one_row_kernel(p) for p in (attn.qkv, attn.o, layer.gate_up, layer.down)]
        if None in projections or attn.qk_eps not in (None, layer.eps):
            return None
        qkv, o, gate_up, down = projections
        plan.append(kernels.DecodeLayer(
            input_norm=layer.input_norm, post_attention_norm=layer.post_attention_norm, q_norm=attn.q_norm,
            k_norm=attn.k_norm, qkv=qkv, o=o, gate_up=gate_up, down=down, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, scale=attn.scale, eps=layer.eps,
            k_scale=attn.k_scale, v_scale=attn.v_scale))
    return DecodePlan(plan, [layer.attention.layer_id for layer in layers]) if layers else None


def _one_row_kernel(p: Projection) -> Any | None:
    """The projection as the kernel that `linear` / `quantized_linear` runs one bf16 row on
    (None: one it does not run here)."""
    w, kernels = p.weight, cpu_kernels()
    if isinstance(w, QuantizedWeight):
        if w.layout != "gemv" or w.method not in ("int8", "int4") or w.dtype != torch.bfloat16:
            return None
        return kernels.DecodeLinear(w.method, w.data, w.scales, w.zeros, p.bias)
    if one_row_on_pairs(w, p.packed):
        return kernels.DecodeLinear("pairs", p.packed, bias=p.bias)
    return kernels.DecodeLinear("bf16", w, bias=p.bias) if one_row_on_bf16_gemv(w) else None


@register("decode_layers")
def decode_layers(plan: DecodePlan, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
                  sin: torch.Tensor, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers of `plan` over one token (x + delta; delta None before the first layer),
    its keys and values written to each layer's cache in kv_caches (by layer id), all under
    `meta` (plan.shared_metadata): (x, delta) after the last layer, as the layers' own
    forward returns them."""
    raise NotImplementedError("decode_layers runs a plan of plan_decode_layers, which only the CPU makes")


@register("decode_layers", "cpu", available=cpu_extension.available)
def decode_layers_cpu(plan: DecodePlan, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]],
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    caches = [kv_caches[i] for i in plan.layer_ids]
    return cpu_kernels().decode_layers(plan.layers, x, delta, cos, sin, [k for k, _ in caches], [v for _, v in caches],
                                       meta.slot_mapping, meta.block_tables, meta.query_start, meta.seq_lens,
                                       meta.sliding_window)
