"""The vision-tower parts the Qwen-VL families share: 2-D rotary angles of the patches,
attention within packed frames or windows, the 2x2 patch merger of Qwen2-VL/2.5-VL."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vlmserve.kernels import ops
from vlmserve.models.layers import Linear, RMSNorm


def vision_rotary_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(row, col) of every patch, patches ordered merge-block by merge-block: [patches, 2]."""
    out = []
    for t, h, w in grid_thw:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        rows = rows.permute(0, 2, 1, 3).reshape(-1)
        cols = cols.permute(0, 2, 1, 3).reshape(-1)
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def vision_rotary_cos_sin(grid_thw: list[tuple[int, int, int]], merge: int, inv_freq: torch.Tensor,
                          reorder: Callable[[torch.Tensor], torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D rotary angles of every patch: the row's frequencies, then the column's, twice. With
    `reorder`, in the patch order it gives the positions (a tower attending by windows):
    reordering the positions costs less than reordering the tables."""
    rc = vision_rotary_positions(grid_thw, merge).to(inv_freq.device)
    if reorder is not None:
        rc = reorder(rc)
    freqs = (rc[:, :, None].float() * inv_freq[None, None, :]).flatten(1)  # [n, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q = ops.apply_rotary(q, cos, sin).to(x.dtype)  # fp32 inside, rounded once
        k = ops.apply_rotary(k, cos, sin).to(x.dtype)
        out = ops.varlen_attention(q, k, v, seq_lens, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class PatchMerger(nn.Module):
    def __init__(self, out_dim: int, context_dim: int, merge: int, norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.hidden = context_dim * merge * merge
        self.ln_q = norm(context_dim, 1e-6)
        self.mlp = nn.Sequential(Linear(self.hidden, self.hidden), nn.GELU(), Linear(self.hidden, out_dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class VisionBlock(nn.Module):
    """norm -> attention -> residual, norm -> MLP -> residual; each family gives its own
    norms and MLP (the module names are the checkpoint's)."""

    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: VisionAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seq_lens)
        return x + self.mlp(self.norm2(x))
