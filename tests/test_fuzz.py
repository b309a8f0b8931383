"""Fuzzing, bounded so that it runs in the suite: schemathesis against the server's own
OpenAPI schema (no request may get a 5xx), and hypothesis against the media path (random
and mutated PNG, JPEG, GIF and MP4 bytes give a picture or video, or a MediaError, never
another exception)."""

from __future__ import annotations

import json
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from media_files import image_bytes, picture, video_bytes
from test_openai_server import Server
from vlmserve.multimodal.media import MediaError, MediaLimits, MediaLoader
from vlmserve.multimodal.processor import MultiModalProcessor


@pytest.fixture(scope="module", params=["plain", "ngram", "draft_model"])
def fuzzed_server(qwen25_path, request, tmp_path_factory):
    """Also with speculative decoding on (n-gram drafts; a draft model): every sampling
    option the schema allows goes through the drafting and verification paths. The plain
    one loads adapters at run time: their routes are fuzzed too."""
    adapters = str(tmp_path_factory.mktemp("fuzzed-adapters"))
    extra = {"plain": ["--allow-runtime-lora-updating", "--allowed-lora-path", adapters],
             "ngram": ["--speculative-config", json.dumps({"method": "ngram", "prompt_lookup_min": 1})],
             "draft_model": ["--speculative-config", json.dumps({"model": qwen25_path})]}[request.param]
    # short answers whatever the fuzzer asks for, so the examples stay quick
    s = Server(qwen25_path, "--num-kv-blocks", "256", "--max-model-len", "256", "--max-n", "2", *extra)
    s.speculative = request.param != "plain"
    yield s
    s.stop()


GENERATING = {"/v1/chat/completions", "/v1/completions", "/v1/responses"}


@pytest.mark.slow
def test_no_request_the_schema_allows_gets_a_server_error(fuzzed_server):
    schema = schemathesis.openapi.from_url(fuzzed_server.base + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    # the drafting servers fuzz only what generates, half as many examples: their requests
    # go through the same checks, what they add is the sampling options through drafting
    # and verification
    examples = 30 if fuzzed_server.speculative else 60
    if fuzzed_server.speculative:
        operations = [op for op in operations if op.method.upper() == "POST" and op.path in GENERATING]
        assert {op.path for op in operations} == GENERATING
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_server_error(case):
            response = case.call(base_url=fuzzed_server.base, timeout=120)
            assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])

        no_server_error()
    # nothing left behind (polled: the engine publishes its stats just after the last answer)
    deadline = time.time() + 30
    while time.time() < deadline and (fuzzed_server.metric("num_requests_running")
                                      or fuzzed_server.metric("kv_cache_blocks_in_use")):
        time.sleep(0.2)
    assert fuzzed_server.metric("num_requests_running") == 0 and fuzzed_server.metric("kv_cache_blocks_in_use") == 0
    if fuzzed_server.speculative:
        # the fuzzed requests ran on a drafting server: a prompt that repeats itself gives the
        # n-gram proposer matches (the fuzzer's own prompts draft only when theirs happen to
        # repeat, so the count after them alone depends on the examples drawn)
        fuzzed_server.client().completions.create(model="tiny", prompt="one two one two one two one two",
                                                  max_tokens=8, temperature=0)
        deadline = time.time() + 30  # polled, as above
        while time.time() < deadline and not fuzzed_server.metric("spec_decode_num_draft_tokens_total"):
            time.sleep(0.2)
        assert fuzzed_server.metric("spec_decode_num_draft_tokens_total") > 0


# -- media ------------------------------------------------------------------------------------------
SEEDS = {
    "png": image_bytes(picture(40, 30, 1)),
    "jpeg": image_bytes(picture(40, 30, 2), "JPEG"),
    "gif": image_bytes(picture(24, 24, 3), "GIF"),
    "mp4": video_bytes("mp4", frames=4, fps=4),
}


@pytest.fixture(scope="module")
def processor(qwen25_path):
    from transformers import AutoConfig

    loader = MediaLoader(MediaLimits(max_image_pixels=1 << 22))
    return MultiModalProcessor(qwen25_path, AutoConfig.from_pretrained(qwen25_path), loader, cache_bytes=0)


@st.composite
def mutated(draw) -> tuple[str, bytes]:
    """A valid file of some kind, then flipped, truncated, spliced or junked bytes."""
    kind = draw(st.sampled_from(sorted(SEEDS)))
    data = bytearray(SEEDS[kind])
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "overwrite"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif op == "truncate":
            data = data[:at]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=64))
        else:
            chunk = draw(st.binary(min_size=1, max_size=64))
            data[at : at + len(chunk)] = chunk
    return ("video" if kind == "mp4" else "image"), bytes(data)


def process_or_refuse(processor: MultiModalProcessor, modality: str, data: bytes) -> None:
    try:
        item = processor.process(data, modality)
    except MediaError:
        return  # refused with a message: a 400 through the API
    assert item.data["pixel_values"].shape[0] > 0


@pytest.mark.slow
@given(st.sampled_from(["image", "video"]), st.binary(max_size=4096))
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_random_bytes_are_refused_with_a_media_error(processor, modality, data):
    process_or_refuse(processor, modality, data)


@pytest.mark.slow
@given(mutated())
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
def test_mutated_files_give_media_or_a_media_error(processor, case):
    modality, data = case
    process_or_refuse(processor, modality, data)
