"""Speculative decoding: the n-gram proposer, the verification (greedy exact, rejection
sampling that keeps the target distribution), and the engine with it on: transformers'
greedy tokens and logprobs in every scheduling situation, nothing left behind."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from test_qwen2_5_vl_parity import IMG_A, CASES, assert_all_free, check, greedy, mixed_requests, request, run_together
from vlmserve import LLM, SamplingParams
from vlmserve.config import SpeculativeConfig
from vlmserve.errors import ConfigError
from vlmserve.sampling_params import StructuredOutputsParams
from vlmserve.spec_decode.ngram_proposer import NgramProposer
from vlmserve.worker.proposer import Proposer, token_history
from vlmserve.worker.rejection_sampler import verify
from vlmserve.worker.sampler import SamplingBatch

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails
# one run in a thousand (the seeds are fixed, so a run is reproducible)
CHI2_999 = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}


# ----------------------------------------------------------------------------- proposer
def propose(tokens, **settings):
    config = SpeculativeConfig(**{"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                  **settings})
    return NgramProposer(config).lookup(np.asarray(tokens, dtype=np.int64))


def test_the_proposer_copies_what_followed_the_latest_longest_match():
    # ends with 7 8 9: that trigram occurred at 0 (then 1 2 3) and at 6 (then 4 5 6)
    assert propose([7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 7, 8, 9]) == [4, 5, 6]
    # the longest n-gram wins over a later shorter one: "2 3" occurred after 1 once (then 4),
    # "3" alone later (then 9)
    assert propose([1, 2, 3, 4, 0, 3, 9, 0, 1, 2, 3]) == [4, 0, 3]
    assert propose([5, 6, 7, 5], num_speculative_tokens=5) == [6, 7, 5]  # up to the end
    assert propose([1, 2, 3, 4]) == []  # no earlier occurrence
    assert propose([1, 2, 3, 1, 2], prompt_lookup_min=3) == []  # only n-grams of 3 or more count
    assert propose([4]) == []


def test_speculative_settings_are_checked():
    assert SpeculativeConfig.from_dict({}) is None
    for bad, why in (({"method": "eagle"}, "not supported"), ({"num_speculative_tokens": 0}, "positive"),
                     ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must not exceed"),
                     ({"disable_by_batch_size": 0}, "disable_by_batch_size must be a positive integer"),
                     ({"tokens": 3}, "unknown setting")):
        with pytest.raises(ValueError, match=why):
            SpeculativeConfig.from_dict(bad)


# ----------------------------------------------------------------------------- verification
def batch_of(rows: int, temperature: float, seed: int = 0, top_k: int = 0) -> SamplingBatch:
    gen = torch.Generator().manual_seed(seed)
    return SamplingBatch(temperature=torch.full((rows,), temperature), top_k=torch.full((rows,), top_k),
                         top_p=torch.ones(rows), min_p=torch.zeros(rows), generators=[gen] * rows,
                         num_logprobs=[None] * rows)


def test_greedy_verification_keeps_the_drafts_equal_to_the_argmax():
    logits = torch.full((7, 6), -1.0)
    for row, token in enumerate([2, 3, 1, 5, 4, 0, 1]):
        logits[row, token] = 1.0
    # request 0: drafts 2 3 right, 4 wrong (argmax 1): 2 3 then 1; request 1 (rows 4-6):
    # drafts 4 0 right: 4 0 then the bonus 1
    out = verify(logits, [[2, 3, 4], [4, 0]], batch_of(7, 0.0))
    assert out.token_ids == [[2, 3, 1], [4, 0, 1]]


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    """Many requests with two drafts each, from fixed target distributions p0, p1, p2
    (temperature and top-k applied): the first token is distributed as p0 whatever the
    drafts, the second (when the first draft was kept) as p1, the third (both kept) as p2;
    a draft is kept with the probability the target gives it."""
    vocab, n = 8, 8000
    torch.manual_seed(0)
    targets = torch.randn(3, vocab)
    probs = torch.softmax(targets / 0.8, dim=-1)
    top = probs.topk(6, dim=-1).indices
    p = torch.zeros_like(probs).scatter(1, top, probs.gather(1, top))
    p = (p / p.sum(dim=-1, keepdim=True)).numpy()
    likely = [int(top[0, 0]), int(top[1, 0])]
    unlikely = [int(top[0, 3]), int(top[1, 1])]
    drafts = [likely if i % 2 else unlikely for i in range(n)]
    out = verify(targets.repeat(n, 1), drafts, batch_of(3 * n, 0.8, seed=1, top_k=6))
    for pair in (likely, unlikely):
        got = [t for d, t in zip(drafts, out.token_ids) if d == pair]
        for position in range(3):
            # the token at `position`, among samples whose drafts before it were all kept
            tokens = [t[position] for t in got if len(t) > position]
            if position and pair == unlikely and len(tokens) < 500:
                continue  # too few samples for the test (the likely pair covers it)
            counts = np.bincount(tokens, minlength=vocab)
            support = p[position] > 0
            assert counts[~support].sum() == 0  # never outside top-k
            stat = chi_square(counts[support], p[position][support])
            assert stat < CHI2_999[int(support.sum()) - 1], (pair, position, stat, counts)
        kept_first = np.mean([len(t) > 1 for t in got])
        expected = p[0][pair[0]]
        assert abs(kept_first - expected) < 4 * np.sqrt(expected * (1 - expected) / len(got))


def test_sampled_tokens_of_a_model_keep_its_distribution(qwen25_path):
    """End to end on a tiny model: 1,200 seeded samples of a prompt (temperature 1,
    top-k 5), each second token checked against a draft. Among the samples whose first
    token is the most common one, the second token is distributed as the model says
    (its top-5 logprobs after that token, renormalized), by a chi-square test."""
    plain = LLM(qwen25_path, num_kv_blocks=256)
    first_out = plain.generate("a small red circle in the", SamplingParams(max_tokens=1, logprobs=5))[0]
    prompt = {"prompt_token_ids": first_out.prompt_token_ids}
    first = first_out.outputs[0].logprobs[0]
    likely_first = first.token_ids[1]
    after = plain.generate({"prompt_token_ids": prompt["prompt_token_ids"] + [likely_first]},
                           SamplingParams(max_tokens=1, logprobs=5))[0].outputs[0].logprobs[0]
    top = np.asarray(after.token_ids[1:])
    p = np.exp(np.asarray(after.logprobs[1:]))
    p /= p.sum()
    draft = int(top[1])  # the second most likely: kept about as often as refused

    class Fixed(Proposer):
        def propose(self, so, step, kept, proposing):
            return {step.req_ids[i]: [draft] for i in proposing}

    llm = LLM(qwen25_path, num_kv_blocks=512, max_num_seqs=64, speculative_config=NGRAM)
    llm.engine.engine_core.runner.proposer = Fixed()
    params = [SamplingParams(temperature=1.0, top_k=5, max_tokens=3, seed=i, ignore_eos=True) for i in range(1200)]
    outs = llm.generate([prompt] * len(params), params)
    seconds = [o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == likely_first]
    drafted, accepted = acceptance(llm)
    assert drafted >= len(outs) and 0 < accepted < drafted
    assert len(seconds) > 200
    counts = np.asarray([seconds.count(int(t)) for t in top])
    assert counts.sum() == len(seconds)  # never outside the top 5
    assert chi_square(counts, p) < CHI2_999[4], (counts, p)


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def spec_llm(qwen25_path):
    return LLM(qwen25_path, num_kv_blocks=256, speculative_config=NGRAM)


def acceptance(llm) -> tuple[int, int]:
    stats = llm.engine.stats()
    return stats.num_draft_tokens, stats.num_accepted_tokens


def test_mixed_requests_with_pictures_give_transformers_tokens(spec_llm, hf_qwen25):
    specs, prompts, params = mixed_requests(hf_qwen25)
    before = acceptance(spec_llm)
    outs = run_together(spec_llm, prompts, params)
    for out, (text, images, n) in zip(outs, specs):
        check(out, hf_qwen25, text, images, n, prompt_logprobs=True)
    drafted, accepted = (a - b for a, b in zip(acceptance(spec_llm), before))
    assert drafted > 0 and accepted > 0  # drafts were checked and some kept: the test exercises them
    assert_all_free(spec_llm)


def test_chunked_prefill_preemption_and_prefix_hits_with_drafts(qwen25_path, hf_qwen25):
    specs, prompts, _ = mixed_requests(hf_qwen25)
    specs = [(text, images, 2 * n) for text, images, n in specs]  # longer answers: the tiny cache must preempt
    params = [greedy(n, prompt_logprobs=-1) for _, _, n in specs]
    chunked = LLM(qwen25_path, num_kv_blocks=256, max_num_batched_tokens=9, speculative_config=NGRAM)
    tiny = LLM(qwen25_path, num_kv_blocks=22, max_num_seqs=8, speculative_config=NGRAM)
    for llm in (chunked, tiny):
        outs = run_together(llm, prompts, params)
        for out, (text, images, n) in zip(outs, specs):
            check(out, hf_qwen25, text, images, n, prompt_logprobs=True)
        assert acceptance(llm)[1] > 0
        assert_all_free(llm)
    assert tiny.engine.stats().num_preemptions > 0
    # a prompt that continues a finished one hits the blocks it wrote, drafts included: they
    # hold only kept tokens, as transformers' answer shows
    text, images = CASES["text"]
    first = chunked.generate(request(hf_qwen25, text, images), greedy(24))[0]
    follow = {"prompt_token_ids": first.prompt_token_ids + first.outputs[0].token_ids}
    plain = LLM(qwen25_path, num_kv_blocks=256)
    second, reference = chunked.generate(follow, greedy(12))[0], plain.generate(follow, greedy(12))[0]
    assert second.num_cached_tokens >= 16 * ((len(follow["prompt_token_ids"]) - 1) // 16) - 16
    assert second.outputs[0].token_ids == reference.outputs[0].token_ids
    assert torch.allclose(torch.tensor([e.logprobs[0] for e in second.outputs[0].logprobs]),
                          torch.tensor([e.logprobs[0] for e in reference.outputs[0].logprobs]), atol=1e-4)


def test_an_abort_with_drafts_in_flight_leaves_nothing_behind(spec_llm, hf_qwen25):
    engine = spec_llm.engine
    engine.add_request("going", request(hf_qwen25, "Hello world " * 6, [IMG_A]),
                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    going = engine.engine_core.scheduler.requests["going"]
    for _ in range(150):  # until the next step would check drafts
        engine.step()
        if going.draft_token_ids:
            break
    assert going.draft_token_ids and not going.is_finished()
    engine.step()  # the drafts are in flight: KV slots allocated for them
    engine.abort_request("going")
    engine.step()
    assert not engine.has_unfinished_requests()
    assert_all_free(spec_llm)


def test_no_drafts_while_more_requests_run_than_the_limit(qwen25_path, hf_qwen25):
    """disable_by_batch_size: a full batch is compute-bound, checking drafts costs more
    than it saves; a lone request drafts again."""
    llm = LLM(qwen25_path, num_kv_blocks=256, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    prompt = request(hf_qwen25, "Hello world " * 6, [])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    together = run_together(llm, [prompt] * 3, [params] * 3)  # three run from the first step to the last
    assert acceptance(llm) == (0, 0)
    alone = llm.generate(prompt, params)[0]
    assert acceptance(llm)[0] > 0
    assert all(o.outputs[0].token_ids == alone.outputs[0].token_ids for o in together)


def test_stop_strings_and_sampling_with_seeds(spec_llm, qwen25_path, hf_qwen25):
    plain = LLM(qwen25_path, num_kv_blocks=256)
    prompt = request(hf_qwen25, "Hello world " * 6, [])
    free_run = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = free_run.text[len(free_run.text) // 2 :][:3]
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True)
    want, got = plain.generate(prompt, params)[0].outputs[0], spec_llm.generate(prompt, params)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    # sampled: a seed gives the same answer every time, whatever else runs beside it
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=7, ignore_eos=True)
    alone = spec_llm.generate(prompt, seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)] * 3
    together = spec_llm.generate([prompt] * 4, [seeded] + others)
    assert together[0].outputs[0].token_ids == alone


def test_structured_output_decodes_without_drafts(spec_llm, qwen25_path, hf_qwen25):
    """A request under a grammar gets no drafts (its mask depends on each token before);
    its answer is the one without speculation, and other requests still draft."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    prompt = request(hf_qwen25, "Give JSON.", [])
    plain = LLM(qwen25_path, num_kv_blocks=256)
    got = spec_llm.generate(prompt, params)[0].outputs[0]
    assert got.token_ids == plain.generate(prompt, params)[0].outputs[0].token_ids
    assert isinstance(json.loads(got.text)["a"], int)


