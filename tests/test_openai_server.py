"""The OpenAI-compatible server, as a real uvicorn process, driven by the official client."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import make_image, png_bytes
from vlmserve import LLM, SamplingParams

IMG = make_image(130, 100, seed=11)
KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vlmserve serve` (or `vlmserve ui`) as a real process; model None: the shipped one."""

    def __init__(self, model: str | None, *extra: str, command: str = "serve", start_timeout: float = 120) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vlmserve.entrypoints.cli", command, "--port", str(self.port),
               "--served-model-name", "tiny", *extra]
        if model is not None:
            cmd += ["--model", model]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        threading.Thread(target=self._read_log, daemon=True).start()
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(self.log))
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        try:  # not left running (with the Ray cluster it may have started) past the failure
            self.stop()
        except subprocess.TimeoutExpired:
            self.proc.kill()
        raise RuntimeError("server did not come up:\n" + "".join(self.log))

    def _read_log(self):
        for line in self.proc.stdout:
            self.log.append(line)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0)

    def metric(self, name: str) -> float:
        text = httpx.get(self.base + "/metrics").text
        # name may carry labels, e.g. 'request_success_total{finished_reason="abort"}': the
        # sum over the series that have them (and any others: a replica's, say)
        base, _, labels = name.partition("{")
        wanted = set(re.findall(r'(\w+)="([^"]*)"', labels))
        pattern = rf"^(?:vlmserve|vllm):{re.escape(base)}(?:{{([^}}]*)}})? (\S+)$"
        return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M)
                   if wanted <= set(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")))

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:  # beyond the server's 30 s drain
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served-media")
    (folder / "pic.png").write_bytes(png_bytes(IMG))
    return folder


@pytest.fixture(scope="module")
def server(qwen25_path, media_dir):
    s = Server(qwen25_path, "--api-key", KEY, "--allowed-local-media-path", str(media_dir), "--max-request-mb", "1",
               "--num-kv-blocks", "512")
    yield s
    s.stop()


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


def image_chat(url: str, text: str = "Describe the image.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]


@pytest.mark.slow
def test_chat_with_images_streamed_and_not_equal_to_the_llm_api(server, qwen25_path, media_dir):
    client = server.client()
    kwargs = dict(model="tiny", temperature=0.8, top_p=0.9, seed=1234, max_tokens=16)
    by_data = client.chat.completions.create(messages=image_chat(data_url(IMG)), **kwargs)
    by_file = client.chat.completions.create(messages=image_chat(str(media_dir / "pic.png")), **kwargs)
    stream = client.chat.completions.create(messages=image_chat(data_url(IMG)), stream=True,
                                            stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = by_data.choices[0].message.content
    streamed_file = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=image_chat(str(media_dir / "pic.png")), stream=True, **kwargs) if c.choices)
    assert text and streamed == text == by_file.choices[0].message.content == streamed_file
    assert chunks[-1].usage.completion_tokens == by_data.usage.completion_tokens
    llm = LLM(qwen25_path, num_kv_blocks=512)
    ref = llm.chat(image_chat(data_url(IMG)), SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16))[0]
    assert ref.outputs[0].text == text
    usage = by_data.usage
    assert usage.prompt_tokens == ref.num_prompt_tokens
    assert usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # the same picture again: its blocks come from the prefix cache
    assert by_file.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.slow
