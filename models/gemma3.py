"""Gemma 3: a SigLIP vision tower whose patch features are average-pooled to a fixed
number of tokens per picture (and per pan-and-scan crop), and a decoder of interleaved
sliding-window and global layers, each with its own rotary base, four (1 + weight)
RMSNorms per layer and q/k norms; embeddings scaled by sqrt(hidden), tied to the output.

A picture's tokens attend to each other both ways (each crop is its own run of tokens):
the model declares `bidirectional_media`, so the input processor marks its features, the
scheduler never cuts one across steps, and the runner gives the attention each query's
last visible key (AttentionMetadata.key_ends).

Module names are transformers 5's (`model.vision_tower.*`, `model.multi_modal_projector.*`,
`model.language_model.*`); the released layout is mapped to them at load, q/k/v and
gate/up fused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from vlmserve.kernels import ops
from vlmserve.models.base import VisionLanguageModel
from vlmserve.models.context import ForwardContext
from vlmserve.models.layers import (ACTIVATIONS, Embedding, FusedLinear, GatedMLP, Linear, QKNormAttention,
                                    ZeroCenteredRMSNorm, kept, rope_inv_freq)
from vlmserve.multimodal.inputs import MultiModalFeature


# ----------------------------------------------------------------------------- vision
class SiglipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv_proj = FusedLinear(dim, [dim, dim, dim], bias=True)
        self.out_proj = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, patches: int) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        out = ops.varlen_attention(q, k, v, [patches] * (n // patches), self.head_dim**-0.5)
        return self.out_proj(out.reshape(n, -1))


class SiglipMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg.hidden_size, cfg.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor, patches: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), patches)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    """[pictures, 3, size, size] -> [pictures, patches, width]: every patch sees every
    other patch of its picture."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([SiglipEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        pictures, patches, width = x.shape
        x = x.reshape(pictures * patches, width)
        for layer in self.encoder.layers:
            x = layer(x, patches)
        return self.post_layernorm(x).view(pictures, patches, width)


class MultiModalProjector(nn.Module):
    """Patch features average-pooled to mm_tokens_per_image, normed, projected to the
    decoder's width."""

    def __init__(self, config) -> None:
        super().__init__()
        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, config.text_config.hidden_size))
        self.mm_soft_emb_norm = ZeroCenteredRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.patches_per_side = vision.image_size // vision.patch_size
        self.pool = self.patches_per_side // int(config.mm_tokens_per_image**0.5)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        pictures, _, width = features.shape
        grid = features.transpose(1, 2).reshape(pictures, width, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


# ----------------------------------------------------------------------------- text
def layer_inv_freq(cfg, layer_type: str, head_dim: int) -> torch.Tensor:
    """Rotary frequencies of a layer type: its own base, and for `linear` scaling
    (Gemma 3's global layers) divided by the factor."""
    rope = (cfg.rope_parameters or {}).get(layer_type) or {}
    kind = rope.get("rope_type", "default")
    if kind not in ("default", "linear"):
        raise ValueError(f"Gemma 3 rotary type {kind!r} of {layer_type} layers is not supported (default, linear)")
    inv_freq = rope_inv_freq(head_dim, rope.get("rope_theta", 1e6 if layer_type == "full_attention" else 1e4))
    return inv_freq / rope.get("factor", 1.0) if kind == "linear" else inv_freq


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_id: int) -> None:
        super().__init__()
        self.self_attn = QKNormAttention(cfg, layer_id, ZeroCenteredRMSNorm, cfg.query_pre_attn_scalar**-0.5)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_activation)
        eps = cfg.rms_norm_eps
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, delta, cos, sin, ctx: ForwardContext, keep_rows: torch.Tensor | None = None):
        """(x, delta) in and out, keep_rows as PreNormDecoderLayer's."""
        x, h = self.input_layernorm.add_and_norm(x, delta)
        x, attended = kept(keep_rows, x, self.self_attn(h, cos, sin, ctx))
        x, h = self.pre_feedforward_layernorm.add_and_norm(x, self.post_attention_layernorm(attended))
        return x, self.post_feedforward_layernorm(self.mlp(h))


class TextModel(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        if getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 text models with attention soft-capping or bidirectional text are not supported")
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layer_types = list(cfg.layer_types)
        self.rope_types = sorted(set(self.layer_types))
        for kind in self.rope_types:
            self.register_buffer(f"inv_freq_{kind}", layer_inv_freq(cfg, kind, cfg.head_dim), persistent=False)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tables = {}
        for kind in self.rope_types:  # 1-D positions: the runner's three rows are equal
            freqs = positions[0].float()[:, None] * getattr(self, f"inv_freq_{kind}")[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            tables[kind] = emb.cos().to(embeds.dtype), emb.sin().to(embeds.dtype)
        x, delta = embeds, None
        last = len(self.layers) - 1
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_types)):
            x, delta = layer(x, delta, *tables[kind], ctx, ctx.output_rows if i == last else None)
        return self.norm.add_and_norm(x, delta)[1]


# ----------------------------------------------------------------------------- model
class Gemma3ForConditionalGeneration(VisionLanguageModel):
    vision_cls = SiglipVisionModel
    vision_name = "vision_tower"
    decoder_cls = TextModel
    bidirectional_media = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model.multi_modal_projector = MultiModalProjector(config)
        self.final_softcap = getattr(self.text_config, "final_logit_softcapping", None)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embed = self.model.language_model.embed_tokens
        # the scale rounded to the weights' dtype first, as Gemma was trained
        return embed(input_ids) * torch.tensor(self.text_config.hidden_size**0.5, dtype=embed.weight.dtype)

    def embed_multimodal(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
        """One picture or crop per feature: [mm_tokens_per_image, hidden] each."""
        device = self.model.language_model.embed_tokens.weight.device
        pixels = torch.cat([f.data["pixel_values"] for f in features]).to(device)
        tokens = self.model.multi_modal_projector(self.model.vision_tower(pixels))
        return list(tokens.reshape(-1, tokens.shape[-1]).split([f.length for f in features]))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @staticmethod
    def canonical_name(name: str) -> str:
        """The released layout (`language_model.model.*`, `vision_tower.vision_model.*`,
        `multi_modal_projector.*`) to transformers 5's."""
        name = name.replace("vision_tower.vision_model.", "vision_tower.")
        for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                return new + name[len(old):]
        return name

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[int, KVCacheSpec]:
        cfg = self.text_config
        common = dict(block_size=block_size, num_kv_heads=self.kv_heads_per_rank(), head_size=cfg.head_dim, dtype=dtype)
        return {i: SlidingWindowSpec(**common, sliding_window=cfg.sliding_window) if kind == "sliding_attention"
                else FullAttentionSpec(**common) for i, kind in enumerate(cfg.layer_types)}

    @staticmethod
    def mrope_positions(config, token_ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
        """Plain 1-D positions (as three equal rows, what the runner passes every model)."""
        return torch.arange(len(token_ids)).repeat(3, 1), 0
