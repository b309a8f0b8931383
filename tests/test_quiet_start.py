"""A quiet start: no entry point prints a warning that does not concern the user's setup
(torch's "No CUDA runtime is found" on a CPU machine was the first line of every
command); one that does (no compiler: the slow kernels run) is one line saying what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_openai_server import Server

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
pytestmark = pytest.mark.slow


def noise(stderr: str) -> list[str]:
    """Warning lines (Python's, torch's glog-style "W1126 ...", logging's WARNING)."""
    return [line for line in stderr.splitlines()
            if "warning" in line.lower() or line.startswith(("W0", "W1")) or "No CUDA runtime" in line]


def test_caption_eval_and_the_llm_class_start_quietly(tmp_path):
    runs = [
        [sys.executable, "-m", "vlmserve.entrypoints.cli", "caption", str(SAMPLES), "--out", str(tmp_path / "c.jsonl"),
         "--no-progress"],
        [sys.executable, "-m", "vlmserve.entrypoints.cli", "eval", "--pictures", "2", "--videos", "1",
         "--video-captions", "1"],
        [sys.executable, "-c", "from vlmserve import LLM; print(LLM().generate('hi')[0].outputs[0].text)"],
    ]
    for cmd in runs:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert not noise(result.stderr), (cmd[3:5], noise(result.stderr))


def test_serve_starts_quietly():
    s = Server(None)
    s.stop()
    assert not noise("".join(s.log)), noise("".join(s.log))


def test_without_a_compiler_one_line_says_what_to_do(tmp_path):
    """No C++ compiler on PATH (and an empty kernel cache): the engine runs on the
    pure-torch kernels and says so in one line."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bare), "VLMSERVE_CACHE": str(tmp_path / "cache"), "CXX": "no-such-compiler"}
    result = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(); from vlmserve import LLM; "
                             "print(LLM().generate('hi')[0].outputs[0].text)"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr
    lines = noise(result.stderr)
    assert len(lines) == 1 and "install a C++ compiler" in lines[0], result.stderr
