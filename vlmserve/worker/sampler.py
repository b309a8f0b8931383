"""Turns logits into tokens. In vLLM's order: the grammar's bitmask; banned tokens
(min_tokens' stop tokens, bad words) and logit_bias; repetition, frequency and presence
penalties; then greedy, or temperature, min_p, top-k, top-p and a draw with per-request
seeds. Logprobs are the model's own, before any of it. Every step is one tensor op over
the batch; rows that do not use a setting pass through it unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlmserve.core.sched_output import LogprobsEntry
from vlmserve.kernels import ops
from vlmserve.structured_output.manager import GrammarBitmask
from vlmserve.worker.input_batch import CachedRequestState, InputBatch

NEG_INF = float("-inf")


@dataclass
class Penalties:
    """Repetition, frequency and presence penalties of the sampling rows, with the token
    histories they need."""

    repetition: torch.Tensor  # [rows]; 1 = off
    frequency: torch.Tensor  # [rows]; 0 = off
    presence: torch.Tensor  # [rows]; 0 = off
    output_counts: torch.Tensor  # [rows, vocab] float: occurrences among the generated tokens
    in_prompt: torch.Tensor  # [rows, vocab] bool


@dataclass
class SamplingBatch:
    """Per-row sampling settings of the rows that sample this step."""

    temperature: torch.Tensor  # [rows] float; 0 = greedy
    top_k: torch.Tensor  # [rows] long; 0 = off
    top_p: torch.Tensor  # [rows] float; 1 = off
    min_p: torch.Tensor  # [rows] float; 0 = off
    generators: list[torch.Generator | None]  # per row; None = the engine's generator
    num_logprobs: list[int | None]  # per row
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) set to -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, bias)
    penalties: Penalties | None = None
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, int32 bitmask of allowed tokens)

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())

    @property
    def has_logit_rules(self) -> bool:
        return any(rule is not None for rule in (self.grammar, self.banned, self.logit_bias, self.penalties))


def build_sampling_batch(batch: InputBatch, rows: list[int], vocab: int, grammar: GrammarBitmask | None,
                         eos_token_id: int | None, generator: torch.Generator) -> SamplingBatch:
    """The sampling settings of these batch rows as tensors over the rows (`generator`:
    the engine's, for rows without a seed of their own)."""
    states = [batch.states[r] for r in rows]
    params = [s.sampling_params for s in states]
    dev = generator.device
    sampling = SamplingBatch(
        temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=dev),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
        top_p=torch.tensor([p.top_p for p in params], device=dev),
        min_p=torch.tensor([p.min_p for p in params], device=dev),
        generators=[s.generator or generator for s in states],
        num_logprobs=[p.logprobs for p in params],
    )
    mask_index = {rid: i for i, rid in enumerate(grammar.req_ids)} if grammar is not None else {}
    banned = [(i, t) for i, (row, s) in enumerate(zip(rows, states))
              for t in _banned_tokens(batch, row, s, eos_token_id,
                                      grammar.bitmask[mask_index[s.req_id]] if s.req_id in mask_index else None)]
    if banned:
        sampling.banned = tuple(torch.tensor(list(x), dtype=torch.long, device=dev) for x in zip(*banned))
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
    if bias:
        i, t, b = zip(*bias)
        sampling.logit_bias = (torch.tensor(i, device=dev), torch.tensor(t, device=dev),
                               torch.tensor(b, dtype=torch.float32, device=dev))
    if any(p.has_penalties for p in params):
        sampling.penalties = _penalties(batch, rows, params, vocab, dev)
    pairs = [(i, mask_index[s.req_id]) for i, s in enumerate(states) if s.req_id in mask_index]
    if pairs:
        sample_rows, mask_rows = zip(*pairs)
        sampling.grammar = (torch.tensor(sample_rows, device=dev), grammar.bitmask[list(mask_rows)].to(dev))
    return sampling


def _banned_tokens(batch: InputBatch, row: int, state: CachedRequestState, eos_token_id: int | None,
                   grammar_mask: torch.Tensor | None) -> list[int]:
    """EOS and stop tokens while below min_tokens, unless the request's grammar admits
    nothing else (its answer is complete: the grammar wins); bad words: a one-token word
    always, a longer one's last token when the output ends with the rest of it, unless
    they are all the grammar admits (again the grammar wins)."""
    p = state.sampling_params
    banned = []
    if state.num_output_tokens < p.min_tokens:
        stops = ([] if eos_token_id is None or p.ignore_eos else [eos_token_id]) + p.stop_token_ids
        if grammar_mask is None or _allows_other_than(grammar_mask, stops):
            banned += stops
    n_prompt, n_tokens = state.num_prompt_tokens, int(batch.num_tokens[row])
    bad = []
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= n_tokens - n_prompt and (
                not prefix or batch.token_ids[row, n_tokens - len(prefix) : n_tokens].tolist() == prefix):
            bad.append(word[-1])
    if bad and grammar_mask is not None and not _allows_other_than(grammar_mask, banned + bad):
        return banned  # the grammar admits nothing but bad words here: the format asked for wins
    return banned + bad


