"""Faults inside the server, through a real uvicorn server and the official client: a
fault in the model fails the requests of its step with 500 and the next request works;
an engine that died answers 503, and /health says so (there, the server runs in this
process with the engine core in-process, so that the faults can be put into it). And a
real `vlmserve serve` whose engine core process is killed exits non-zero."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from test_openai_server import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def served(qwen25_path):
    from vlmserve.engine.args import EngineArgs
    from vlmserve.engine.async_llm import AsyncLLM
    from vlmserve.entrypoints.openai.api_server import OpenAIServer

    engine = AsyncLLM(EngineArgs(model=qwen25_path, num_kv_blocks=256))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(OpenAIServer(engine, "tiny").build_app(), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    yield engine, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def ask(base: str, stream: bool = False):
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0)
    if stream:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    return client.chat.completions.create(**kwargs).choices[0].message.content


def test_a_fault_in_the_model_is_a_500_and_the_next_request_works(served):
    engine, base = served
    model = engine._engine.engine_core.runner.model
    forward = model.forward
    model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("simulated fault"))
    try:
        with pytest.raises(openai.InternalServerError) as info:
            ask(base)
        assert info.value.status_code == 500 and "simulated fault" in info.value.message
        with pytest.raises(openai.APIError, match="simulated fault"):  # in the middle of a stream: an error event
            ask(base, stream=True)
    finally:
        model.forward = forward
    assert ask(base) and ask(base, stream=True)
    assert httpx.get(base + "/health").status_code == 200
    assert not any(engine.stats.blocks_in_use.values())


def test_an_engine_that_died_answers_503(served):
    engine, base = served
    scheduler = engine._engine.engine_core.scheduler
    scheduler.schedule = lambda: (_ for _ in ()).throw(RuntimeError("a bug in the scheduler"))  # kills the loop
    with pytest.raises(openai.APIStatusError) as info:
        ask(base)
    assert info.value.status_code == 503 and "engine" in info.value.message
    health = httpx.get(base + "/health")
    assert health.status_code == 503
    with pytest.raises(openai.APIStatusError) as info:
        ask(base)
    assert info.value.status_code == 503
    assert info.value.body["type"]  # OpenAI's error JSON


def children_of(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_a_server_whose_engine_core_died_exits_non_zero(qwen25_path):
    """`vlmserve serve` whose engine core process is killed while a request streams: the
    stream ends with an error event and [DONE], and the server exits with code 1 for its
    supervisor to restart it."""
    from test_openai_server import Server

    s = Server(qwen25_path, "--num-kv-blocks", "512", "--engine-process")
    try:
        (core,) = [pid for pid in children_of(s.proc.pid)
                   if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        events = []
        with httpx.stream("POST", s.base + "/v1/completions", timeout=120,
                          json={"prompt": "a", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break
            os.kill(core, signal.SIGKILL)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "engine" in json.loads(events[-2])["error"]["message"]
        assert s.proc.wait(timeout=60) == 1
        assert "the engine died" in "".join(s.log)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
