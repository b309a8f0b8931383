"""Hybrid model: vlmserve vs transformers on a tiny random-weight Qwen3.5 (Gated DeltaNet +
gated attention, Qwen3-VL vision tower) — greedy tokens equal, logprobs within 1e-4."""

import pytest

from test_qwen2_5_vl_parity import IMG_A, IMG_B, LONG_TEXT, check, greedy, request, run_together
from vlmserve import LLM, SamplingParams

CASES = {
    "text": (LONG_TEXT, []),
    "one_image": ("Describe the image.", [IMG_A]),
    "two_images": ("What is in this picture? " * 2, [IMG_A, IMG_B]),
}


@pytest.fixture(scope="module")
def llm(qwen35_path):
    return LLM(qwen35_path, num_kv_blocks=256)


def assert_all_free(llm):
    stats = llm.engine.stats()
    assert not any(stats.blocks_in_use.values()) and stats.state_slots_in_use == 0
    kv = llm.engine.engine_core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.config.num_blocks - 1
    pool = kv.states.pool
    assert not pool.pending and not pool.pinned
    assert len(pool.free) + len(pool.snapshots) == kv.config.num_state_slots


def test_kv_cache_groups_of_a_hybrid_model(llm):
    kv = llm.engine.engine_core.scheduler.kv_cache_manager
    kinds = [type(g.spec).__name__ for g in kv.config.groups]
    assert sorted(kinds) == ["FullAttentionSpec", "MambaSpec"]
    assert kv.config.num_state_slots > llm.engine.engine_core.scheduler.config.max_num_seqs


@pytest.mark.parametrize("case", CASES)
def test_single_request_matches_transformers(llm, hf_qwen35, case):
    text, images = CASES[case]
    out = llm.generate(request(hf_qwen35, text, images), greedy(prompt_logprobs=-1))[0]
    check(out, hf_qwen35, text, images, 16, prompt_logprobs=True)
    assert_all_free(llm)


def test_eight_mixed_requests_together(llm, hf_qwen35):
    from test_qwen2_5_vl_parity import mixed_requests

    specs, prompts, params = mixed_requests(hf_qwen35)
    outs = run_together(llm, prompts, params)
    for out, (text, images, n) in zip(outs, specs):
        check(out, hf_qwen35, text, images, n, prompt_logprobs=True)
    assert_all_free(llm)


def test_chunked_prefill_through_an_image(qwen35_path, hf_qwen35):
    llm = LLM(qwen35_path, num_kv_blocks=256, max_num_batched_tokens=5)
    text, images = CASES["two_images"]
    out = llm.generate(request(hf_qwen35, text, images), greedy(prompt_logprobs=-1))[0]
    check(out, hf_qwen35, text, images, 16, prompt_logprobs=True)
    assert llm.engine.engine_core.runner.encoder_runs == 2
    assert_all_free(llm)


def test_preemption_with_a_tiny_kv_cache(qwen35_path, hf_qwen35):
    from test_qwen2_5_vl_parity import mixed_requests

    llm = LLM(qwen35_path, num_kv_blocks=14, max_num_seqs=8)
    specs, prompts, params = mixed_requests(hf_qwen35)
    outs = run_together(llm, prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    for out, (text, images, n) in zip(outs, specs):
        check(out, hf_qwen35, text, images, n, prompt_logprobs=True)
    assert_all_free(llm)


def system_prompt_request(hf, question, images):
    system = "You are a helpful assistant. Answer the question about the picture in one sentence. " * 2
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]
    prompt = hf.processor.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": content}], add_generation_prompt=True
    )
    return {"prompt": prompt, "multi_modal_data": {"image": images}}, prompt


def test_requests_about_one_picture_together_share_its_recurrent_state(qwen35_path, hf_qwen35):
    """Submitted together, the second request waits a step for the state of the prefix the
    first computes (instead of computing the picture again), and both give transformers'
    answers."""
    llm = LLM(qwen35_path, num_kv_blocks=256)
    pairs = [system_prompt_request(hf_qwen35, question, [IMG_A])
             for question in ("Describe the image.", "How many shapes are there?")]
    outs = llm.generate([req for req, _ in pairs], greedy(12))
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens >= max(f.end for f in _features(llm, pairs[1][0])) // 16 * 16
    for out, (_, prompt) in zip(outs, pairs):
        assert out.outputs[0].token_ids == hf_qwen35.generate(prompt, [IMG_A], 12)[0]
    assert_all_free(llm)