def test_bad_settings_are_refused_before_loading(qwen25_path):
    with pytest.raises(ConfigError, match="speculative-config.*num_speculative_tokens"):
        LLM(qwen25_path, speculative_config={"num_speculative_tokens": -1})


# ----------------------------------------------------------------------------- hybrid models
class OracleProposer(Proposer):
    """Drafts the answer a run without speculation gave (random-weight models rarely
    repeat themselves, so n-grams are seldom right), with one draft in three wrong: drafts
    are kept, and refused part-way."""

    def __init__(self, sequences: list[list[int]], batch) -> None:
        self.sequences = [np.asarray(s) for s in sequences]
        self.batch = batch

    def propose(self, so, step, kept, proposing):
        return {step.req_ids[i]: self.lookup(token_history(self.batch, step.rows[i])) for i in proposing}

    def lookup(self, tokens: np.ndarray) -> list[int]:
        n = len(tokens)
        for full in self.sequences:
            if len(full) > n and np.array_equal(full[:n], tokens):
                drafts = full[n : n + 3].tolist()
                if n % 3 == 0 and len(drafts) > 1:
                    drafts[1] = (drafts[1] + 1) % 64
                return drafts
        return []


def with_oracle(llm: LLM, plain_outputs) -> LLM:
    runner = llm.engine.engine_core.runner
    runner.proposer = OracleProposer([o.prompt_token_ids + o.outputs[0].token_ids for o in plain_outputs],
                                     runner.input_batch)
    return llm


