"""Qwen2-VL: the language model of Qwen2.5-VL (M-RoPE, q/k/v bias) under a plainer vision
tower — LayerNorm, a GELU MLP (fc1/fc2), attention over each whole frame (no windows) —
and M-RoPE that counts a video's time axis in grid steps, not seconds.

Module names follow the HF checkpoint (`model.visual.*`, `model.language_model.*`,
`lm_head`), except that q/k/v and gate/up projections are fused at load time.
"""

from __future__ import annotations

import torch
from torch import nn

from vlmserve.models.layers import ACTIVATIONS, Linear, mrope_positions, rope_inv_freq
from vlmserve.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from vlmserve.models.vision import PatchMerger, VisionAttention, VisionBlock, vision_rotary_cos_sin
from vlmserve.multimodal.inputs import MultiModalFeature


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = Linear(dim, hidden)
        self.fc2 = Linear(hidden, dim)
        self.act = ACTIVATIONS[act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def vision_block(cfg) -> VisionBlock:
    return VisionBlock(nn.LayerNorm(cfg.embed_dim, eps=1e-6), nn.LayerNorm(cfg.embed_dim, eps=1e-6),
                       VisionAttention(cfg.embed_dim, cfg.num_heads),
                       VisionMLP(cfg.embed_dim, int(cfg.embed_dim * cfg.mlp_ratio), cfg.hidden_act))


class VisionTransformer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        # a Conv3d whose kernel equals its stride is a matmul over flattened patches
        self.patch_embed = Linear(patch_dim, cfg.embed_dim, bias=False)
        theta = (cfg.rope_parameters or {}).get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.embed_dim // cfg.num_heads // 2, theta), persistent=False)
        self.blocks = nn.ModuleList([vision_block(cfg) for _ in range(cfg.depth)])
        # the vision config's hidden_size is the language model's width: the merger's output
        self.merger = PatchMerger(cfg.hidden_size, cfg.embed_dim, self.merge, norm=nn.LayerNorm)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        cos, sin = vision_rotary_cos_sin(grid_thw, self.merge, self.inv_freq)
        frame_lens = [h * w for t, h, w in grid_thw for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, frame_lens)
        return self.merger(x)


class Qwen2VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    vision_cls = VisionTransformer

    @staticmethod
    def mrope_positions(config, token_ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
        return mrope_positions(token_ids, features, config.vision_config.spatial_merge_size, video_time_scale=None)
