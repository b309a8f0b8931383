"""Qwen3.5: a hybrid language model — Gated DeltaNet layers (causal conv1d + gated delta
rule, a constant-size recurrent state per request) mixed with gated full-attention
layers (q/k norms, sigmoid output gate, partial interleaved M-RoPE) — and Qwen3-VL's
vision tower (models/qwen3_vl.py) without DeepStack.

Module names follow the HF checkpoint (`model.visual.*`, `model.language_model.*`);
q/k/v, gate/up and the four input projections of a DeltaNet layer are fused at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MambaSpec
from vlmserve.distributed import TensorParallel
from vlmserve.kernels import ops
from vlmserve.kernels.gdn import RecurrentMetadata
from vlmserve.models.base import MRoPEDecoder, VisionLanguageModel
from vlmserve.models.context import ForwardContext
from vlmserve.models.layers import (
    FusedLinear,
    Linear,
    QKNormAttention,
    ZeroCenteredRMSNorm,
    kept,
    mrope_positions,
)
from vlmserve.models.moe import feed_forward
from vlmserve.models.qwen3_vl import VisionTransformer
from vlmserve.models.tensor_parallel import RankPart, set_part, split_input, split_output, units_of_rank
from vlmserve.multimodal.inputs import MultiModalFeature


# ----------------------------------------------------------------------------- text
class GatedAttention(QKNormAttention):
    """Full attention with per-head q/k norms (zero-centred), partial rotary and a sigmoid
    output gate."""

    def __init__(self, cfg, layer_id: int) -> None:
        super().__init__(cfg, layer_id, ZeroCenteredRMSNorm, query_gate=True)

    def forward(self, h, cos, sin, ctx: ForwardContext):
        n = h.shape[0]
        qg, k, v = self.qkv_proj(h).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        # per head: [query | gate]
        q, gate = qg.view(n, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q, k = self.rotate(q, k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        o = self.attend(q, k, v.view(n, self.num_kv_heads, self.head_dim), ctx)
        return self.o_proj(o * torch.sigmoid(gate.reshape(n, self.q_size)))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k, self.head_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k
        self.value_dim = self.num_v_heads * self.head_v
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a of the checkpoint, as one matmul
        self.in_proj = FusedLinear(
            cfg.hidden_size, [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], bias=False
        )
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.head_v))
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)

    def split_for_ranks(self, tp: TensorParallel, expert_parallel: bool) -> None:
        """The rank's key and value heads (their projections, convolution channels, decay
        and gate parameters, and recurrent state); the output projection row-parallel."""
        nk, nv = self.num_k_heads, self.num_v_heads
        conv = ((nk, self.head_k), (nk, self.head_k), (nv, self.head_v))
        split_output(self.in_proj, tp, [conv, ((nv, self.head_v),), ((nv, 1),), ((nv, 1),)])
        conv_part = RankPart(0, conv, tp)
        set_part(self.conv1d, "weight", conv_part, (conv_part.length(), 1, self.kernel))
        heads = RankPart(0, ((nv, 1),), tp)
        for leaf in ("dt_bias", "A_log"):
            set_part(self, leaf, heads, (heads.length(),))
        split_input(self.out_proj, tp, nv, self.head_v)
        self.num_k_heads, self.num_v_heads = units_of_rank(nk, tp)[1], heads.length()
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k, self.num_v_heads * self.head_v
        self.conv_dim = conv_part.length()

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.conv_dim, self.kernel - 1), (self.num_v_heads, self.head_k, self.head_v)

    def forward(self, h, ctx: ForwardContext):
        n = h.shape[0]
        mixed, z, b, a = self.in_proj(h).split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], -1)
        meta: RecurrentMetadata = ctx.layer_state[self.layer_id]
        conv_state, ssm_state = ctx.kv_caches[self.layer_id]
        conv_out = ops.causal_conv1d(mixed, self.conv1d.weight.squeeze(1), conv_state, meta)
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(n, self.num_k_heads, self.head_k)
        k = k.view(n, self.num_k_heads, self.head_k)
        v = v.view(n, self.num_v_heads, self.head_v)
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = ops.gated_delta_rule(q, k, v, g, beta, ssm_state, meta)

        out = ops.gated_rms_norm(core.reshape(-1, self.head_v), z.reshape(-1, self.head_v), self.norm.weight, self.eps)
        return self.out_proj(out.reshape(n, self.value_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int) -> None:
        super().__init__()
        self.kind = cfg.layer_types[layer_id]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, layer_id)
        else:
            self.self_attn = GatedAttention(cfg, layer_id)
        self.mlp = feed_forward(cfg, layer_id)  # dense, or experts with a shared one (Qwen3.5-MoE)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def decode_weights(self) -> None:
        """None: its attention (gated, or Gated DeltaNet) runs op by op (see PreNormDecoderLayer)."""
        return

    def forward(self, x, delta, cos, sin, ctx: ForwardContext, keep_rows: torch.Tensor | None = None):
        """(x, delta) in and out, keep_rows as PreNormDecoderLayer's."""
        x, h = self.input_layernorm.add_and_norm(x, delta)
        mixed = self.linear_attn(h, ctx) if self.kind == "linear_attention" else self.self_attn(h, cos, sin, ctx)
        x, h = self.post_attention_layernorm.add_and_norm(*kept(keep_rows, x, mixed))
        return x, self.mlp(h)


class TextModel(MRoPEDecoder):
    def __init__(self, cfg) -> None:
        rotary_dim = int(cfg.head_dim * (cfg.rope_parameters or {}).get("partial_rotary_factor", 1.0))
        super().__init__(cfg, DecoderLayer, ZeroCenteredRMSNorm, rotary_dim, default_section=[11, 11, 10],
                         default_theta=1e7, interleaved=True)


# ----------------------------------------------------------------------------- model
class Qwen3_5ForConditionalGeneration(VisionLanguageModel):
    vision_cls = VisionTransformer
    decoder_cls = TextModel
    # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a of a DeltaNet layer run as one matmul
    extra_fused = {".in_proj_qkv.": (".in_proj.", 0), ".in_proj_z.": (".in_proj.", 1),
                   ".in_proj_b.": (".in_proj.", 2), ".in_proj_a.": (".in_proj.", 3)}

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[int, KVCacheSpec]:
        cfg = self.text_config
        specs: dict[int, KVCacheSpec] = {}
        for i, layer in enumerate(self.model.language_model.layers):
            if layer.kind == "linear_attention":
                conv, ssm = layer.linear_attn.state_shapes()
                specs[i] = MambaSpec(block_size=block_size, conv_shape=conv, ssm_shape=ssm, dtype=dtype)
            else:
                specs[i] = FullAttentionSpec(block_size=block_size, num_kv_heads=self.kv_heads_per_rank(),
                                             head_size=cfg.head_dim, dtype=dtype)
        return specs

    @staticmethod
    def mrope_positions(config, token_ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
        # each frame group of a video is its own item (t = 1), its timestamp text between
        return mrope_positions(token_ids, features, config.vision_config.spatial_merge_size)
