"""The training script end to end on a few steps: it stops on Ctrl-C with its state saved,
the same command resumes through every phase, and what it exports loads in vlmserve and
in transformers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from vlmserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


def test_training_stops_resumes_and_exports(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "vlmserve.training.train", "--out", str(out), "--vision-steps", "60",
           "--vision-batch-size", "2", "--steps", "4", "--batch-size", "2", "--lookup-steps", "2",
           "--warmup", "2", "--val-size", "2", "--threads", "1"]
    first = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    log = []
    deadline = time.time() + 300
    for line in first.stderr:  # interrupt once the vision phase is under way
        log.append(line)
        if "vision step 20 " in line:
            first.send_signal(signal.SIGINT)
            break
        assert time.time() < deadline, "".join(log)
    rest = first.communicate(timeout=120)[1]
    assert first.returncode == 0 and "stopped at vision step" in rest, "".join(log) + rest
    assert (out / "train_state.pt").exists() and not (out / "model").exists()

    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert "resumed: vision phase, step 2" in second.stderr  # not from scratch
    for phase in ("vlm", "lookup"):
        assert f"{phase} step" in second.stderr and "exact match" in second.stderr
    lines = (out / "train_log.jsonl").read_text().splitlines()
    assert len(lines) == 60 + 4 + 2  # every step once, across the interruption

    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText.from_pretrained(out / "model")
    reply = LLM(model=str(out / "model")).generate(["How many shapes are there?"],
                                                    SamplingParams(temperature=0, max_tokens=4))[0]
    assert reply.outputs[0].token_ids