def test_n_stop_logprobs(server):
    client = server.client()
    two = client.chat.completions.create(model="tiny", messages=image_chat(data_url(IMG)), n=2, temperature=1.0,
                                         seed=7, max_tokens=12)
    assert len(two.choices) == 2 and [c.index for c in two.choices] == [0, 1]
    free = client.completions.create(model="tiny", prompt="Hello world", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = text[6:9]
    cut = client.completions.create(model="tiny", prompt="Hello world", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    hello = [{"role": "user", "content": "Hello"}]
    chat_text = client.chat.completions.create(model="tiny", messages=hello, max_tokens=20, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].message.content
    chat_stop = chat_text[6:9]
    chat_cut = client.chat.completions.create(model="tiny", messages=hello, max_tokens=20, temperature=0,
                                              stop=chat_stop, extra_body={"ignore_eos": True}).choices[0]
    assert chat_cut.message.content == chat_text[: chat_text.index(chat_stop)] and chat_cut.finish_reason == "stop"
    lp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
                                        logprobs=True, top_logprobs=3, temperature=0)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


@pytest.mark.slow
def test_errors_have_the_right_status_and_the_next_request_works(server):
    client = server.client()
    ok = dict(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})
    reference = client.chat.completions.create(**ok).choices[0].message.content
    cases = [
        (server.client("wrong-key"), dict(ok), openai.AuthenticationError, 401, "API key"),
        (client, dict(ok, model="gpt-4o"), openai.NotFoundError, 404, "does not exist"),
        (client, dict(ok, messages=image_chat("data:image/png;base64,iVBORw0KGgo=")), openai.BadRequestError, 400,
         "not a readable image"),
        (client, dict(ok, messages=image_chat("/etc/passwd")), openai.BadRequestError, 400, "outside the allowed"),
        (client, dict(ok, messages=image_chat("http://example.com/a.png")), openai.BadRequestError, 400, "not enabled"),
        (client, dict(ok, messages=[{"role": "user", "content": "Hello " * 6000}]), openai.BadRequestError, 400,
         "context"),
        (client, dict(ok, temperature=-1), openai.BadRequestError, 400, "temperature"),
        (client, dict(ok, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "nosuchtype"}}}}}), openai.BadRequestError, 400,
         "'type' must be one of"),
        (client, dict(ok, messages=image_chat(data_url(make_image(900, 900, 1)) * 1)), openai.APIStatusError, 413,
         "limit"),
    ]
    for c, kwargs, error, status, message in cases:
        with pytest.raises(error) as info:
            c.chat.completions.create(**kwargs)
        assert info.value.status_code == status, (status, info.value)
        assert message in str(info.value)
        body = info.value.body if isinstance(info.value.body, dict) else {}
        assert body.get("message") or body.get("error")  # OpenAI's error JSON
        after = client.chat.completions.create(**ok)  # the next request: served in full, as before
        assert after.usage.completion_tokens == 4 and after.choices[0].message.content == reference