def test_hybrid_model_resumes_from_the_state_at_the_last_kept_token(qwen35_path, hf_qwen35):
    """Gated DeltaNet layers: a refused draft puts the recurrent state back to its
    checkpoint after the last kept token. Transformers' tokens and logprobs, in mixed
    batches, in small steps and under preemption; every state slot given back."""
    from test_qwen3_5_parity import assert_all_free as assert_hybrid_free

    specs, prompts, params = mixed_requests(hf_qwen35)
    plain = run_together(LLM(qwen35_path, num_kv_blocks=256), prompts, params)
    big = LLM(qwen35_path, num_kv_blocks=256, speculative_config=NGRAM)
    chunked = LLM(qwen35_path, num_kv_blocks=256, max_num_batched_tokens=6, speculative_config=NGRAM)
    tiny = LLM(qwen35_path, num_kv_blocks=14, max_num_seqs=8, speculative_config=NGRAM)
    for llm in (big, chunked, tiny):
        outs = run_together(with_oracle(llm, plain), prompts, params)
        for out, (text, images, n) in zip(outs, specs):
            check(out, hf_qwen35, text, images, n, prompt_logprobs=True)
        drafted, accepted = acceptance(llm)
        assert 0 < accepted < drafted  # drafts kept, and refused (the state was put back)
        assert_hybrid_free(llm)
    assert tiny.engine.stats().num_preemptions > 0


