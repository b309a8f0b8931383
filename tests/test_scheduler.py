"""Scheduler invariants, with a stand-in for the model runner (no tensors involved)."""

import random

import pytest
import torch

from vlmserve.config import SchedulerConfig
from vlmserve.core.encoder_cache_manager import EncoderCacheManager
from vlmserve.core.kv_cache_manager import KVCacheManager
from vlmserve.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec, group_layers
from vlmserve.core.kv_cache_utils import BlockHasher
from vlmserve.core.sched_output import ModelRunnerOutput
from vlmserve.core.scheduler import Scheduler
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.request import Request, RequestStatus
from vlmserve.sampling_params import SamplingParams

BS = 4
EOS = 0


def make_scheduler(num_blocks=64, budget=32, max_seqs=8, window=None, enc_budget=64, enc_cache=64, max_len=512,
                   state_slots=0):
    specs = {0: FullAttentionSpec(BS, 1, 4, torch.float32)}
    if window:
        specs[1] = SlidingWindowSpec(BS, 1, 4, torch.float32, sliding_window=window)
    if state_slots:  # a hybrid model: a recurrent layer too
        specs[2] = MambaSpec(BS, (2, 3), (1, 2, 2), torch.float32)
    config = KVCacheConfig(num_blocks, group_layers(specs), num_state_slots=state_slots,
                           num_state_snapshots=max(0, state_slots - max_seqs))
    sched_config = SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len, enable_chunked_prefill=True,
        encoder_compute_budget=enc_budget, encoder_cache_size=enc_cache,
    )
    return Scheduler(sched_config, KVCacheManager(config, max_len), EncoderCacheManager(enc_cache))


def make_request(rid, prompt_len, max_tokens, images=(), priority=0, arrival=None, seed=0):
    rng = random.Random(seed)
    tokens = [rng.randint(5, 50) for _ in range(prompt_len)]
    feats = []
    for h, off, n in images:
        tokens[off : off + n] = [99] * n
        feats.append(MultiModalFeature("image", h, off, n, {}))
    return Request(
        rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), EOS, feats,
        arrival_time=arrival, priority=priority, block_hasher=BlockHasher(BS),
    )


