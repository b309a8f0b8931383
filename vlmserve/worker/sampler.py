"""Turns logits into tokens: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmserve.core.sched_output import LogprobsEntry

NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """Per-row sampling settings of the rows that sample this step."""

    temperature: torch.Tensor  # [rows] float; 0 = greedy
    top_k: torch.Tensor  # [rows] long; 0 = off
    top_p: torch.Tensor  # [rows] float; 1 = off
    generators: list[torch.Generator | None]  # per row; None = the engine's generator
    banned_token_ids: list[list[int]]  # per row: EOS/stop ids while below min_tokens
    num_logprobs: list[int | None]  # per row

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[LogprobsEntry | None]]:
    logits = logits.float()
    raw_logprobs = None
    if any(n is not None for n in batch.num_logprobs):
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # of the model, before any filtering
    for row, banned in enumerate(batch.banned_token_ids):
        if banned:
            logits[row, banned] = NEG_INF

    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = _sample_random(logits, batch)

    token_list = tokens.tolist()
    entries: list[LogprobsEntry | None] = []
    for row, n in enumerate(batch.num_logprobs):
        entries.append(None if n is None else logprobs_entry(raw_logprobs[row], token_list[row], n))
    return token_list, entries


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    greedy = batch.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature[:, None]
    scaled = _apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    probs = torch.softmax(scaled, dim=-1)
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p; a request with a
    # seed draws its noise from its own generator, so its tokens do not depend on the
    # other requests in the batch
    noise = torch.empty_like(probs)
    for row, gen in enumerate(batch.generators):
        noise[row].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1).any())
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        remove |= ranks >= k[:, None]
    if use_p:
        probs = torch.softmax(sorted_logits.masked_fill(remove, NEG_INF), dim=-1)
        # drop a token once the tokens before it already reach top_p (always keep one)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def logprobs_entry(logprobs: torch.Tensor, token_id: int, num_top: int) -> LogprobsEntry:
    """The chosen token's logprob and rank, then the num_top most likely (-1: all)."""
    chosen = float(logprobs[token_id])
    rank = int((logprobs > chosen).sum()) + 1
    k = logprobs.shape[-1] if num_top < 0 else num_top
    top_values, top_ids = logprobs.topk(k) if k else (logprobs[:0], torch.zeros(0, dtype=torch.long))
    return LogprobsEntry(
        token_ids=[token_id] + top_ids.tolist(),
        logprobs=[chosen] + top_values.tolist(),
        rank=rank,
    )