def test_hybrid_prefix_hit_after_drafts(qwen35_path, hf_qwen35):
    """A request that shares a system prompt and picture with one decoded with drafts
    resumes from the snapshot it left (drafts never enter the cache)."""
    from test_qwen3_5_parity import assert_all_free as assert_hybrid_free
    from test_qwen3_5_parity import system_prompt_request

    questions = ("Describe the image.", "How many shapes are there?")
    requests = [system_prompt_request(hf_qwen35, q, [IMG_A]) for q in questions]
    plain = LLM(qwen35_path, num_kv_blocks=256).generate([r for r, _ in requests], greedy(20))
    llm = with_oracle(LLM(qwen35_path, num_kv_blocks=256, speculative_config=NGRAM), plain)
    for req, prompt in requests:
        out = llm.generate(req, greedy(20))[0]
        ref_tokens, ref_lp = hf_qwen35.generate(prompt, [IMG_A], 20)
        assert out.outputs[0].token_ids == ref_tokens
        chosen = [e.logprobs[0] for e in out.outputs[0].logprobs]
        assert max(abs(a - ref_lp[i, t].item()) for i, (a, t) in enumerate(zip(chosen, ref_tokens))) < 1e-4
    assert out.num_cached_tokens > 0 and 0 < acceptance(llm)[1] < acceptance(llm)[0]
    assert_hybrid_free(llm)


