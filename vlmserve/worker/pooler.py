"""Embedding and reranking requests: their prompt's hidden states pooled into one vector
(LAST, MEAN or CLS, across prompt chunks), or a reranker's relevance score."""

from __future__ import annotations

import numpy as np
import torch

from vlmserve.pooling_params import PoolingParams
from vlmserve.worker.prepared_step import PreparedStep


def pool(model: torch.nn.Module, p: PreparedStep, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    """Embedding requests: this step's hidden states of each one's prompt go into its
    pooled vector (across prompt chunks); the vectors of those whose prompt is done."""
    pooled: dict[str, torch.Tensor] = {}
    step = p.step
    starts = np.cumsum(step.query_lens) - step.query_lens if p.pooling else None
    for i, state in p.pooling:
        params, c, q, token_start = state.pooling_params, step.num_computed[i], step.query_lens[i], int(starts[i])
        rid = step.req_ids[i]
        rows = hidden[token_start : token_start + q].float()
        if params.pooling_type == "MEAN":
            total = rows.sum(0)
            state.pooled_sum = total if state.pooled_sum is None else state.pooled_sum + total
        elif params.pooling_type == "CLS" and c == 0:
            state.pooled_first = rows[0]
        if c + q >= state.num_prompt_tokens and params.score_token_ids:
            pooled[rid] = _relevance(model, hidden[token_start + q - 1], params).cpu()
        elif c + q >= state.num_prompt_tokens:
            vector = {"MEAN": lambda: state.pooled_sum / state.num_prompt_tokens,
                      "CLS": lambda: state.pooled_first, "LAST": lambda: rows[-1]}[params.pooling_type]()
            vector = vector[: params.dimensions]  # Matryoshka: the first dimensions
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=-1)
            pooled[rid] = vector.cpu()
    return pooled

def _relevance(model: torch.nn.Module, last_hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """A reranker's score, [1]: the "yes" logit minus the "no" logit at the prompt's last
    token (vLLM's from_2_way_softmax), through a sigmoid if asked (= P(yes) of the two)."""
    no, yes = model.compute_logits(last_hidden[None])[0, list(params.score_token_ids)].float()
    score = (yes - no)[None]
    return torch.sigmoid(score) if params.normalize else score