@pytest.mark.parametrize("images", [[IMG_A], [IMG_A, IMG_B]], ids=["one_image", "two_images"])
def test_prefix_cache_hits_for_the_recurrent_state(qwen35_path, hf_qwen35, images):
    """Same system prompt + picture(s), another question: the second request resumes
    from a snapshot of the DeltaNet state (and cached attention blocks), with the vision
    tower loaded — and still gives transformers' answer."""
    llm = LLM(qwen35_path, num_kv_blocks=256)
    first_req, first_prompt = system_prompt_request(hf_qwen35, "Describe the image.", images)
    second_req, second_prompt = system_prompt_request(hf_qwen35, "How many shapes are there?", images)
    first = llm.generate(first_req, greedy(12))[0]
    second = llm.generate(second_req, greedy(12))[0]
    computed_first = first.num_prompt_tokens - first.num_cached_tokens
    computed_second = second.num_prompt_tokens - second.num_cached_tokens
    print(f"prompt tokens computed: first {computed_first} of {first.num_prompt_tokens}, "
          f"second {computed_second} of {second.num_prompt_tokens}")
    assert first.num_cached_tokens == 0
    # the hit reaches past the last image: everything up to the question is reused
    assert second.num_cached_tokens >= max(f.end for f in _features(llm, second_req)) // 16 * 16
    assert computed_second < computed_first
    stats = llm.engine.stats()
    assert all(hits > 0 for hits in stats.prefix_cache_hits)  # in the attention and the recurrent group
    for out, prompt in ((first, first_prompt), (second, second_prompt)):
        ref_tokens, ref_lp = hf_qwen35.generate(prompt, images, 12)
        assert out.outputs[0].token_ids == ref_tokens
        chosen = [e.logprobs[0] for e in out.outputs[0].logprobs]
        expected = [ref_lp[i, t].item() for i, t in enumerate(ref_tokens)]
        assert max(abs(a - b) for a, b in zip(chosen, expected)) < 1e-4
    assert_all_free(llm)


def _features(llm, req):
    return llm.engine.input_processor.process("probe", req, SamplingParams()).mm_features


def test_recurrent_state_stays_constant_size(qwen35_path):
    """However long the sequence, a request holds one recurrent-state slot."""
    llm = LLM(qwen35_path, num_kv_blocks=256)
    engine = llm.engine
    engine.add_request("long", "Hello world " * 20, SamplingParams(max_tokens=60, ignore_eos=True))
    peak_slots = peak_blocks = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        peak_slots = max(peak_slots, stats.state_slots_in_use)
        peak_blocks = max(peak_blocks, *stats.blocks_in_use.values())
    assert peak_slots == 1
    assert peak_blocks > 5  # attention keeps growing with the sequence
    assert_all_free(llm)


def test_one_memory_budget_shared_by_every_group(qwen35_path):
    """kv_cache_memory_gb is the whole cache: recurrent state slots (one per running
    request, plus prefix-cache snapshots within a quarter of the budget) and attention
    blocks together fill it, and the tensors really allocated stay within it."""
    budget_gb, seqs = 0.01, 4
    llm = LLM(qwen35_path, kv_cache_memory_gb=budget_gb, max_num_seqs=seqs)
    runner = llm.engine.engine_core.runner
    config = llm.engine.engine_core.scheduler.kv_cache_manager.config
    storages = {}
    for tensors in runner.kv_caches.values():
        for t in tensors:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    recurrent = {t.untyped_storage().data_ptr() for layer in runner.plan.recurrent_layers for t in runner.kv_caches[layer]}
    state_bytes = sum(n for p, n in storages.items() if p in recurrent)
    total = sum(storages.values())
    budget = budget_gb * (1 << 30)
    assert 0.9 * budget < total <= budget
    assert seqs < config.num_state_slots <= 9 * seqs  # running requests + snapshots
    snapshot_bytes = state_bytes * (config.num_state_slots - seqs) / config.num_state_slots
    assert snapshot_bytes <= budget / 4
    assert config.num_blocks > 1 and total - state_bytes > budget / 2  # attention gets the rest


def test_by_default_a_small_budget_runs_fewer_requests_instead_of_refusing_to_start(llm, qwen35_path, hf_qwen35,
                                                                                      caplog):
    """max_num_seqs left unset, with a KV budget whose half holds the recurrent states of 3
    requests (as 0.5 GB holds a released Qwen3.5's 5; attention blocks given apart): the
    engine starts, runs 3 at once, says so, and 8 requests queued together all give
    transformers' answers."""
    from test_qwen2_5_vl_parity import mixed_requests

    from vlmserve.engine.engine_core import state_bytes_per_request

    per_request = state_bytes_per_request(llm.engine.engine_core.scheduler.kv_cache_manager.config.groups)
    assert per_request > 0
    small = LLM(qwen35_path, kv_cache_memory_gb=7 * per_request / (1 << 30), num_kv_blocks=256)
    assert small.engine.engine_core.scheduler.config.max_num_seqs == 3
    assert "running at most 3 requests at once" in caplog.text
    specs, prompts, params = mixed_requests(hf_qwen35)
    engine, peak = small.engine, 0
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    done = {}
    while engine.has_unfinished_requests():
        done.update((out.request_id, out) for out in engine.step() if out.finished)
        peak = max(peak, engine.stats().state_slots_in_use)  # slots of running requests
    assert peak == 3
    for i, (text, images, n) in enumerate(specs):
        check(done[f"r{i}"], hf_qwen35, text, images, n, prompt_logprobs=True)
    assert_all_free(small)


def test_a_budget_too_small_for_the_recurrent_states_says_what_to_change(qwen35_path):
    """More running requests than the budget's recurrent state slots hold: one error naming
    the numbers and both ways out, at construction."""
    with pytest.raises(ValueError, match=r"max_num_seqs=4096 requests .* need [0-9.]+ GB .* kv_cache_memory_gb=0.01: "
                                         r"lower max_num_seqs or raise kv_cache_memory_gb"):
        LLM(qwen35_path, kv_cache_memory_gb=0.01, max_num_seqs=4096)