@pytest.mark.slow
def test_concurrent_streams_hangups_and_health_under_load(server):
    async def stream_one(client, i, hang_up):
        # the ones that hang up asked for far more than they wait for: only an abort frees them
        stream = await client.chat.completions.create(
            model="tiny", messages=image_chat(data_url(make_image(64 + i, 64, i))), max_tokens=2000 if hang_up else 40,
            stream=True, extra_body={"ignore_eos": True})
        text, n = "", 0
        async for chunk in stream:
            n += 1
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if hang_up and n == 3:
                await stream.close()  # the client goes away mid-stream
                return None
        return text

    def health_latencies(stop: threading.Event, times: list[float]) -> None:
        # a thread of its own: the test's event loop is busy reading 40 streams, and its
        # delays are not the server's
        with httpx.Client() as h:
            while not stop.is_set():
                t = time.perf_counter()
                r = h.get(server.base + "/health")
                times.append(time.perf_counter() - t)
                assert r.status_code == 200
                time.sleep(0.05)

    async def main():
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0)
        await client.models.list()  # the client's first call imports and sets up; not under test
        return await asyncio.gather(*[stream_one(client, i, hang_up=i >= 32) for i in range(40)])

    aborted_before = server.metric('request_success_total{finished_reason="abort"}')
    stop, latencies = threading.Event(), []
    health = threading.Thread(target=health_latencies, args=(stop, latencies))
    health.start()
    try:
        results = asyncio.run(main())
    finally:
        stop.set()
        health.join()
    assert all(r for r in results[:32]) and all(r is None for r in results[32:])
    latencies.sort()
    # the API stays responsive while the engine computes: half the health checks within 100 ms
    # and none past 2 s, on any machine (measured: median 5-20 ms, p90 15-100 ms; on 2 busy
    # cores one in ~25 takes a few 100 ms; an event loop blocked by the engine takes seconds)
    assert latencies[len(latencies) // 2] < 0.1 and latencies[-1] < 2.0
    deadline = time.time() + 10
    while time.time() < deadline and (server.metric("kv_cache_blocks_in_use") or server.metric("num_requests_running")):
        time.sleep(0.2)
    assert server.metric("kv_cache_blocks_in_use") == 0
    assert server.metric("num_requests_running") == 0 and server.metric("num_requests_waiting") == 0
    assert server.metric('request_success_total{finished_reason="abort"}') - aborted_before >= 8
    assert server.metric("time_to_first_token_seconds_count") >= 32
    assert server.metric("encoder_cache_misses_total") >= 32


@pytest.mark.slow
def test_queue_full_then_a_slot_frees_and_graceful_shutdown(qwen25_path):
    # a drain long enough for the rest of a 2000-token answer on a loaded machine (the default
    # 30 s cut one off once, beside the other test worker's kernel builds); the deadline's own
    # behaviour is tested in test_server_robustness.py
    s = Server(qwen25_path, "--max-pending-requests", "2", "--max-num-seqs", "2", "--drain-timeout", "600")

    max_tokens = 2000  # long enough that neither finishes before the third request arrives
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
    results: list[tuple[int, int]] = []

    def long_request():
        r = httpx.post(s.base + "/v1/completions", json=body, timeout=600)
        results.append((r.status_code, r.json()["usage"]["completion_tokens"]))

    runner = threading.Thread(target=long_request)
    runner.start()
    leaver = httpx.Client(timeout=120)
    stream = leaver.stream("POST", s.base + "/v1/completions", json={**body, "stream": True})
    stream.__enter__()
    deadline = time.time() + 30
    while time.time() < deadline and s.metric("num_requests_running") < 2:  # both admitted, not a fixed sleep
        time.sleep(0.02)
    assert s.metric("num_requests_running") == 2
    busy = httpx.post(s.base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert busy.status_code == 429 and "try again" in busy.json()["error"]["message"]
    assert busy.json()["error"]["type"]  # OpenAI's error JSON
    # one client hangs up: its request is aborted, and the next request gets its place
    stream.__exit__(None, None, None)
    leaver.close()
    deadline = time.time() + 30
    while time.time() < deadline and s.metric("num_requests_running") > 1:
        time.sleep(0.02)
    # ignore_eos: sampled from a random model, the answer could otherwise end after 1 token
    ok = httpx.post(s.base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "ignore_eos": True},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    # SIGTERM while a request is in flight: it finishes, then the process exits
    code = s.stop(signal.SIGTERM, timeout=600)
    runner.join()
    assert results == [(200, max_tokens)]  # finished in full
    assert code in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has drained


@pytest.mark.slow
def test_more_of_the_api_equals_the_llm_api(server, qwen25_path):
    """Several pictures in a message, a multi-turn chat with a system prompt, a video,
    top_k, max_completion_tokens, stop_token_ids, response_format text, a streamed
    completion, /version: each as the LLM API answers the same request."""
    from media_files import video_bytes

    client = server.client()
    llm = LLM(qwen25_path, num_kv_blocks=512)
    two = [{"type": "image_url", "image_url": {"url": data_url(make_image(60 + 20 * i, 50, 30 + i))}}
           for i in range(2)]
    clip = "data:video/mp4;base64," + base64.b64encode(video_bytes("mp4", frames=8, fps=4)).decode()
    conversations = [
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": [*two, {"type": "text", "text": "Compare them."}]},
         {"role": "assistant", "content": "They differ."},
         {"role": "user", "content": "How?"}],
        [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}},
                                      {"type": "text", "text": "What happens?"}]}],
    ]
    for messages in conversations:
        got = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8,
                                             response_format={"type": "text"})
        ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
        assert got.choices[0].message.content == ref.outputs[0].text
        assert got.usage.prompt_tokens == ref.num_prompt_tokens
    assert llm.chat(conversations[1], SamplingParams(max_tokens=1))[0].num_prompt_tokens > 20  # the clip's tokens

    hello = [{"role": "user", "content": "Hello"}]
    greedy = llm.chat(hello, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    top1 = client.chat.completions.create(model="tiny", messages=hello, temperature=1.5, seed=3,
                                          max_completion_tokens=6, extra_body={"ignore_eos": True, "top_k": 1})
    assert top1.choices[0].message.content == greedy.text  # top_k=1 is greedy at any temperature
    assert top1.usage.completion_tokens == 6 and top1.choices[0].finish_reason == "length"
    stop_id = greedy.token_ids[3]
    stopped = client.chat.completions.create(model="tiny", messages=hello, temperature=0, max_tokens=6,
                                             extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    first_stop = greedy.token_ids.index(stop_id)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == first_stop + 1

    plain = client.completions.create(model="tiny", prompt="Once upon", max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=10, temperature=0, stream=True) if c.choices)
    assert streamed == plain.choices[0].text
    from vlmserve import __version__

    assert httpx.get(server.base + "/version").json() == {"version": __version__}


@pytest.mark.slow
def test_resolution_per_request(server):
    """detail and mm_processor_kwargs change the picture's size, hence its tokens and its hash."""
    client = server.client()
    big = data_url(make_image(448, 448, 77))
    small = data_url(make_image(56, 56, 78))

    def prompt_tokens(url, detail=None, **kwargs):
        part = {"url": url} if detail is None else {"url": url, "detail": detail}
        r = client.chat.completions.create(
            model="tiny", max_tokens=1, extra_body={"mm_processor_kwargs": kwargs} if kwargs else None,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": part},
                                                   {"type": "text", "text": "Describe the image."}]}])
        return r.usage.prompt_tokens

    auto = prompt_tokens(big)
    assert prompt_tokens(big, "high") == auto
    wide = prompt_tokens(big, "high", max_pixels=448 * 448)  # above the checkpoint's own cap
    low = prompt_tokens(big, "low", max_pixels=448 * 448)  # "low" caps it again
    capped = prompt_tokens(big, max_pixels=112 * 112)
    assert capped < low < wide and auto < wide
    assert prompt_tokens(small, min_pixels=224 * 224) > prompt_tokens(small)


