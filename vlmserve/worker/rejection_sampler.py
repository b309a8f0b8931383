"""Verifies draft tokens: one forward of the target model gives logits after each prefix
of a request's drafts; the drafts the target would have produced are kept, and one more
token comes from the target (where the first draft was refused, or after the last).

Greedy requests keep exactly the drafts equal to the argmax. Sampled requests use
rejection sampling, which leaves the target distribution unchanged: the drafts are
deterministic (q is one-hot), so draft x at a position is kept with probability p(x);
at the first refusal the token is drawn from p with x removed (max(p - q, 0),
renormalized); when every draft is kept, a bonus token is drawn from the last p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlmserve.kernels import ops
from vlmserve.outputs import LogprobsEntry
from vlmserve.sampling_params import SamplingParams
from vlmserve.worker.sampler import SamplingBatch, apply_logit_rules, draw, logprobs_entry, target_probs


def can_verify(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's drafts can be checked in one pass: the processed logits at a
    draft position may depend on that position's logits only. A grammar, penalties and
    bad words depend on the tokens before it (drafts included), min_tokens' bans on how
    many there are; such requests decode one token at a time."""
    return (params.structured_outputs is None and params.thinking_token_budget is None and not params.has_penalties
            and not params.bad_words_token_ids and num_output_tokens >= params.min_tokens)


@dataclass
class Verified:
    token_ids: list[list[int]]  # per request: its kept drafts, then the target's token
    logprobs: list[list[LogprobsEntry]]  # per request and token (empty if not asked for)


def verify(logits: torch.Tensor, drafts: list[list[int]], batch: SamplingBatch) -> Verified:
    """logits: for request i, len(drafts[i]) + 1 consecutive rows (after its last
    token, then after each of its drafts); batch: the sampling settings of each row."""
    logits = logits.float()
    starts = np.cumsum([0] + [len(d) + 1 for d in drafts[:-1]]).tolist()
    raw_logprobs = None
    if any(n is not None for n in batch.num_logprobs):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    logits = apply_logit_rules(logits, batch)
    greedy = batch.temperature == 0
    argmax = ops.argmax_rows(logits)
    dev = logits.device
    draft_rows = torch.tensor([s + j for s, d in zip(starts, drafts) for j in range(len(d))], dtype=torch.long,
                              device=dev)
    draft_ids = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=dev)
    probs = None if batch.all_greedy else target_probs(logits, batch)
    if probs is None:
        kept = argmax[draft_rows] == draft_ids
    else:
        uniform = torch.cat([torch.rand(len(d), generator=batch.generators[s], device=dev)
                             for s, d in zip(starts, drafts)])
        kept = torch.where(greedy[draft_rows], argmax[draft_rows] == draft_ids,
                           uniform < probs[draft_rows, draft_ids])
    kept_list = kept.tolist()

    num_kept, last_rows, offset = [], [], 0
    for s, d in zip(starts, drafts):
        flags = kept_list[offset : offset + len(d)]
        a = flags.index(False) if False in flags else len(d)
        num_kept.append(a)
        last_rows.append(s + a)
        offset += len(d)
    last = torch.tensor(last_rows, dtype=torch.long, device=dev)
    tokens = argmax[last]
    if probs is not None:
        residual = probs[last]
        refused = [(i, d[a]) for i, (d, a) in enumerate(zip(drafts, num_kept)) if a < len(d)]
        if refused:
            rows, ids = (torch.tensor(x, dtype=torch.long, device=dev) for x in zip(*refused))
            residual[rows, ids] = 0.0
            # rounding can leave nothing: then the refused token was all of p, draw from p
            empty = residual.sum(dim=-1) == 0
            residual = torch.where(empty[:, None], probs[last], residual)
        drawn = draw(residual, [batch.generators[r] for r in last_rows])
        tokens = torch.where(greedy[last], tokens, drawn)

    out_tokens, out_logprobs = [], []
    for i, (s, d, a, token) in enumerate(zip(starts, drafts, num_kept, tokens.tolist())):
        emitted = d[:a] + [token]
        out_tokens.append(emitted)
        n = batch.num_logprobs[s]
        out_logprobs.append([] if n is None else
                            [logprobs_entry(raw_logprobs[s + j], t, n) for j, t in enumerate(emitted)])
    return Verified(out_tokens, out_logprobs)
