"""A Mooncake pool of KV blocks shared by engines (--kv-transfer-config): a real
mooncake_master, two `vlmserve serve` processes on it answering the official client. The
second gets the first's picture prefix as cached tokens, and its encoder output, and the
tokens a cold engine gives; with the pool killed, both go on answering."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import data_url, ensure_libibverbs, make_image
from test_openai_server import Server, free_port
from vlmserve import LLM, SamplingParams
from vlmserve.errors import ConfigError
from vlmserve.testing.checkpoints import build_qwen2_5_vl

pytestmark = pytest.mark.slow

BLOCKS = 24


class Master:
    """mooncake_master with its HTTP metadata server, on free ports."""

    def __init__(self) -> None:
        self.rpc, self.http, self.metrics = free_port(), free_port(), free_port()
        binary = Path(sys.executable).parent / "mooncake_master"
        self.proc = subprocess.Popen([str(binary), f"--rpc_port={self.rpc}", "--enable_http_metadata_server=true",
                                      f"--http_metadata_server_port={self.http}", f"--metrics_port={self.metrics}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while self.keys() is None:
            assert self.proc.poll() is None and time.time() < deadline, "mooncake_master did not start"
            time.sleep(0.2)

    def config(self) -> dict:
        return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
            "local_hostname": "127.0.0.1", "metadata_server": f"http://127.0.0.1:{self.http}/metadata",
            "master_server_address": f"127.0.0.1:{self.rpc}", "global_segment_size": 64 << 20,
            "local_buffer_size": 16 << 20}}

    def keys(self) -> int | None:
        """Objects in the pool (None: the master does not answer yet)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics}/metrics", timeout=2).text
        except httpx.HTTPError:
            return None
        return next((int(float(line.split()[1])) for line in text.splitlines()
                     if line.startswith("master_key_count ")), None)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def full_attention_path(tmp_path_factory):
    return str(build_qwen2_5_vl(tmp_path_factory.mktemp("qwen25-full"), sliding_window=None))


def ask(server: Server, seed: int, question: str):
    content = [{"type": "image_url", "image_url": {"url": data_url(make_image(280, 252, seed))}},
               {"type": "text", "text": question}]
    return server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                   max_tokens=6, temperature=0)


