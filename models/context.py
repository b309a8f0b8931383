"""What one forward pass of a language model needs besides its inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vlmserve.kernels.attention import AttentionMetadata


@dataclass
class DeepStackInputs:
    """Vision features added into the first decoder layers' outputs (Qwen3-VL's DeepStack):
    after layer i, features[:, i] is added at the tokens token_index."""

    token_index: torch.Tensor  # [n] positions in this step's tokens
    features: torch.Tensor  # [n, levels, hidden]


@dataclass
class ForwardContext:
    """Per-layer views the runner prepares for one step.

    kv_caches[layer]: (keys, values) tensors of the layer's KV cache group;
    attn_metadata[layer]: the metadata of that group (shared by its layers);
    layer_state[layer]: model-specific per-layer step data (e.g. recurrent-state slots);
    deepstack: the pictures' features for the first layers, when the family has them and
    the step has picture tokens;
    output_rows: the rows of the step's tokens whose final hidden state is read (sampled or
    checked drafts), in order; the forward returns those rows only, and runs the last
    layer's feed-forward on them alone. None: every row.
    """

    kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]
    attn_metadata: dict[int, AttentionMetadata]
    layer_state: dict[int, Any] = field(default_factory=dict)
    deepstack: DeepStackInputs | None = None
    output_rows: torch.Tensor | None = None