# ----------------------------------------------------------------------------- draft model
def draft_settings(path: str, k: int = 3) -> dict:
    return {"model": path, "num_speculative_tokens": k}


def noisy_copy(src: str, dst, scale: float, seed: int = 0) -> str:
    """The checkpoint with noise added to the MLP weights of its language model (a draft
    that often agrees with the original and sometimes not) and of its vision tower (so
    the draft reads pictures with an encoder of its own)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(Path(dst).glob("*.safetensors")):
        weights = load_file(file)
        for name, w in weights.items():
            vision_mlp = "visual" in name and ".mlp." in name and w.ndim == 2
            if vision_mlp or (name.endswith("mlp.down_proj.weight") and "visual" not in name):
                weights[name] = w + scale * w.std() * torch.randn(w.shape, generator=gen, dtype=w.dtype)
        save_file(weights, file, metadata={"format": "pt"})
    return str(dst)


def hybrid_free(llm):
    from test_qwen3_5_parity import assert_all_free as assert_hybrid_free

    assert_hybrid_free(llm)


@pytest.mark.parametrize("family", ["qwen25", "qwen35"])
def test_a_draft_model_that_is_its_target_has_every_guess_kept(family, request):
    """The draft model's cache must hold what the target's holds (prompt chunks, pictures
    through its own encoder, kept drafts, prefix hits, recomputation after preemption),
    or its guesses drift from the target's greedy tokens: with the target as its own
    draft, every guess is kept, in mixed batches with pictures, in small steps, under
    preemption and on prefix hits; transformers' tokens and logprobs; nothing left."""
    path, hf = request.getfixturevalue(f"{family}_path"), request.getfixturevalue(f"hf_{family}")
    assert_free = hybrid_free if family == "qwen35" else assert_all_free
    specs, prompts, _ = mixed_requests(hf)
    settings = [{"num_kv_blocks": 256}, {"num_kv_blocks": 256, "max_num_batched_tokens": 7},
                {"num_kv_blocks": 14 if family == "qwen35" else 22, "max_num_seqs": 8}]
    for i, engine_settings in enumerate(settings):
        if i == 2:  # longer answers: the tiny cache must preempt
            specs = [(text, images, 2 * n) for text, images, n in specs]
        params = [greedy(n, prompt_logprobs=-1) for _, _, n in specs]
        llm = LLM(path, speculative_config=draft_settings(path), **engine_settings)
        outs = run_together(llm, prompts, params)
        for out, (text, images, n) in zip(outs, specs):
            check(out, hf, text, images, n, prompt_logprobs=True)
        if i == 0:  # again, without prompt logprobs: prefix hits, pictures included
            outs = run_together(llm, prompts, [greedy(n) for _, _, n in specs])
            for out, (text, images, n) in zip(outs, specs):
                check(out, hf, text, images, n)
            assert all(out.num_cached_tokens > 0 for out in outs if len(out.prompt_token_ids) > 16)
        drafted, accepted = acceptance(llm)
        assert drafted > 0 and accepted == drafted, (engine_settings, drafted, accepted)
        assert_free(llm)
        if i == 2:
            assert llm.engine.stats().num_preemptions > 0