@pytest.mark.slow
def test_metrics_lists_every_series(server):
    client = server.client()
    url = data_url(make_image(120, 90, 55))
    for system in ([], [{"role": "system", "content": "Be brief."}], []):
        # the same picture three times: decoded once (processor cache), encoded once
        # (then the encoder cache, behind a different system prompt), then a prefix hit
        client.chat.completions.create(model="tiny", max_tokens=3, messages=system + image_chat(url))
    text = httpx.get(server.base + "/metrics").text
    # vLLM's names and labels for what vLLM also reports: its dashboards work unchanged
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "time_to_first_token_seconds_bucket",
                 "time_per_output_token_seconds_count", "request_time_per_output_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_sum",
                 "request_queue_time_seconds_count", "request_prompt_tokens_bucket",
                 "request_generation_tokens_count"):
        assert re.search(rf'^vllm:{name}{{.*model_name="tiny".*}} ', text, re.M), name
        assert re.search(rf'^vllm:{name}{{.*engine="0".*}} ', text, re.M), name
    assert re.search(r'^vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} ', text,
                     re.M) or re.search(r'^vllm:request_success_total{.*finished_reason="length".*} ', text, re.M)
    assert re.search(r'^vllm:time_to_first_token_seconds_bucket{engine="0",(replica="[^"]+",)?le="0.001",'
                     r'model_name="tiny"', text, re.M)
    # vlmserve's own keep their names
    for name in ("kv_cache_blocks_in_use", "prefix_cache_group_queries_total", "encoder_cache_misses_total",
                 "processor_cache_misses_total", "state_slots_in_use"):
        assert re.search(rf"^vlmserve:{name}", text, re.M), name
    for name in ("prefix_cache_hit_rate", "encoder_cache_hits_total", "processor_cache_hits_total",
                 "prompt_tokens_total", "generation_tokens_total", "e2e_request_latency_seconds_count"):
        assert server.metric(name) > 0, name


