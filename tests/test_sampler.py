import contextlib
import dataclasses

import torch

from vlmserve.worker.sampler import SamplingBatch, sample


def batch(rows, temperature=1.0, top_k=0, top_p=1.0, gens=None, banned=None, logprobs=None, min_p=0.0):
    pairs = [(r, t) for r, ids in enumerate(banned or []) for t in ids]
    return SamplingBatch(
        temperature=torch.full((rows,), float(temperature)),
        top_k=torch.full((rows,), top_k, dtype=torch.long),
        top_p=torch.full((rows,), float(top_p)),
        min_p=torch.full((rows,), float(min_p)),
        generators=gens or [torch.Generator().manual_seed(i) for i in range(rows)],
        num_logprobs=logprobs or [None] * rows,
        banned=tuple(torch.tensor(x) for x in zip(*pairs)) if pairs else None,
    )


LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05]))


def frequencies(b, n=4000):
    tokens, _ = sample(LOGITS.repeat(n, 1), b)
    return torch.bincount(tokens, minlength=5).float() / n


def test_greedy_and_banned_tokens():
    tokens, _ = sample(LOGITS.repeat(2, 1), batch(2, temperature=0, banned=[[], [0]]))
    assert tokens.tolist() == [0, 1]


def test_plain_sampling_follows_the_distribution():
    gen = torch.Generator().manual_seed(0)
    freq = frequencies(batch(4000, gens=[gen] * 4000))
    assert torch.allclose(freq, LOGITS.exp(), atol=0.03)


def test_min_p_drops_tokens_below_its_share_of_the_top():
    gen = torch.Generator().manual_seed(2)
    # min_p 0.25: tokens under 0.25 * 0.5 = 0.125 go (2, 3, 4); 0 and 1 keep their ratio
    freq = frequencies(batch(4000, min_p=0.25, gens=[gen] * 4000))
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.5 / 0.8) < 0.03


def test_top_k_and_top_p_filter():
    gen = torch.Generator().manual_seed(1)
    freq = frequencies(batch(4000, top_k=2, gens=[gen] * 4000))
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.5 / 0.8) < 0.03
    # top_p 0.7: tokens 0 (0.5) and 1 (0.3) are kept — 0.5 alone is not yet 0.7
    freq = frequencies(batch(4000, top_p=0.7, gens=[gen] * 4000))
    assert freq[2:].sum() == 0 and freq[1] > 0.3
    freq = frequencies(batch(4000, top_p=0.4, gens=[gen] * 4000))
    assert freq[0] == 1.0


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, 100)
    alone, _ = sample(logits[1:2].clone(), batch(1, gens=[torch.Generator().manual_seed(42)]))
    together, _ = sample(logits.clone(), batch(3, gens=[torch.Generator().manual_seed(s) for s in (1, 42, 3)]))
    assert together[1] == alone[0]  # (tokens stay on the logits' device, as tensors)


def test_logprobs_entries():
    _, entries = sample(LOGITS.repeat(2, 1), batch(2, temperature=0, logprobs=[2, None]))
    assert entries[1] is None
    e = entries[0]
    assert e.token_ids == [0, 0, 1] and e.rank == 1
    assert abs(e.logprobs[0] - LOGITS[0].item()) < 1e-6


def test_temperature_sharpens_or_flattens_the_distribution():
    for temperature in (0.5, 2.0):
        gen = torch.Generator().manual_seed(3)
        freq = frequencies(batch(4000, temperature=temperature, gens=[gen] * 4000))
        assert torch.allclose(freq, torch.softmax(LOGITS / temperature, dim=-1), atol=0.03), temperature


def test_a_temperature_past_fp32s_range_draws_uniformly_among_the_allowed_tokens():
    """3.4028235677973366e38 is a finite Python float that rounds to inf in fp32 (a fuzzed
    request with a one-choice grammar got token 0, which its mask forbade: -inf / inf)."""
    logits = LOGITS.repeat(4000, 1)
    logits[:, 0] = float("-inf")  # masked, as the grammar's bitmask does
    b = batch(4000, gens=[torch.Generator().manual_seed(5)] * 4000)
    b = dataclasses.replace(b, temperature=torch.tensor([3.4028235677973366e38] * 4000))  # as the engine builds it
    assert torch.isinf(b.temperature).all()
    freq = frequencies_of(logits, b)
    assert freq[0] == 0
    assert torch.allclose(freq[1:], torch.full((4,), 0.25), atol=0.03)


def frequencies_of(logits, b):
    tokens, _ = sample(logits, b)
    return torch.bincount(tokens, minlength=logits.shape[1]).float() / logits.shape[0]


def test_greedy_reads_bf16_logits_as_they_are_and_picks_the_fp32_token():
    """Greedy rows without logprobs or logit rules take the argmax of the head's bf16
    logits (no fp32 copy); with a rule or logprobs, the fp32 path: the same tokens both ways,
    under the CPU kernels and the portable ones."""
    from vlmserve.kernels import kernel_table, use_kernels

    torch.manual_seed(0)
    logits = torch.randn(5, 1000).to(torch.bfloat16)
    logits[2, [10, 700]] = 9.0  # a tie: the first
    want = logits.float().argmax(dim=-1).tolist()
    for table in (kernel_table("cpu"), None):
        with use_kernels(table) if table else contextlib.nullcontext():
            assert sample(logits, batch(5, temperature=0))[0].tolist() == want
            tokens, entries = sample(logits, batch(5, temperature=0, logprobs=[1] * 5))
            assert tokens.tolist() == want and all(e is not None for e in entries)
            banned = batch(5, temperature=0, banned=[[], [], [10], [], []])
            assert sample(logits, banned)[0].tolist() == want[:2] + [700] + want[3:]
    assert logits.dtype == torch.bfloat16 and logits[2, 10] == 9.0  # the caller's logits untouched