class FakeRunner:
    """Samples a token for every request whose scheduled range reaches its last token, and
    keeps the encoder outputs as the real runner does: every picture a step's tokens
    reach must be encoded in that step or still be in its cache."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.encoded: list[str] = []
        self.cache: set[str] = set()

    def execute(self, so):
        ids, sampled = [], []
        self.cache -= set(so.free_encoder_mm_hashes)
        for rid in so.num_scheduled_tokens:
            req = self.scheduler.requests[rid]
            for i in so.scheduled_encoder_inputs.get(rid, []):
                self.encoded.append(req.mm_features[i].mm_hash)
                self.cache.add(req.mm_features[i].mm_hash)
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            start = req.num_computed_tokens - n
            for f in req.mm_features:
                if f.offset < start + n and f.end > start:
                    assert f.mm_hash in self.cache, f"{rid} reaches {f.mm_hash}, which was never encoded"
            ids.append(rid)
            # num_computed_tokens was already advanced by schedule()
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, sampled)


def run_to_completion(sched, runner, on_step=None, max_steps=2000):
    steps = 0
    while sched.has_requests():
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        sched.update_from_output(so, runner.execute(so))
        if on_step:
            on_step(steps, so)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def assert_everything_free(sched):
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.config.num_blocks - 1
    assert all(not blocks for _, m in kv.attention_managers for blocks in m.req_to_blocks.values())
    assert sched.encoder_cache_manager.num_referenced() == 0
    assert not sched.requests and not sched.running and not sched.waiting


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_respects_budget_and_frees_everything(seed):
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.choice([24, 40, 200]), budget=rng.choice([8, 16, 64]),
                           window=rng.choice([None, 8]))
    runner = FakeRunner(sched)
    reqs = []
    for i in range(20):
        n = rng.randint(3, 60)
        images = []
        if n > 20 and rng.random() < 0.6:
            images = [(f"img{rng.randint(0, 3)}", rng.randint(0, 5), rng.randint(4, 12))]
        reqs.append(make_request(f"r{i}", n, rng.randint(1, 12), images, priority=rng.randint(0, 2), seed=i))
        sched.add_request(reqs[-1])
    to_abort = {r.request_id for r in rng.sample(reqs, 5)}

    def abort_some(step, so):
        # abort at any point: waiting, mid-prefill, decoding
        for rid in list(to_abort):
            if rng.random() < 0.3:
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                to_abort.discard(rid)

    run_to_completion(sched, runner, abort_some)
    for r in reqs:
        assert r.is_finished()
        if r.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert r.num_output_tokens == r.sampling_params.max_tokens
    assert_everything_free(sched)


def test_abort_mid_prefill_frees_blocks_and_encoder_refs():
    sched = make_scheduler(budget=8)
    runner = FakeRunner(sched)
    r = make_request("a", 40, 5, [("img", 10, 20)])
    sched.add_request(r)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()  # this chunk reaches the image: encoder scheduled, reference taken
    assert so.scheduled_encoder_inputs == {"a": [0]}
    assert sched.encoder_cache_manager.num_referenced() == 1
    sched.update_from_output(so, runner.execute(so))
    assert 0 < r.num_computed_tokens < r.num_prompt_tokens
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert r.get_finished_reason().value == "abort"
    assert_everything_free(sched)
    assert "a" in sched.schedule().finished_req_ids  # the runner is told


def test_chunked_prefill_cuts_through_an_image_and_encodes_it_once():
    sched = make_scheduler(budget=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 40, 2, [("img", 5, 20)]))
    chunks = []
    run_to_completion(sched, runner, lambda s, so: chunks.append(so.num_scheduled_tokens.get("a", 0)))
    assert chunks[:5] == [8, 8, 8, 8, 8] and runner.encoded == ["img"]


def test_a_picture_whose_tokens_see_each_other_is_never_cut():
    """Gemma 3's pictures: a step stops before one that does not fit whole, and a request
    whose prefix hit ends inside one computes the rest of it in one step."""
    sched = make_scheduler(budget=8, num_blocks=128)
    runner = FakeRunner(sched)

    def both_ways(rid, tail_seed):
        req = make_request(rid, 30, 2, [("img", 5, 6), ("img2", 12, 7)])
        tail = random.Random(tail_seed)
        req.prompt_token_ids[19:] = [tail.randint(5, 50) for _ in range(11)]  # the text after the pictures
        req = Request(rid, req.prompt_token_ids, req.sampling_params, EOS, req.mm_features, block_hasher=BlockHasher(BS))
        for f in req.mm_features:
            f.bidirectional = True
        return req

    sched.add_request(both_ways("a", 1))
    steps = []
    run_to_completion(sched, runner, lambda s, so: steps.append(so.num_scheduled_tokens.get("a", 0)))
    assert steps[:3] == [5, 7, 8]  # [0, 5) | [5, 12): img whole, stops before img2 | [12, 20): img2 whole
    # the same pictures, other text after them: the hit of 4 blocks ends inside img2 [12, 19);
    # behind a 6-token prompt, the 2 tokens of budget left would cut it: b waits a step
    sched.add_request(make_request("c", 6, 1, seed=9))
    sched.add_request(both_ways("b", 2))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"c": 6} and sched.requests["b"].status == RequestStatus.WAITING
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()
    assert sched.requests["b"].num_cached_tokens == 16 and so.num_scheduled_tokens["b"] == 8
    sched.update_from_output(so, runner.execute(so))
    run_to_completion(sched, runner)
    assert_everything_free(sched)


def test_encoder_cache_hit_skips_the_encoder_for_a_repeated_image():
    sched = make_scheduler(budget=64)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 30, 2, [("img", 2, 10)], seed=1))
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", 30, 2, [("img", 2, 10)], seed=2))  # other text, same image
    run_to_completion(sched, runner)
    assert runner.encoded == ["img"]
    assert sched.encoder_cache_manager.stats.hits == 1


def test_encoder_budget_stops_the_step_before_the_image():
    sched = make_scheduler(budget=64, enc_budget=16, enc_cache=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 40, 2, [("i1", 2, 12), ("i2", 20, 12)]))
    so = sched.schedule()
    # i2 does not fit the step's encoder budget after i1: the step ends at its placeholder
    assert so.scheduled_encoder_inputs == {"a": [0]} and so.num_scheduled_tokens["a"] == 20
    sched.update_from_output(so, runner.execute(so))
    run_to_completion(sched, runner)
    assert runner.encoded == ["i1", "i2"]


def test_waiting_requests_go_by_priority_then_arrival():
    sched = make_scheduler(budget=10, max_seqs=1)
    runner = FakeRunner(sched)
    order = []
    for rid, prio, t in [("late-hi", 0, 3.0), ("low", 5, 1.0), ("early-hi", 0, 2.0)]:
        sched.add_request(make_request(rid, 5, 1, priority=prio, arrival=t))

    def record(step, so):
        for r in so.scheduled_new_reqs:
            order.append(r.req_id)

    run_to_completion(sched, runner, record)
    assert order == ["early-hi", "late-hi", "low"]


def test_preemption_when_blocks_run_out_and_everyone_finishes():
    sched = make_scheduler(num_blocks=12, budget=64, max_seqs=8)
    runner = FakeRunner(sched)
    reqs = [make_request(f"r{i}", 10, 20, arrival=float(i), seed=i) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched, runner)
    assert sched.num_preemptions > 0
    assert all(r.num_output_tokens == 20 for r in reqs)
    # the latest arrival is the one pushed out
    assert reqs[-1].num_preemptions >= 1 and reqs[0].num_preemptions == 0
    assert_everything_free(sched)


def test_prefix_cache_hit_for_a_shared_prefix():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    a = make_request("a", 30, 1, [("img", 4, 12)], seed=3)
    sched.add_request(a)
    run_to_completion(sched, runner)
    b = make_request("b", 30, 1, [("img", 4, 12)], seed=3)
    c = make_request("c", 30, 1, [("other", 4, 12)], seed=3)
    sched.add_request(b)
    sched.add_request(c)
    run_to_completion(sched, runner)
    assert b.num_cached_tokens == 28  # 7 full blocks; the last token is always recomputed
    assert c.num_cached_tokens == 4  # only the block before the image
    assert_everything_free(sched)


def test_a_hybrid_request_waits_a_step_for_the_prefix_another_computes_in_it():
    """Two requests with one prompt, together: the recurrent state of their shared prefix
    is shared only once the step that computes it ends, so the second waits for it
    instead of computing the picture again; a third about another picture goes ahead."""
    sched = make_scheduler(budget=128, state_slots=16)
    runner = FakeRunner(sched)
    same = [make_request(rid, 30, 2, [("img", 4, 12)], seed=3) for rid in ("a", "b")]
    other = make_request("c", 30, 2, [("other", 4, 12)], seed=3)
    # one that asks for prompt logprobs computes every prompt token anyway: it never waits
    every = make_request("d", 30, 2, [("img", 4, 12)], seed=3)
    every.sampling_params.prompt_logprobs = 1
    for request in (*same, other, every):
        request.cache_points = [16, 28]  # after the picture, and the prompt's end rounded down
        sched.add_request(request)
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"a", "c", "d"}  # b is held back
    sched.update_from_output(so, runner.execute(so))
    run_to_completion(sched, runner)
    b = same[1]
    assert b.num_cached_tokens == 28  # the same prompt: resumed from the state at its last cache point
    assert runner.encoded.count("img") == 2  # for a and d, in the first step; never for b
    assert same[0].num_cached_tokens == other.num_cached_tokens == every.num_cached_tokens == 0
    assert all(r.is_finished() for r in (*same, other, every))
    assert_everything_free(sched)


def test_sliding_window_group_holds_a_bounded_number_of_blocks():
    window = 8
    sched = make_scheduler(window=window, budget=16)
    runner = FakeRunner(sched)
    r = make_request("a", 12, 60)
    sched.add_request(r)
    peak = [0, 0]

    def watch(step, so):
        if not r.is_finished():
            held = sched.kv_cache_manager.num_held_blocks("a")
            peak[0] = max(peak[0], held[0])
            peak[1] = max(peak[1], held[1])

    run_to_completion(sched, runner, watch)
    assert peak[0] == -(-72 // BS)  # full attention keeps everything
    assert peak[1] <= -(-window // BS) + 1
    assert_everything_free(sched)


def test_a_picture_two_requests_need_is_encoded_when_the_first_is_preempted():
    """A (low priority, running first) and B both reach picture X in one step; A's run of
    the encoder is scheduled, B joins it, then B's blocks run out and A is preempted:
    X must still be encoded, for B."""
    sched = make_scheduler(num_blocks=15, budget=32, enc_budget=8, enc_cache=64)
    runner = FakeRunner(sched)
    # one picture per step fits the encoder budget: A stops before Y2, then before X
    a = make_request("a", 40, 2, [("y1", 2, 8), ("y2", 12, 8), ("x", 22, 8)], priority=1, arrival=0, seed=1)
    sched.add_request(a)
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    assert so.num_scheduled_tokens == {"a": 12}
    b = make_request("b", 30, 2, [("x", 10, 8)], priority=0, arrival=1, seed=2)
    sched.add_request(b)
    so = sched.schedule()  # A encodes Y2; B comes in but stops before X (no encoder budget left)
    sched.update_from_output(so, runner.execute(so))
    assert so.num_scheduled_tokens == {"a": 10, "b": 10}
    so = sched.schedule()
    assert [r.request_id for r in sched.waiting] == ["a"] and sched.num_preemptions == 1  # A made room for B
    # A was scheduled first in this step, its blocks hashed for it: taken out, they hold nothing to hit
    cached = {key[0] for key in sched.kv_cache_manager.block_pool.cached_blocks}
    assert not cached & set(a.block_hashes[22 // BS:]) and set(a.block_hashes[:22 // BS]) <= cached
    assert so.scheduled_encoder_inputs == {"b": [0]}  # X is still encoded, now for B
    sched.update_from_output(so, runner.execute(so))  # the runner asserts B's tokens find X
    run_to_completion(sched, runner)
    assert a.is_finished() and b.is_finished()
    assert_everything_free(sched)


def test_a_failed_step_leaves_nothing_behind_that_a_later_request_could_hit():
    """The step's blocks were hashed when allocated, its picture's encoder entry made:
    after the failure neither may be hit, and a retry computes everything again."""
    sched = make_scheduler(num_blocks=64, budget=64)
    runner = FakeRunner(sched)
    first = make_request("first", 24, 2, [("pic", 4, 8)], seed=5)
    sched.add_request(first)
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {"first": [0]}
    sched.discard_step(so)  # as EngineCore does when execute_model raises
    assert first.status == RequestStatus.FINISHED_ERROR
    assert_everything_free(sched)
    assert sched.kv_cache_manager.block_pool.cached_blocks == {}
    retry = make_request("retry", 24, 2, [("pic", 4, 8)], seed=5)
    sched.add_request(retry)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"retry": 24}  # no prefix hit on the failed step's blocks
    assert so.scheduled_encoder_inputs == {"retry": [0]}  # and the picture is encoded again
    assert "pic" in so.free_encoder_mm_hashes  # the runner drops whatever the failed run left
    sched.update_from_output(so, runner.execute(so))
    run_to_completion(sched, runner)
    assert_everything_free(sched)


def test_state_snapshots_evict_lru_never_pinned_and_not_after_a_failed_step():
    from vlmserve.core.state_pool import StatePool

    pool = StatePool(4, max_snapshots=3)
    live = pool.take()
    for key in "abc":  # three snapshots, one step each
        pool.save(key, live)
        pool.drain_copies()
        pool.commit()
    # every slot but the live one holds a snapshot, none pinned: all three can be taken again
    assert not pool.free and len(pool.snapshots) == 3 and not pool.pinned
    assert pool.lookup("a") is not None  # "a" is now the most recent
    pool.restore(pool.snapshots["b"], live)  # "b" is read by this step: pinned
    slot = pool.take()  # evicts the least recently used unpinned one: "c"
    assert slot is not None and "c" not in pool.snapshots and set(pool.snapshots) == {"a", "b"}
    pool.release(slot)
    pool.save("d", live)  # then the step fails
    pool.abort_step()
    pool.commit()
    assert pool.lookup("d") is None and pool.free == [slot]  # its slot is free again
    assert set(pool.snapshots) == {"a", "b"} and not pool.pinned


def test_snapshots_never_take_the_slots_kept_for_running_requests():
    """Two slots for running requests, one for snapshots: however many cache points a step
    passes, a request admitted after them still finds its slot; past the allowance a new
    snapshot replaces the least recently used one."""
    from vlmserve.core.state_pool import StatePool

    pool = StatePool(3, max_snapshots=1)
    live = pool.take()
    pool.save("a", live)
    pool.save("b", live)  # the allowance is taken by "a", pending: skipped
    assert set(pool.pending) == {"a"}
    assert pool.take() is not None  # a request admitted later in the step
    pool.drain_copies()
    pool.commit()
    pool.save("c", live)  # replaces "a"
    pool.drain_copies()
    pool.commit()
    assert set(pool.snapshots) == {"c"} and not pool.free


@pytest.mark.parametrize("seed", range(6))
def test_a_block_belongs_to_one_group_at_a_time(seed):
    """Full and sliding-window groups share one pool (and tensor slots): a block one group
    takes as a prefix-cache hit must never be handed to the other as a new block in the
    same allocation (the two would write each other's keys). Requests sharing prefixes
    on a small pool, under preemption."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=20, budget=16, window=8, max_len=64)
    runner = FakeRunner(sched)
    for i in range(24):
        prefix = make_request("p", 24, 1, seed=rng.randint(0, 2)).prompt_token_ids[: rng.choice([8, 12, 16, 24])]
        tail = [rng.randint(5, 50) for _ in range(rng.randint(1, 10))]
        sched.add_request(Request(f"r{i}", prefix + tail, SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True),
                                  EOS, [], block_hasher=BlockHasher(BS)))

    def one_group_per_block(step, so):
        owner = {}
        for g, manager in sched.kv_cache_manager.attention_managers:
            for blocks in manager.req_to_blocks.values():
                for b in blocks:
                    if not b.is_null:
                        assert owner.setdefault(b.block_id, g) == g, f"block {b.block_id} in groups {owner[b.block_id]} and {g}"

    run_to_completion(sched, runner, one_group_per_block)
    assert sched.num_preemptions > 0 and sched.kv_cache_manager.stats.hits[1] > 0
    assert_everything_free(sched)