@pytest.mark.slow
def test_serve_without_a_model_answers_with_the_shipped_one_and_ctrl_c_drains():
    """`vlmserve serve` with no --model: the shipped model answers a sample question
    right; Ctrl-C while a request runs lets it finish in full, then the process exits."""
    import json
    from pathlib import Path

    from vlmserve.training.shapes import normalize_answer

    samples = Path(__file__).resolve().parent.parent / "samples"
    expected = next(a for a in json.loads((samples / "answers.json").read_text())
                    if a["file"] == "shapes3.jpg" and a["kind"] == "caption")
    s = Server(None)
    try:
        url = "data:image/jpeg;base64," + base64.b64encode((samples / "shapes3.jpg").read_bytes()).decode()
        r = s.client().chat.completions.create(model="tiny", temperature=0, max_tokens=64, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": expected["question"]}]}])
        assert normalize_answer(r.choices[0].message.content) == normalize_answer(expected["answer"])
        results = []
        long = threading.Thread(target=lambda: results.append(httpx.post(
            s.base + "/v1/completions", json={"prompt": "a", "max_tokens": 400, "ignore_eos": True}, timeout=120)))
        long.start()
        deadline = time.time() + 30
        while time.time() < deadline and s.metric("num_requests_running") < 1:
            time.sleep(0.02)
        code = s.stop(signal.SIGINT, timeout=120)
        long.join()
        assert results[0].status_code == 200 and results[0].json()["usage"]["completion_tokens"] == 400
        assert code in (0, -signal.SIGINT, 130), "".join(s.log[-40:])
    finally:
        if s.proc.poll() is None:
            s.stop()


@pytest.mark.slow
def test_a_client_that_hangs_up_on_a_plain_request_aborts_it(server):
    """Not streamed: the server notices the closed connection while waiting for the
    result, aborts the request and frees its blocks."""
    aborted = server.metric('request_success_total{finished_reason="abort"}')
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4000, "ignore_eos": True}).encode()
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    try:
        deadline = time.time() + 30
        while time.time() < deadline and server.metric("num_requests_running") != 1:  # running: now hang up
            time.sleep(0.02)
        assert server.metric("num_requests_running") == 1
    finally:
        conn.close()  # (also when the assertion failed: the request must not outlive this test)
    deadline = time.time() + 15  # (replicas report their series every second)
    while time.time() < deadline and (server.metric("num_requests_running") or
                                      server.metric('request_success_total{finished_reason="abort"}') == aborted):
        time.sleep(0.1)
    assert server.metric("num_requests_running") == 0 and server.metric("kv_cache_blocks_in_use") == 0
    assert server.metric('request_success_total{finished_reason="abort"}') == aborted + 1


# -- structured output and tools through the official client ------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                                  "b": {"type": "integer", "minimum": -99, "maximum": 99}},
                                  "required": ["a", "b"], "additionalProperties": False}}}


def test_json_schema_through_parse_and_streaming(server):
    from typing import Literal

    import jsonschema
    from pydantic import BaseModel, Field

    class Shape(BaseModel):
        color: Literal["red", "green", "blue", "orange"]
        shape: Literal["circle", "square", "triangle"]
        where: str = Field(max_length=20)

    class Picture(BaseModel):
        count: int = Field(ge=0, le=9)
        shapes: list[Shape] = Field(max_length=3)

    client = server.client()
    messages = image_chat(data_url(IMG), "Describe the shapes as JSON.")
    for seed in range(4):
        done = client.chat.completions.parse(model="tiny", messages=messages, response_format=Picture,
                                            temperature=1.0, seed=seed, max_tokens=400)
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Picture)
    schema = Picture.model_json_schema()
    stream = client.chat.completions.create(
        model="tiny", messages=messages, stream=True, temperature=1.0, max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": "picture", "schema": schema, "strict": True}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_choice_regex_and_json_object_the_way_vllm_clients_send_them(server):
    client = server.client()
    choices = ["yes", "no"]
    for seed in range(3):
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Is it red?"}],
                                              temperature=1.0, seed=seed, extra_body={"guided_choice": choices})
        assert chat.choices[0].message.content in choices
    done = client.completions.create(model="tiny", prompt="Serial:", temperature=1.0, max_tokens=20, n=3,
                                     extra_body={"structured_outputs": {"regex": r"[A-Z]{3}-\d{4}"}})
    assert all(re.fullmatch(r"[A-Z]{3}-\d{4}", c.text) for c in done.choices)
    obj = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}],
                                         temperature=0, max_tokens=300, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError, match="one structured output"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})