def recorded_drafts(llm: LLM, prompts: list, params: SamplingParams) -> tuple[list, list[tuple[int, list, list]]]:
    """Runs the prompts together; returns their outputs and, after every step, each
    request's index, tokens so far and the drafts proposed for them."""
    engine = llm.engine
    scheduler = engine.engine_core.scheduler
    for i, prompt in enumerate(prompts):
        engine.add_request(f"rec-{i}", prompt, params)
    done, pairs = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        pairs += [(int(r.request_id.split("-")[1]), list(r.all_token_ids), list(r.draft_token_ids))
                  for r in scheduler.requests.values() if r.draft_token_ids]
    return [done[f"rec-{i}"] for i in range(len(prompts))], pairs


@pytest.mark.parametrize("family", ["qwen25", "qwen35"])
def test_draft_model_guesses_are_its_own_greedy_continuations(family, request, tmp_path):
    """A draft that is right only sometimes, with a vision tower of its own: each step's
    drafts are exactly the draft model's greedy continuation of the request's tokens so
    far (as that model alone gives it), pictures included, through refusals part-way,
    small steps and preemption (so the catch-up rewrote what refused guesses had written,
    and the guesses never moved the live recurrent state); the answers are the target's."""
    import test_qwen2_5_vl_parity as parity

    path, hf = request.getfixturevalue(f"{family}_path"), request.getfixturevalue(f"hf_{family}")
    draft = noisy_copy(path, tmp_path / "draft", scale=0.3)
    cases = [("Describe the image.", [IMG_A]), ("Hello world " * 4, []), ("What is in this picture?", [IMG_A, parity.IMG_B]),
             ("a small red circle " * 3, [])]
    prompts = [parity.request(hf, text, images) for text, images in cases]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, num_kv_blocks=256).generate(prompts, params)]
    # the draft alone, from each prompt (its placeholders unexpanded) and the tokens after it
    unexpanded = [hf.processor.tokenizer.encode(p["prompt"], add_special_tokens=False) for p in prompts]
    pads = {hf.processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")}
    draft_alone = LLM(draft, num_kv_blocks=256)
    for engine_settings in ({"num_kv_blocks": 256, "max_num_batched_tokens": 7},
                            {"num_kv_blocks": 14 if family == "qwen25" else 11, "max_num_seqs": 4}):
        llm = LLM(path, speculative_config=draft_settings(draft, 4), **engine_settings)
        outs, pairs = recorded_drafts(llm, prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want
        drafted, accepted = acceptance(llm)
        assert 0 < accepted < drafted, (drafted, accepted)  # kept and refused
        checked = []
        for i, tokens, drafts in pairs:
            generated = tokens[len(outs[i].prompt_token_ids):]
            if not pads & set(generated):  # (a random model may say a placeholder)
                checked.append(({"prompt_token_ids": unexpanded[i] + generated,
                                 "multi_modal_data": {"image": cases[i][1]}}, drafts))
        assert len(checked) > 20 and any(p["multi_modal_data"]["image"] for p, _ in checked)
        continuations = draft_alone.generate([p for p, _ in checked],
                                             SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert [d for _, d in checked] == [c.outputs[0].token_ids[: len(d)] for c, (_, d) in zip(continuations, checked)]
        (hybrid_free if family == "qwen35" else assert_all_free)(llm)
    assert llm.engine.stats().num_preemptions > 0


def test_a_draft_model_takes_its_cache_from_the_same_budget(qwen35_path):
    """kv_cache_memory_gb holds the target's blocks and states and the draft's (its KV
    tensors on the same block ids, its states on the same slots plus a scratch slot per
    request): what is really allocated stays within it, and the engine answers."""
    budget_gb, seqs = 0.01, 4
    llm = LLM(qwen35_path, kv_cache_memory_gb=budget_gb, max_num_seqs=seqs, speculative_config=draft_settings(qwen35_path))
    runner = llm.engine.engine_core.runner
    storages = {}
    for caches in (runner.kv_caches, runner.proposer.plan.kv_caches):
        for tensors in caches.values():
            for t in tensors:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    budget = budget_gb * (1 << 30)
    assert 0.9 * budget < sum(storages.values()) <= budget
    out = llm.generate({"prompt_token_ids": list(range(10, 50))}, SamplingParams(temperature=0, max_tokens=20))[0]
    assert len(out.outputs[0].token_ids) == 20 and acceptance(llm)[1] > 0
    hybrid_free(llm)


def test_draft_models_that_cannot_draft_are_refused(qwen25_path, qwen35_path, tmp_path):
    from vlmserve.testing.checkpoints import build_qwen2_5_vl

    other_vocab = str(build_qwen2_5_vl(tmp_path / "vocab", vocab_size=300))
    for draft, why in ((other_vocab, "vocab"), (qwen35_path, "model_type"), (str(tmp_path / "none"), "no such folder")):
        with pytest.raises(ConfigError, match=why):
            LLM(qwen25_path, speculative_config=draft_settings(draft))
    with pytest.raises(ConfigError, match="needs \"model\""):
        LLM(qwen25_path, speculative_config={"method": "draft_model"})
    with pytest.raises(ConfigError, match="vocab"):  # from an engine core in a process of its own too
        LLM(qwen25_path, engine_process=True, speculative_config=draft_settings(other_vocab))


# ----------------------------------------------------------------------------- served
@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_served_with_speculation_on_the_shipped_model(method):
    """`vlmserve serve --speculative-config ...` on the shipped (hybrid) model, the
    official client, with n-gram drafts or a draft model (the shipped model drafting for
    itself: every guess is right): a question whose answer the prompt already holds (the
    first turn's) is answered as without speculation, streamed and not, with logprobs for
    each token; drafts were kept (/metrics). A bad setting stops the command with one line."""
    import base64
    import re
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    from test_openai_server import KEY, Server
    from vlmserve.engine.model_source import SHIPPED_MODEL

    sample = Path(__file__).resolve().parent.parent / "samples" / "shapes3.jpg"
    url = "data:image/jpeg;base64," + base64.b64encode(sample.read_bytes()).decode()
    ask = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                       {"type": "text", "text": "Describe the image."}]}
    llm = LLM(dtype="float32")
    plain = llm.chat([ask], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    chat = [ask, {"role": "assistant", "content": plain}, ask]
    want = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    del llm
    settings = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
                "draft_model": {"model": str(SHIPPED_MODEL), "num_speculative_tokens": 3}}[method]
    server = Server(None, "--api-key", KEY, "--dtype", "float32", "--speculative-config", json.dumps(settings))
    try:
        client = server.client()
        answer = client.chat.completions.create(model="tiny", messages=chat, temperature=0, max_tokens=40,
                                                logprobs=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=chat, temperature=0, max_tokens=40, stream=True) if c.choices)
        assert answer.choices[0].message.content == streamed == want.text
        assert len(answer.choices[0].logprobs.content) == answer.usage.completion_tokens == len(want.token_ids)
        metrics = httpx.get(server.base + "/metrics").text
        accepted = float(re.search(r"^vllm:spec_decode_num_accepted_tokens_total{.*} (\S+)", metrics, re.M).group(1))
        assert accepted > 0
        per_position = [float(v) for v in re.findall(
            r'^vllm:spec_decode_num_accepted_tokens_per_pos_total{.*position="\d+".*} (\S+)', metrics, re.M)]
        assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    finally:
        server.stop()
    bad_settings, why = {"ngram": ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
                         "draft_model": ({"model": "/no/such/draft"}, "--speculative-config model /no/such/draft: no such folder")}[method]
    bad = subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", "--speculative-config",
                          json.dumps(bad_settings)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and why in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
