"""Qwen2.5-VL: vision tower with window attention, 2-D
rotary and patch merger; language model with M-RoPE and full/sliding-window layers.

Module names follow the HF checkpoint (`model.visual.*`, `model.language_model.*`,
`lm_head`), except that q/k/v and gate/up projections are fused at load time.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from vlmserve.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from vlmserve.models.base import MRoPEDecoder, VisionLanguageModel
from vlmserve.models.layers import (GatedMLP, Linear, PagedAttention, PreNormDecoderLayer, RMSNorm, mrope_positions,
                                    rope_inv_freq)
from vlmserve.models.vision import PatchMerger, VisionAttention, VisionBlock, vision_rotary_cos_sin
from vlmserve.multimodal.inputs import MultiModalFeature


# ----------------------------------------------------------------------------- vision
def vision_windows(
    grid_thw: list[tuple[int, int, int]], merge: int, window_units: int
) -> tuple[torch.Tensor, list[int]]:
    """Reorders merged patch units window by window (window_units x window_units each,
    clipped at the edges) and gives the window lengths in patches."""
    order, lengths, base = [], [], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        for frame in range(t):
            for r in range(0, gh, window_units):
                for c in range(0, gw, window_units):
                    cell = index[frame, r : r + window_units, c : c + window_units].reshape(-1)
                    order.append(cell + base)
                    lengths.append(cell.size * merge * merge)
        base += t * gh * gw
    return torch.from_numpy(np.concatenate(order)), lengths


def vision_block(cfg) -> VisionBlock:
    return VisionBlock(RMSNorm(cfg.hidden_size, 1e-6), RMSNorm(cfg.hidden_size, 1e-6),
                       VisionAttention(cfg.hidden_size, cfg.num_heads),
                       GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, bias=True))


class VisionTransformer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.window_units = cfg.window_size // self.merge // cfg.patch_size
        self.full_blocks = set(cfg.fullatt_block_indexes)
        patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        # a Conv3d whose kernel equals its stride is a matmul over flattened patches
        self.patch_embed = Linear(patch_dim, cfg.hidden_size, bias=False)
        head_dim = cfg.hidden_size // cfg.num_heads
        theta = (cfg.rope_parameters or {}).get("rope_theta", 10000.0)
        self.register_buffer("inv_freq", rope_inv_freq(head_dim // 2, theta), persistent=False)
        self.blocks = nn.ModuleList([vision_block(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg.out_hidden_size, cfg.hidden_size, self.merge)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        unit = self.merge * self.merge
        frame_lens = [h * w for t, h, w in grid_thw for _ in range(t)]
        order, window_lens = vision_windows(grid_thw, self.merge, self.window_units)
        order = order.to(x.device)

        def by_window(y: torch.Tensor) -> torch.Tensor:
            return y.view(-1, unit, y.shape[-1])[order].reshape(-1, y.shape[-1])

        x = by_window(x)
        cos, sin = vision_rotary_cos_sin(grid_thw, self.merge, self.inv_freq, reorder=by_window)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frame_lens if i in self.full_blocks else window_lens)
        return self.merger(x)[torch.argsort(order)]


# ----------------------------------------------------------------------------- text
def decoder_layer(cfg, layer_id: int) -> PreNormDecoderLayer:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = PagedAttention(layer_id, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim,
                          qkv_bias=True)
    return PreNormDecoderLayer(cfg, attn, GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act))


class TextModel(MRoPEDecoder):
    def __init__(self, cfg) -> None:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        super().__init__(cfg, decoder_layer, RMSNorm, head_dim, default_section=[16, 24, 24], default_theta=1e6)


# ----------------------------------------------------------------------------- model
class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):
    vision_cls = VisionTransformer
    decoder_cls = TextModel

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> dict[int, KVCacheSpec]:
        cfg = self.text_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        specs: dict[int, KVCacheSpec] = {}
        for i, kind in enumerate(layer_types):
            common = dict(block_size=block_size, num_kv_heads=self.kv_heads_per_rank(), head_size=head_dim, dtype=dtype)
            if kind == "sliding_attention" and cfg.sliding_window:
                specs[i] = SlidingWindowSpec(**common, sliding_window=cfg.sliding_window)
            else:
                specs[i] = FullAttentionSpec(**common)
        return specs

    # -- positions -------------------------------------------------------------------
    @staticmethod
    def mrope_positions(config, token_ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
        vision = config.vision_config
        return mrope_positions(token_ids, features, vision.spatial_merge_size, getattr(vision, "tokens_per_second", 1))