def cold_tokens(path: str, seed: int, question: str) -> str:
    chat = [{"role": "user", "content": [{"type": "image", "image": make_image(280, 252, seed)},
                                         {"type": "text", "text": question}]}]
    llm = LLM(path, num_kv_blocks=BLOCKS, dtype="float32")
    return llm.chat(chat, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text


def test_two_servers_share_a_picture_prefix_and_outlive_the_pool(full_attention_path):
    ensure_libibverbs()
    expected = {(seed, q): cold_tokens(full_attention_path, seed, q)
                for seed, q in ((0, "What is in the picture?"), (1, "Describe the image."))}
    master = Master()
    flags = ("--num-kv-blocks", str(BLOCKS), "--dtype", "float32", "--kv-transfer-config", json.dumps(master.config()))
    first = Server(full_attention_path, *flags)
    second = Server(full_attention_path, *flags)
    try:
        assert ask(first, 0, "Describe the image.").usage.prompt_tokens_details.cached_tokens == 0
        deadline = time.time() + 30  # the runner puts blocks on a thread of its own, after the step
        while master.keys() < 4:  # 3 blocks the second server reads, and the picture's encoder output
            assert time.time() < deadline, master.keys()
            time.sleep(0.1)
        reply = ask(second, 0, "What is in the picture?")  # the same picture: its blocks come from the pool
        assert reply.usage.prompt_tokens_details.cached_tokens == 3 * 16
        assert reply.usage.media == {"encoded": 0, "encoder_cache": 1, "prefix_cache": 0}  # not encoded again
        assert reply.choices[0].message.content == expected[(0, "What is in the picture?")]
        assert second.metric("external_prefix_cache_hits_total") == 3 * 16
        assert second.metric('kv_connector_bytes_total{direction="load"}') > 0 and second.metric('kv_connector_seconds_total{direction="load"}') > 0

        master.kill()  # the pool is gone: each server computes for itself, and says so
        for server in (first, second):
            reply = ask(server, 1, "Describe the image.")
            assert reply.choices[0].message.content == expected[(1, "Describe the image.")]
        assert any("Mooncake pool" in line for line in first.log + second.log)
    finally:
        for server in (first, second):
            assert server.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has drained
        master.kill()


def test_settings_the_pool_needs_are_named(full_attention_path, qwen35_path, tmp_path, monkeypatch):
    config = {"kv_connector": "MooncakeStoreConnector", "kv_connector_extra_config": {"local_hostname": "127.0.0.1"}}
    with pytest.raises(ConfigError, match="needs metadata_server, master_server_address"):
        LLM(full_attention_path, num_kv_blocks=BLOCKS, kv_transfer_config=config)
    with pytest.raises(ConfigError, match="kv_connector 'LMCacheConnectorV1'"):
        LLM(full_attention_path, kv_transfer_config={"kv_connector": "LMCacheConnectorV1"})
    with pytest.raises(ConfigError, match="MambaSpec layers"):
        LLM(qwen35_path, num_kv_blocks=BLOCKS, kv_transfer_config={**config, "kv_connector_extra_config": {
            "local_hostname": "h", "metadata_server": "m", "master_server_address": "127.0.0.1:1"}})
    # the settings in the file MOONCAKE_CONFIG_PATH names, a master that does not answer: the
    # engine starts at once, caches locally and answers
    settings = tmp_path / "mooncake.json"
    settings.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": "http://127.0.0.1:1/metadata",
                                    "master_server_address": f"127.0.0.1:{free_port()}"}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(settings))
    start = time.time()
    llm = LLM(full_attention_path, num_kv_blocks=BLOCKS, kv_transfer_config={"kv_connector": "MooncakeStoreConnector"})
    assert time.time() - start < 60
    assert llm.generate("a b c", SamplingParams(max_tokens=3))[0].outputs[0].token_ids


def test_prefill_and_decode_on_different_replicas(full_attention_path):
    """serve --replicas 1 --prefill-replicas 1 on a local Ray cluster: each request's prompt on
    the prefill replica, its answer on the decode replica, which reads the prompt's blocks and
    picture from the pool; the answers are a single engine's, streamed and not."""
    ensure_libibverbs()
    expected = cold_tokens(full_attention_path, 2, "Describe the image.")
    master = Master()
    server = Server(full_attention_path, "--replicas", "1", "--prefill-replicas", "1", "--replica-cpus", "1",
                    "--num-kv-blocks", str(BLOCKS), "--dtype", "float32",
                    "--kv-transfer-config", json.dumps(master.config()), start_timeout=300)
    try:
        reply = ask(server, 2, "Describe the image.")
        assert reply.choices[0].message.content == expected
        # the decode replica computed the last block's tokens: the rest came from the pool
        assert reply.usage.prompt_tokens_details.cached_tokens == (reply.usage.prompt_tokens - 1) // 16 * 16 > 0
        assert reply.usage.media["encoded"] == 0  # the picture neither: its KV (or its encoder output) is in the pool
        content = [{"type": "image_url", "image_url": {"url": data_url(make_image(280, 252, 2))}},
                   {"type": "text", "text": "Describe the image."}]
        stream = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                         max_tokens=6, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    finally:
        server.stop()
        master.kill()


def test_prefill_replicas_need_decode_replicas_and_a_pool(full_attention_path):
    for flags in (["--prefill-replicas", "1"], ["--replicas", "1", "--prefill-replicas", "1"]):
        done = subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", "--model",
                               full_attention_path, *flags], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "--prefill-replicas: with --replicas N" in done.stderr, done.stderr
