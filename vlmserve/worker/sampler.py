"""Turns logits into tokens. In vLLM's order: the grammar's bitmask; banned tokens
(min_tokens' stop tokens, bad words) and logit_bias; repetition, frequency and presence
penalties; then greedy, or temperature, min_p, top-k, top-p and a draw: the inverse of
the CDF at one uniform per row, from the request's own generator when it has a seed.
Logprobs are the model's own, before any of it. Every step is a tensor op over the batch;
rows that do not use a setting pass through it unchanged. At real vocabularies (151,936
and 248,320 tokens) nothing costs more than a pass over [rows, vocab]: penalties touch the
tokens a row has seen, and top-k, top-p and min_p look among a row's most likely tokens
before they sort it whole."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from vlmserve.kernels import ops
from vlmserve.outputs import LogprobsEntry
from vlmserve.structured_output.manager import GrammarBitmask
from vlmserve.worker.input_batch import CachedRequestState, InputBatch

NEG_INF = float("-inf")


@dataclass
class Penalties:
    """Repetition, frequency and presence penalties of the sampling rows, over the tokens
    each row has seen: applied to those alone, not over [rows, vocab] (a history of
    thousands of tokens against a vocabulary of 151,936)."""

    repetition: torch.Tensor  # [rows]; 1 = off
    frequency: torch.Tensor  # [rows]; 0 = off
    presence: torch.Tensor  # [rows]; 0 = off
    seen: tuple[torch.Tensor, torch.Tensor]  # (rows, token ids), each pair once: in the prompt or the output
    generated: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, token ids, float counts): the output's


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
    # the rows that draw (temperature > 0), known on the host: sampling never reads the
    # device back to find them (None: work it out from temperature)
    random_rows: np.ndarray | None = None
    random_index: torch.Tensor | None = None  # ... and on the device

    @property
    def all_greedy(self) -> bool:
        if self.random_rows is not None:
            return self.random_rows.size == 0
        return bool((self.temperature == 0).all())

    @property
    def has_logit_rules(self) -> bool:
        return any(rule is not None for rule in (self.grammar, self.banned, self.logit_bias, self.penalties))


Upload = Callable[[str, np.ndarray], torch.Tensor]


def build_sampling_batch(batch: InputBatch, rows: np.ndarray | list[int], vocab: int, grammar: GrammarBitmask | None,
                         eos_token_id: int | None, generator: torch.Generator,
                         upload: Upload | None = None) -> SamplingBatch:
    """The sampling settings of these batch rows as tensors over the rows (`generator`:
    the engine's, for rows without a seed of their own), read from the batch's columns;
    only rows that do more than temperature, top-k, top-p and min_p are looked at one by
    one. `upload` puts host arrays on the device (the runner's staging: no copy that waits
    for the device)."""
    dev = generator.device
    upload = upload or (lambda name, array: torch.from_numpy(array).to(dev))
    rows = np.asarray(rows, dtype=np.int64)
    n = len(rows)
    temperature = batch.temperature[rows]
    sampling = SamplingBatch(
        temperature=upload("temperature", temperature),
        top_k=upload("top_k", batch.top_k[rows]),
        top_p=upload("top_p", batch.top_p[rows]),
        min_p=upload("min_p", batch.min_p[rows]),
        generators=[generator] * n,
        num_logprobs=[None] * n,
    )
    sampling.random_rows = np.flatnonzero(temperature > 0)
    sampling.random_index = upload("random_rows", sampling.random_rows)
    if batch.plain[rows].all() and grammar is None:
        return sampling  # the common step: nothing per row
    _add_special_rows(sampling, batch, rows.tolist(), vocab, grammar, eos_token_id, dev)
    return sampling


def _add_special_rows(sampling: SamplingBatch, batch: InputBatch, rows: list[int], vocab: int,
                      grammar: GrammarBitmask | None, eos_token_id: int | None, dev: torch.device) -> None:
    """Seeds, logprobs, banned tokens, logit bias, penalties and grammar masks."""
    states = [batch.states[r] for r in rows]
    params = [s.sampling_params for s in states]
    sampling.generators = [s.generator or g for s, g in zip(states, sampling.generators)]
    sampling.num_logprobs = [p.logprobs for p in params]
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


def _banned_tokens(batch: InputBatch, row: int, state: CachedRequestState, eos_token_id: int | None,
                   grammar_mask: torch.Tensor | None) -> list[int]:
    """EOS and stop tokens while below min_tokens, unless the request's grammar admits
    nothing else (its answer is complete: the grammar wins); bad words: a one-token word
    always, a longer one's last token when the output ends with the rest of it, unless
    they are all the grammar admits (again the grammar wins)."""
    p = state.sampling_params
    banned = []
    if batch.num_output[row] < p.min_tokens:
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
    seen, generated = token_histories(history, num_prompt, torch.from_numpy(num_tokens).to(dev), vocab)
    return Penalties(
        repetition=torch.tensor([p.repetition_penalty for p in params], device=dev),
        frequency=torch.tensor([p.frequency_penalty for p in params], device=dev),
        presence=torch.tensor([p.presence_penalty for p in params], device=dev),
        seen=seen,
        generated=generated,
    )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, list[LogprobsEntry | None]]:
    """A token per row, on the logits' device, and each row's logprobs entry where it asks
    for one (these need the tokens on the host: the only read-back)."""
    wants_logprobs = any(n is not None for n in batch.num_logprobs)
    greedy = batch.all_greedy
    if wants_logprobs or batch.has_logit_rules or not greedy:
        logits = logits.float()
    # else greedy on the head's logits as they are: bf16 to fp32 is exact, so the argmax is
    # the same token, without an fp32 copy of [rows, vocab]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None  # the model's own
    logits = apply_logit_rules(logits, batch)
    tokens = ops.argmax_rows(logits) if greedy else _sample_random(logits, batch)

    if not wants_logprobs:
        return tokens, [None] * len(batch.num_logprobs)
    token_list = tokens.tolist()
    entries: list[LogprobsEntry | None] = []
    for row, n in enumerate(batch.num_logprobs):
        entries.append(None if n is None else logprobs_entry(raw_logprobs[row], token_list[row], n))
    return tokens, entries


def apply_logit_rules(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Grammar, bans, logit_bias and penalties, in that order, in place."""
    if batch.grammar is not None:
        ops.apply_token_bitmask(logits, *batch.grammar)
    if batch.banned is not None:
        logits[batch.banned] = NEG_INF
    if batch.logit_bias is not None:
        rows, ids, bias = batch.logit_bias
        logits.index_put_((rows, ids), bias, accumulate=True)
    if batch.penalties is not None:
        _apply_penalties(logits, batch.penalties)
    return logits


def _apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """vLLM's (and transformers') semantics: a token seen in the prompt or the output has
    its logit divided by the repetition penalty if positive, multiplied if negative; then
    frequency * count and presence * (count > 0) are subtracted, over generated tokens."""
    rows, ids = p.seen
    seen, repetition = logits[rows, ids], p.repetition[rows]
    logits[rows, ids] = torch.where(seen > 0, seen / repetition, seen * repetition)
    rows, ids, counts = p.generated
    logits.index_put_((rows, ids), -(p.frequency[rows] * counts + p.presence[rows]), accumulate=True)


def token_histories(token_ids: torch.Tensor, num_prompt: torch.Tensor, num_tokens: torch.Tensor,
                    vocab: int) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                         tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """From each row's tokens so far ([rows, length], valid up to num_tokens, the first
    num_prompt of them the prompt): the (row, token) pairs seen anywhere, each once, and
    those generated with their counts."""
    pos = torch.arange(token_ids.shape[1], device=token_ids.device)[None, :]
    valid = (pos < num_tokens[:, None]) & (token_ids < vocab)  # an id past the logits would key another row
    output = valid & (pos >= num_prompt[:, None])
    keys = torch.arange(token_ids.shape[0], device=token_ids.device)[:, None] * vocab + token_ids
    seen = torch.unique(keys[valid])
    generated, counts = torch.unique(keys[output], return_counts=True)
    return (seen // vocab, seen % vocab), (generated // vocab, generated % vocab, counts.float())


# A row that truncates its distribution (top-k, top-p, min_p) looks for the tokens it keeps
# among its most likely ones first, then among more, and sorts its whole row only when
# they are not enough: over 32 rows of 151,936 logits torch's top-k takes 5 ms for 256 and
# 25 ms for 4,096, a sort 160-200 ms (AMD EPYC, 2 threads)
CANDIDATE_TIERS = (256, 4096)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.random_rows is not None:  # known on the host
        some_greedy, random = batch.random_rows.size < logits.shape[0], batch.random_rows.tolist()
        rows = batch.random_index
    else:
        greedy = batch.temperature == 0
        some_greedy, rows = bool(greedy.any()), (~greedy).nonzero().flatten()
        random = rows.tolist()
    tokens = ops.argmax_rows(logits) if some_greedy else torch.empty(
        logits.shape[0], dtype=torch.long, device=logits.device)
    if random:
        uniform = uniforms([batch.generators[r] for r in random], logits.device)
        tokens[rows] = draw_tokens(_scaled(_rows_of(logits, rows), batch.temperature[rows]), batch.top_k[rows],
                                   batch.top_p[rows], batch.min_p[rows], uniform)
    return tokens


def _rows_of(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """tensor[rows] for ascending rows; the tensor itself when they are all of its rows (no
    copy of [rows, vocab]: 19 MB at 32 rows of 151,936, a few ms)."""
    return tensor if rows.numel() == tensor.shape[0] else tensor[rows]


def _scaled(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    # a temperature past fp32's range (3.4e38) reaches here as inf, and -inf / inf, a masked
    # logit, would be NaN: at fp32's largest, every allowed token is equally likely
    return logits / temperature.clamp(max=torch.finfo(torch.float32).max)[:, None]


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row draws from, [rows, vocab]: temperature, min_p, top-k,
    top-p (greedy rows get their temperature-1 distribution; they take the argmax instead)."""
    temperature = torch.where(batch.temperature == 0, torch.ones_like(batch.temperature), batch.temperature)
    scaled = _scaled(logits, temperature)
    probs = torch.zeros_like(scaled)
    for rows, ids, row_probs in _truncations(scaled, batch.top_k, batch.top_p, batch.min_p):
        if ids is None:
            probs[rows] = row_probs
        else:
            probs[rows[:, None], ids] = row_probs
    return probs


def draw_tokens(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of temperature-scaled logits, from its truncated distribution, by
    the inverse of its CDF at the row's uniform in [0, 1)."""
    tokens = torch.empty(scaled.shape[0], dtype=torch.long, device=scaled.device)
    for rows, ids, probs in _truncations(scaled, top_k, top_p, min_p):
        drawn = inverse_cdf(probs, uniform[rows])
        tokens[rows] = drawn if ids is None else ids.gather(-1, drawn[:, None]).squeeze(-1)
    return tokens


def _truncations(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """Each row's distribution after min_p, top-k and top-p, by groups of rows: (rows, token
    ids, their probabilities) for the rows a tier of candidates holds whole (every token the
    row keeps is among them), then (rows, None, probabilities over the vocabulary) for the
    rest: rows that do not truncate, and rows that keep too many tokens for the tiers."""
    vocab = scaled.shape[-1]
    truncates = ((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0)
    pending = truncates.nonzero().flatten()
    for count in CANDIDATE_TIERS:
        if pending.numel() == 0 or count >= vocab:
            break
        ids, probs, served = _candidates(_rows_of(scaled, pending), top_k[pending], top_p[pending],
                                         min_p[pending], count)
        if bool(served.any()):
            yield pending[served], ids[served], probs[served]
        pending = pending[~served]
    for rows in ((~truncates).nonzero().flatten(), pending):
        if rows.numel():
            yield rows, None, _sorted_truncation(_rows_of(scaled, rows), top_k[rows], top_p[rows], min_p[rows])


def _candidates(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's `count` most likely tokens, their probabilities after min_p, top-k and
    top-p, and which rows they hold whole. min_p and top-k keep a prefix of the sorted
    candidates; if it ends inside them, no token past them is kept and top-p's distribution
    is the prefix's. If it is all of them (no top-k within `count`, min_p keeps them all),
    top-p's distribution is the whole row's, and the candidates hold the row only when
    top-p stops inside them (min_p then must be off)."""
    values, ids = scaled.topk(count, dim=-1)  # sorted, largest first
    ranks = torch.arange(count, device=scaled.device)[None, :]
    keep = values >= values[:, :1] + torch.log(min_p)[:, None]  # p >= min_p * p_max (log 0: keep all)
    keep &= (top_k[:, None] == 0) | (ranks < top_k[:, None])
    open_ended = keep[:, -1] & ((top_k == 0) | (top_k > count))  # tokens past the candidates may be kept
    masked = values.masked_fill(~keep, NEG_INF)
    norm = torch.logsumexp(masked, dim=-1)
    if bool(open_ended.any()):
        norm = torch.where(open_ended, torch.logsumexp(scaled, dim=-1), norm)
    probs = torch.exp(masked - norm[:, None])
    cumulative = probs.cumsum(dim=-1)
    # drop a token once the tokens before it already reach top_p (always keep one)
    probs = probs.masked_fill(cumulative - probs >= top_p[:, None], 0.0)
    probs /= probs.sum(dim=-1, keepdim=True)
    held = ~open_ended | ((top_k == 0) & (min_p == 0) & (cumulative[:, -1] >= top_p))
    return ids, probs, held


def _sorted_truncation(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor) -> torch.Tensor:
    """Each whole row's distribution after min_p, top-k and top-p, by a sort of the row."""
    if bool((min_p > 0).any()):
        probs = torch.softmax(scaled, dim=-1)
        keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        scaled = scaled.masked_fill(~keep, NEG_INF)
    return torch.softmax(_apply_top_k_top_p(scaled, top_k, top_p), dim=-1)


def inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the index drawn with probability weights / their sum (weights >= 0) at the
    row's uniform in [0, 1): the first index whose cumulative weight passes uniform * sum.
    A weight of zero is never drawn (capped below the sum, the target is always passed by
    a token that adds to it)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)


def uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row, from the row's generator: a request with a seed
    draws from its own, so its tokens do not depend on the other requests."""
    return torch.cat([torch.rand(1, generator=gen, device=device) for gen in generators])


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of (not necessarily normalized) probabilities."""
    return inverse_cdf(probs, uniforms(generators, probs.device))


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