def _allows_other_than(bitmask_row: torch.Tensor, token_ids: list[int]) -> bool:
    """Whether a grammar's bitmask row (int32 words) admits a token outside token_ids."""
    words = bitmask_row.cpu().numpy().view(np.uint32).copy()
    for t in token_ids:
        if t // 32 < len(words):
            words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return bool(words.any())


def _penalties(batch: InputBatch, rows: list[int], params: list, vocab: int, dev: torch.device) -> Penalties:
    rows_np = np.asarray(rows, dtype=np.int64)
    num_tokens = batch.num_tokens[rows_np]
    history = torch.from_numpy(batch.token_ids[rows_np, : int(num_tokens.max())]).to(dev)
    num_prompt = torch.tensor([batch.states[r].num_prompt_tokens for r in rows], device=dev)
    counts, in_prompt = token_histories(history, num_prompt, torch.from_numpy(num_tokens).to(dev), vocab)
    return Penalties(
        repetition=torch.tensor([p.repetition_penalty for p in params], device=dev),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=dev),
        presence=torch.tensor([p.presence_penalty for p in params], device=dev),
        output_counts=counts,
        in_prompt=in_prompt,
    )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[LogprobsEntry | None]]:
    wants_logprobs = any(n is not None for n in batch.num_logprobs)
    greedy = batch.all_greedy
    if wants_logprobs or batch.has_logit_rules or not greedy:
        logits = logits.float()
    # else greedy on the head's logits as they are: bf16 to fp32 is exact, so the argmax is
    # the same token, without an fp32 copy of [rows, vocab]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None  # the model's own
    logits = apply_logit_rules(logits, batch)
    tokens = ops.argmax_rows(logits) if greedy else _sample_random(logits, batch)

    token_list = tokens.tolist()
    entries: list[LogprobsEntry | None] = []
    for row, n in enumerate(batch.num_logprobs):
        entries.append(None if n is None else logprobs_entry(raw_logprobs[row], token_list[row], n))
    return token_list, entries


def apply_logit_rules(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Grammar, bans, logit_bias and penalties, in that order (in place where it can)."""
    if batch.grammar is not None:
        ops.apply_token_bitmask(logits, *batch.grammar)
    if batch.banned is not None:
        logits[batch.banned] = NEG_INF
    if batch.logit_bias is not None:
        rows, ids, bias = batch.logit_bias
        logits.index_put_((rows, ids), bias, accumulate=True)
    if batch.penalties is not None:
        logits = _apply_penalties(logits, batch.penalties)
    return logits


def _apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's (and transformers') semantics: a token seen in the prompt or the output has
    its logit divided by the repetition penalty if positive, multiplied if negative; then
    frequency * count and presence * (count > 0) are subtracted, over generated tokens."""
    seen = p.in_prompt | (p.output_counts > 0)
    rep = p.repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - p.frequency[:, None] * p.output_counts - p.presence[:, None] * (p.output_counts > 0)


def token_histories(token_ids: torch.Tensor, num_prompt: torch.Tensor, num_tokens: torch.Tensor,
                    vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's tokens so far ([rows, length], valid up to num_tokens, the first
    num_prompt of them the prompt): output-token counts [rows, vocab] and a prompt mask."""
    pos = torch.arange(token_ids.shape[1], device=token_ids.device)[None, :]
    is_prompt = pos < num_prompt[:, None]
    is_output = ~is_prompt & (pos < num_tokens[:, None])
    rows = token_ids.shape[0]
    counts = torch.zeros(rows, vocab + 1, device=token_ids.device)
    counts.scatter_add_(1, torch.where(is_output, token_ids, vocab), torch.ones_like(token_ids, dtype=counts.dtype))
    in_prompt = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=token_ids.device)
    in_prompt.scatter_(1, torch.where(is_prompt, token_ids, vocab), True)
    return counts[:, :vocab], in_prompt[:, :vocab]


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    greedy = batch.temperature == 0
    sampled = draw(target_probs(logits, batch), batch.generators)
    return torch.where(greedy, ops.argmax_rows(logits), sampled)


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row draws from: temperature, min_p, top-k, top-p (greedy
    rows get their temperature-1 distribution; they take the argmax instead)."""
    greedy = batch.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    # a temperature past fp32's range (3.4e38) reaches here as inf, and -inf / inf, a masked
    # logit, would be NaN: at fp32's largest, every allowed token is equally likely
    scaled = logits / temperature.clamp(max=torch.finfo(torch.float32).max)[:, None]
    if bool((batch.min_p > 0).any()):
        probs = torch.softmax(scaled, dim=-1)
        keep = probs >= batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(~keep, NEG_INF)
    scaled = _apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    return torch.softmax(scaled, dim=-1)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of (not necessarily normalized) probabilities. Exponential race:
    argmax(p / E) with E ~ Exp(1) draws from p; a request with a seed draws its noise
    from its own generator, so its tokens do not depend on the other requests."""
    noise = torch.empty_like(probs)
    for row, gen in enumerate(generators):
        noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


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