def test_named_and_required_tool_calls_then_the_tool_result(server):
    import jsonschema

    client = server.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER, ADD], temperature=1.0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    for seed in range(3):
        required = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, ADD], seed=seed,
                                                  temperature=1.0, max_tokens=200, tool_choice="required")
        call_r = required.choices[0].message.tool_calls[0]
        tool = {"get_weather": WEATHER, "add": ADD}[call_r.function.name]
        jsonschema.validate(json.loads(call_r.function.arguments), tool["function"]["parameters"])

    stream = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], temperature=1.0, max_tokens=200, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [tc for d in deltas for tc in (d.delta.tool_calls or [])]  # its name first, then its arguments
    assert {tc.index for tc in streamed} == {0} and streamed[0].function.name == "get_weather" and streamed[0].id
    arguments = "".join(tc.function.arguments or "" for tc in streamed)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert deltas[-1].finish_reason == "tool_calls"

    follow_up = messages + [choice.message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    answer = client.chat.completions.create(model="tiny", messages=follow_up, tools=[WEATHER], max_tokens=8,
                                            temperature=0)
    plain = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=8,
                                           temperature=0)
    # the call and its result are in the prompt: the template rendered them
    result_tokens = client.completions.create(model="tiny", prompt="sunny, 21 degrees", max_tokens=1).usage.prompt_tokens
    assert answer.usage.prompt_tokens - plain.usage.prompt_tokens > result_tokens
    none = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.usage.prompt_tokens < plain.usage.prompt_tokens  # no tools listed


def test_sampling_parameters_over_the_api(server):
    client = server.client()
    base = dict(model="tiny", prompt="The shapes", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    accepted = client.completions.create(**base, presence_penalty=0.0, frequency_penalty=0.0)  # SDK defaults
    assert accepted.usage.completion_tokens == 4
    forced = client.completions.create(**dict(base, extra_body={"ignore_eos": True, "min_p": 0.1,
                                                                "repetition_penalty": 1.1}), logit_bias={"100": 100})
    assert forced.choices[0].text == client.completions.create(
        model="tiny", prompt="x", max_tokens=1, temperature=0, logit_bias={"100": 100}).choices[0].text * 4
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(**base, presence_penalty=3.0)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(**base, logit_bias={"999999": 1})


def test_a_forced_call_whose_argument_holds_the_closing_tag_is_still_a_call(server):
    """The call's block is read by its structure, so `</tool_call>` inside a string
    argument does not end it; streamed the same."""
    echo = {"type": "function", "function": {"name": "echo", "parameters": {
        "type": "object", "properties": {"text": {"const": "</tool_call> done"}}, "required": ["text"]}}}
    client = server.client()
    messages = [{"role": "user", "content": "Echo it."}]
    done = client.chat.completions.create(model="tiny", messages=messages, tools=[echo], tool_choice="required",
                                          max_tokens=100)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"text": "</tool_call> done"}
    stream = client.chat.completions.create(model="tiny", messages=messages, tools=[echo], tool_choice="required",
                                            max_tokens=100, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert "".join(d.delta.content or "" for d in deltas) == "" and deltas[-1].finish_reason == "tool_calls"
    assert {tc.index for tc in calls} == {0} and calls[0].function.name == "echo"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"text": "</tool_call> done"}
