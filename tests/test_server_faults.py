"""Faults inside the server, through a real uvicorn server and the official client: a
fault in the model fails the requests of its step with 500 and the next request works;
an engine that died answers 503, and /health says so.

The server runs in this process (uvicorn in a thread) so that the faults can be put
into its engine; everything else is as `vlmserve serve` runs it."""

from __future__ import annotations

import threading
import time

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
    model = engine.engine.engine_core.runner.model
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
    assert engine.stats.blocks_in_use == [0, 0]


def test_an_engine_that_died_answers_503(served):
    engine, base = served
    scheduler = engine.engine.engine_core.scheduler
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


DYING_SERVER = """
import logging
import sys
from vlmserve.engine.async_llm import AsyncLLM
from vlmserve.entrypoints.cli import build_parser, engine_args_from
from vlmserve.entrypoints.openai.api_server import OpenAIServer, serve_engine_app

args = build_parser().parse_args(["serve", "--model", sys.argv[1], "--port", sys.argv[2], "--num-kv-blocks", "256"])
logging.basicConfig(level="INFO")  # as `vlmserve serve` does
engine = AsyncLLM(engine_args_from(args))
engine.engine.engine_core.scheduler.schedule = lambda: 1 / 0  # a bug that kills the engine loop
serve_engine_app(engine, OpenAIServer(engine, "tiny").build_app(), args)
"""


def test_a_server_whose_engine_died_exits_non_zero(qwen25_path):
    """What `vlmserve serve` runs, with a bug put into its scheduler: the request in flight
    gets a 503, then the process exits with code 1 for its supervisor to restart it."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", DYING_SERVER, qwen25_path, str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        with pytest.raises(openai.APIStatusError) as info:
            ask(base)
        assert info.value.status_code == 503 and "engine" in info.value.message
        assert proc.wait(timeout=60) == 1
        assert "the engine died" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
