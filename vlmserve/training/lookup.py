"""Teaching the look-up: trained on answers alone, an earlier model never learned to find
the object a question names (with two objects it answered about either one, at chance,
after 2400 steps), so head 0 of the first two full-attention layers is told where to look
— at the object's cell, from the position that predicts the answer (batches.answer_labels
gives the targets)."""

from __future__ import annotations

import torch

LOOKUP_LAYERS = (1, 3)  # the first two full-attention layers; head 0 of each learns to find the object asked about


class LookupProbe:
    """Captures the attention probabilities of the chosen full-attention layers (eager
    attention returns them) for the look-up loss: head 0 is told where to look."""

    def __init__(self, model, layers: tuple[int, ...], visual_token_ids: tuple[int, ...]) -> None:
        self.maps: dict[int, torch.Tensor] = {}
        self.visual_token_ids = visual_token_ids
        for i in layers:
            attn = model.model.language_model.layers[i].self_attn
            attn.register_forward_hook(lambda _m, _a, out, i=i: self.maps.__setitem__(i, out[1]))

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lookup_loss(list(self.maps.values()), input_ids, targets, self.visual_token_ids)


def lookup_loss(maps: list[torch.Tensor], input_ids: torch.Tensor, targets: torch.Tensor,
                visual_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Mean over targets (row, query, visual token) and maps [B, heads, L, L] of -log(head
    0's attention mass from the query on that token. A row holds one picture or clip, so
    its n-th visual token is the picture's cell n, or the clip's slot n // 9, cell n % 9."""
    rows, queries, tokens = targets.unbind(1)
    is_visual = torch.isin(input_ids, torch.tensor(visual_token_ids))
    ordinal = torch.where(is_visual, is_visual.long().cumsum(1) - 1, -1)
    mask = (ordinal[rows] == tokens[:, None]).float()  # [targets, positions]
    losses = [-(m[rows, 0, queries] * mask).sum(-1).clamp(min=1e-6).log().mean() for m in maps]
    return torch.stack(losses).mean()
