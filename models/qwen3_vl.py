"""Qwen3-VL, dense and MoE (models/moe.py): a vision tower with learned position embeddings resampled to each
grid, 2-D rotary and LayerNorm blocks, whose intermediate features at a few blocks
(DeepStack) are merged like the last ones and added into the outputs of the first
decoder layers at the pictures' tokens; a Qwen3 decoder (q/k RMSNorm per head) with
interleaved M-RoPE. Videos come as frame groups (t = 1 each) with timestamp text
between them, as Qwen3-VL's processor writes them.

The tower is also Qwen3.5's (without DeepStack). Module names follow the HF checkpoint;
q/k/v and gate/up are fused at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from vlmserve.models.base import MRoPEDecoder, VisionLanguageModel
from vlmserve.models.context import DeepStackInputs
from vlmserve.models.layers import (ACTIVATIONS, Linear, PreNormDecoderLayer, QKNormAttention, RMSNorm, mrope_positions,
                                    rope_inv_freq)
from vlmserve.models.moe import feed_forward
from vlmserve.models.vision import VisionAttention, VisionBlock, vision_rotary_cos_sin
from vlmserve.multimodal.inputs import MultiModalFeature


# ----------------------------------------------------------------------------- vision
class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = Linear(dim, hidden)
        self.linear_fc2 = Linear(hidden, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


def vision_block(cfg) -> VisionBlock:
    return VisionBlock(nn.LayerNorm(cfg.hidden_size, eps=1e-6), nn.LayerNorm(cfg.hidden_size, eps=1e-6),
                       VisionAttention(cfg.hidden_size, cfg.num_heads),
                       VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act))


class PatchMerger(nn.Module):
    """2x2 patches into one token: LayerNorm (over a patch, or over the four merged —
    DeepStack's mergers), then a GELU MLP."""

    def __init__(self, cfg, norm_after_merge: bool = False) -> None:
        super().__init__()
        self.hidden = cfg.hidden_size * cfg.spatial_merge_size**2
        self.norm_after_merge = norm_after_merge
        self.norm = nn.LayerNorm(self.hidden if norm_after_merge else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.hidden, self.hidden)
        self.linear_fc2 = Linear(self.hidden, cfg.out_hidden_size)

    def forward(self, x):
        x = self.norm(x.view(-1, self.hidden)) if self.norm_after_merge else self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTransformer(nn.Module):
    """Returns [merged tokens, (1 + DeepStack levels) * out_hidden]: the last block's
    features, then each DeepStack level's, side by side (Qwen3.5's config names none)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.hidden = cfg.hidden_size
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        # a Conv3d whose kernel equals its stride is a matmul over flattened patches
        self.patch_embed = Linear(patch_dim, cfg.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.grid_side = int(cfg.num_position_embeddings**0.5)
        theta = (cfg.rope_parameters or {}).get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.hidden_size // cfg.num_heads // 2, theta), persistent=False)
        self.blocks = nn.ModuleList([vision_block(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        self.deepstack_indexes = list(getattr(cfg, "deepstack_visual_indexes", None) or [])
        self.deepstack_merger_list = nn.ModuleList([PatchMerger(cfg, norm_after_merge=True)
                                                    for _ in self.deepstack_indexes])

    def position_embeddings(self, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """The learned square table, resampled (bilinear, corners aligned) to each grid,
        in merge-block order like the patches."""
        side, m = self.grid_side, self.merge
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1).unsqueeze(0)
        out = []
        for t, h, w in grid_thw:
            grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)[0]  # [C, h, w]
            grid = grid.permute(1, 2, 0).reshape(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4)
            out.append(grid.reshape(h * w, -1).repeat(t, 1))
        return torch.cat(out).to(self.pos_embed.weight.dtype)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        x = x + self.position_embeddings(grid_thw)
        cos, sin = vision_rotary_cos_sin(grid_thw, self.merge, self.inv_freq)
        frame_lens = [h * w for t, h, w in grid_thw for _ in range(t)]
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lens)
            if i in self.deepstack_indexes:
                levels.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](x))
        return torch.cat([self.merger(x), *levels], dim=-1) if levels else self.merger(x)


# ----------------------------------------------------------------------------- text
def decoder_layer(cfg, layer_id: int) -> PreNormDecoderLayer:
    # Qwen3's attention: RMSNorm over each head's q and k; dense, or experts (Qwen3-VL-MoE)
    return PreNormDecoderLayer(cfg, QKNormAttention(cfg, layer_id), feed_forward(cfg, layer_id))


class TextModel(MRoPEDecoder):
    def __init__(self, cfg) -> None:
        super().__init__(cfg, decoder_layer, RMSNorm, cfg.head_dim, default_section=[24, 20, 20], default_theta=5e6,
                         interleaved=True)


# ----------------------------------------------------------------------------- model
class Qwen3VLForConditionalGeneration(VisionLanguageModel):
    vision_cls = VisionTransformer
    decoder_cls = TextModel

    def merge_multimodal(self, embeds: torch.Tensor, token_index: torch.Tensor,
                         mm_embeds: torch.Tensor) -> DeepStackInputs | None:
        """The last level goes in as the tokens' embeddings; the DeepStack levels are
        added after the first decoder layers."""
        levels = mm_embeds.view(mm_embeds.shape[0], -1, embeds.shape[-1]).to(embeds.dtype)
        embeds.index_copy_(0, token_index, levels[:, 0])
        return DeepStackInputs(token_index, levels[:, 1:]) if levels.shape[1] > 1 else None

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[int, KVCacheSpec]:
        cfg = self.text_config
        return {i: FullAttentionSpec(block_size=block_size, num_kv_heads=self.kv_heads_per_rank(),
                                     head_size=cfg.head_dim, dtype=dtype) for i in range(cfg.num_hidden_layers)}

    @staticmethod
    def mrope_positions(config, token_ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
        # each frame group of a video is its own item (t = 1), its timestamp text between
        return mrope_positions(token_ids, features, config.vision_config.spatial_merge_size)
