"""Asynchronous scheduling: one step in flight while the host schedules and prepares the
next. It gives the tokens of synchronous steps (greedy and seeded, with pictures,
preemption, prefix hits, chunked prefill, stop tokens, hybrid models), the host really
works while the forward runs, and the host's work a decode step does not grow with the
batch in device operations (the kind of per-request work that makes a GPU wait)."""

from __future__ import annotations

import threading

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from test_qwen2_5_vl_parity import mixed_requests, run_together
from vlmserve import LLM, SamplingParams


def tokens_of(llm, prompts, params):
    return [o.outputs[0].token_ids for o in run_together(llm, prompts, params)]


@pytest.mark.parametrize("settings", [
    {"num_kv_blocks": 256},
    {"num_kv_blocks": 24, "max_num_seqs": 8},  # preemption, several times
    {"num_kv_blocks": 256, "max_num_batched_tokens": 40},  # chunked prefill through the pictures
], ids=["roomy", "preempting", "chunked"])
def test_the_tokens_of_synchronous_steps(qwen25_path, hf_qwen25, settings):
    specs, prompts, params = mixed_requests(hf_qwen25)
    seeded = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=n) for i, (_, _, n) in enumerate(specs)]
    stopped = [SamplingParams(temperature=0, max_tokens=n, stop_token_ids=[219, 374]) for _, _, n in specs]
    runs = {}
    for mode in (False, True):
        llm = LLM(qwen25_path, async_scheduling=mode, **settings)
        assert llm.engine.engine_core.async_scheduling is mode
        runs[mode] = [tokens_of(llm, prompts, p) for p in (params, seeded, stopped)]
        runs[mode].append(tokens_of(llm, prompts, params))  # again: prefix and encoder cache hits
        assert not any(llm.engine.stats().blocks_in_use.values())
    assert runs[True] == runs[False]
    assert any(len(t) < n for t, (_, _, n) in zip(runs[True][2], specs))  # the stop tokens did stop some


def test_a_hybrid_model_gives_the_tokens_of_synchronous_steps(qwen35_path, hf_qwen35):
    specs, prompts, params = mixed_requests(hf_qwen35)
    runs = [tokens_of(LLM(qwen35_path, num_kv_blocks=64, max_num_seqs=6, async_scheduling=mode), prompts, params)
            for mode in (False, True)]
    assert runs[0] == runs[1]


def test_the_host_schedules_the_next_step_while_the_forward_runs(qwen25_path):
    """The forward of the k-th step waits (up to 10 s) until the host has scheduled step
    k + 1: with one step in flight it has, while that forward still runs."""
    llm = LLM(qwen25_path, num_kv_blocks=256, async_scheduling=True)
    core = llm.engine.engine_core
    scheduled, overlapped, forwards = threading.Condition(), [], []
    schedule, forward = core.scheduler.schedule, core.runner.model.forward
    count = [0]

    def counted_schedule():
        with scheduled:
            count[0] += 1
            scheduled.notify_all()
        return schedule()

    def waiting_forward(*args, **kwargs):
        forwards.append(1)
        if len(forwards) == 4:  # a decode step, with more to come
            with scheduled:
                overlapped.append(scheduled.wait_for(lambda: count[0] >= 5, timeout=10))
        return forward(*args, **kwargs)

    core.scheduler.schedule, core.runner.model.forward = counted_schedule, waiting_forward
    try:
        llm.generate(["Tell me a story"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        core.scheduler.schedule, core.runner.model.forward = schedule, forward
    assert overlapped == [True]


class CountOps(TorchDispatchMode):
    """Device operations this thread issues (the engine's: the forward runs on its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def host_ops_per_decode_step(path: str, batch: int) -> float:
    llm = LLM(path, num_kv_blocks=512, max_num_seqs=batch, async_scheduling=True)
    prompts = [f"Tell me a story about {i}" for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"count-{i}", prompt, params)
    for _ in range(4):  # the prompts, and the first decodes
        engine.step()
    counted = CountOps()
    with counted:
        for _ in range(8):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    return counted.count / 8


def test_the_hosts_device_operations_a_decode_step_do_not_grow_with_the_batch(qwen25_path):
    """On a GPU every operation the host issues costs a launch, and one that reads the
    device back stops it until the device is done: a step's host work issues the same
    operations for 2 requests as for 32, none per request."""
    few, many = host_ops_per_decode_step(qwen25_path, 2), host_ops_per_decode_step(qwen25_path, 32)
    assert few > 0 and many == few, (few, many)


def test_a_fault_in_a_step_fails_its_requests_and_undoes_the_one_behind_it(qwen25_path):
    """The third forward fails (two requests' step). The step queued behind it ran on what it
    left: a request that joined there starts again and ends with the tokens it would have
    had; the failed step's requests end with an error; nothing is held after."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = LLM(qwen25_path, num_kv_blocks=256, async_scheduling=False).generate(["A story"], params)[0]
    llm = LLM(qwen25_path, num_kv_blocks=256, async_scheduling=True)
    engine = llm.engine
    runner = engine.engine_core.runner
    forward, calls = runner.model.forward, []

    def failing_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated fault")
        return forward(*args, **kwargs)

    runner.model.forward = failing_third
    done = {}

    def step() -> None:
        done.update((out.request_id, out) for out in engine.step() if out.finished)

    try:
        engine.add_request("first", "Hello there", params)
        step()  # its prompt (forward 1)
        step()  # its first decode (forward 2)
        engine.add_request("second", "Good morning", params)
        step()  # a decode and a prompt: forward 3, which fails
        engine.add_request("later", "A story", params)
        while engine.has_unfinished_requests():  # "later" joins the step behind it
            step()
    finally:
        runner.model.forward = forward
    for rid in ("first", "second"):
        assert done[rid].outputs[0].finish_reason == "error" and "simulated fault" in done[rid].error
    assert done["later"].outputs[0].token_ids == expected.outputs[0].token_ids
    assert not any(engine.stats().blocks_in_use.values())