def test_every_way_a_truncating_row_is_served_gives_its_whole_distribution():
    """A row that truncates (top-k, top-p, min_p) is served by the first tier of candidates,
    the second or its whole sorted row, by how many tokens it keeps; each way gives the
    distribution of the sorted row (target_probs, which verifies drafts) and draws from it:
    with uniforms on a grid of n points, each token comes up within one draw of n times its
    probability, and a token the row drops never does."""
    from vlmserve.worker.sampler import CANDIDATE_TIERS, _sorted_truncation, draw_tokens, target_probs

    vocab, n = 6000, 2000
    assert CANDIDATE_TIERS[-1] < vocab
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(vocab, generator=g)
    peaked[torch.randperm(vocab, generator=g)[:8]] += 12.0
    medium = torch.randn(vocab, generator=g)
    flat = torch.randn(vocab, generator=g) * 0.1
    masked = peaked.clone()
    masked[peaked.topk(3).indices[1:]] = float("-inf")  # a grammar's mask over likely tokens
    masked[torch.randperm(vocab, generator=g)[:2000]] = float("-inf")
    # min_p keeps every first-tier candidate (the 4 near 10, the 300 just under 0) and drops
    # the rest, so top-p's distribution is not the whole row's (distinct values: which of
    # tied tokens a cut keeps is arbitrary)
    tiered = torch.cat([10.0 - torch.arange(4) * 1e-3, -torch.arange(300) * 1e-3, -3.0 - torch.arange(2000) * 1e-6,
                        -6.0 - torch.arange(vocab - 2304) * 1e-6])
    tiered = tiered[torch.randperm(vocab, generator=g)]
    medium_masked = medium.clone()
    medium_masked[0] = float("-inf")  # the first token, where a uniform of 0 lands unless it is skipped
    first, second = CANDIDATE_TIERS
    cases = [  # logits, settings, the range the number of kept tokens must fall in
        (peaked, {"top_k": 20, "top_p": 0.8}, (1, first)),
        (peaked, {"top_p": 0.99}, (1, first)),
        (peaked, {"min_p": 1e-4}, (1, first)),
        (masked, {"top_p": 0.95, "min_p": 0.01}, (1, first)),
        (medium, {"top_p": 0.5}, (first + 1, second)),
        (medium, {"top_k": 300}, (first + 1, second)),
        (medium, {"top_k": 5000, "top_p": 0.99}, (second + 1, vocab)),
        (flat, {"top_p": 0.9}, (second + 1, vocab)),
        (flat, {"min_p": 0.5}, (second + 1, vocab)),
        (tiered, {"min_p": 3.4e-5, "top_p": 0.998}, (83, 83)),
        (medium_masked, {}, (vocab - 1, vocab - 1)),  # temperature alone
    ]
    uniform = torch.arange(n) / n
    for logits, settings, (low, high) in cases:
        top_k, top_p, min_p = (torch.full((n,), settings.get(name, default), dtype=dtype)
                               for name, default, dtype in (("top_k", 0, torch.long), ("top_p", 1.0, torch.float32),
                                                            ("min_p", 0.0, torch.float32)))
        want = _sorted_truncation(logits[None], top_k[:1], top_p[:1], min_p[:1])[0]
        assert low <= int((want > 0).sum()) <= high, settings
        one_row = SamplingBatch(temperature=torch.ones(1), top_k=top_k[:1], top_p=top_p[:1], min_p=min_p[:1],
                                generators=[None], num_logprobs=[None])
        torch.testing.assert_close(target_probs(logits[None], one_row)[0], want, rtol=1e-5, atol=1e-7, msg=str(settings))
        tokens = draw_tokens(logits.repeat(n, 1), top_k, top_p, min_p, uniform)
        freq = torch.bincount(tokens, minlength=vocab).double() / n
        assert freq[want == 0].sum() == 0, settings
        assert (freq - want.double()).abs().max() <= 1.0 / n + 1e-5, settings


def test_a_token_id_past_the_logits_is_left_out_of_the_penalties():
    """Row 0's id 7 is past a 5-token vocabulary: keyed as row * vocab + id it would
    land on row 1's token 2; it penalizes nothing instead."""
    from vlmserve.worker.sampler import token_histories

    (seen_rows, seen_ids), (out_rows, out_ids, counts) = token_histories(
        torch.tensor([[3, 7], [1, 2]]), torch.tensor([1, 1]), torch.tensor([2, 2]), vocab=5)
    assert list(zip(seen_rows.tolist(), seen_ids.tolist())) == [(0, 3), (1, 1), (1, 2)]
    assert list(zip(out_rows.tolist(), out_ids.tolist(), counts.tolist())) == [(1, 2, 1.0)]
