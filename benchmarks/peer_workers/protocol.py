"""The worker side of bench_peers.py: JSON lines over stdin/stdout, shared by every
engine's worker (standard library and Pillow only: the vLLM venv imports it too).

    -> {"ready": true, "start_seconds": s}                 once the engine is built
    <- {"cmd": "run", ...}                                  the whole workload, from cold caches
                                                            ("sequential": one request at a time;
                                                            "workload": another workload file)
    -> {"seconds", "tokens", "user", "sys", "peak_rss_gb", "cached_tokens", "first_tokens",
        "exact_lengths", "ttft"}
    <- {"cmd": "quit"}
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from PIL import Image
from procstat import cpu_times, peak_rss_bytes

FIRST_TOKENS = 8  # output tokens per request the driver compares across engines


@dataclass
class Request:
    prompt: str  # rendered by the checkpoint's chat template, the same text for every engine
    images: list[Image.Image]  # decoded once at worker start
    max_tokens: int


def protocol_stdout() -> TextIO:
    """Keeps the real stdout for protocol lines only; everything else written to fd 1
    (prints, logging, native libraries, child processes) goes to stderr from now on."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)  # not inherited by child processes
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def worker_args(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--workload", required=True, help="the JSON file bench_peers.py wrote")
    ap.add_argument("--model", required=True, help="checkpoint folder")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-images", type=int, default=2, help="pictures per prompt at most")
    ap.add_argument("--sampling", type=json.loads, default={},
                    help="JSON: the sampling settings of every request ({}: greedy)")
    return ap


def load_workload(path: str) -> list[Request]:
    """The requests, each picture file opened and decoded once (shared where requests share it)."""
    with open(path) as f:
        spec = json.load(f)
    opened: dict[str, Image.Image] = {}

    def picture(file: str) -> Image.Image:
        if file not in opened:
            with Image.open(file) as img:
                opened[file] = img.convert("RGB")
        return opened[file]

    return [Request(r["prompt"], [picture(p) for p in r["images"]], r["max_tokens"]) for r in spec["requests"]]


def workload_of(message: dict[str, Any], default: list[Request]) -> list[Request]:
    """The requests a run message asks for: its own workload file's, else the worker's."""
    return load_workload(message["workload"]) if message.get("workload") else default


def summarize(requests: Sequence[Request], token_ids: Sequence[Sequence[int]], cached_tokens: int,
              first_token_times: Sequence[float] | None = None, run_start: float = 0.0) -> dict[str, Any]:
    """A run's outcome from each request's output token ids, and when each request's first
    token came (wall clock, time.time(); the engine may not say)."""
    ttft = sorted(t - run_start for t in first_token_times) if first_token_times else None
    return {
        # seconds from the workload's start to a request's first token: median and p90
        "ttft": None if ttft is None else [statistics.median(ttft), ttft[math.ceil(0.9 * len(ttft)) - 1]],
        "tokens": sum(len(ids) for ids in token_ids),
        "cached_tokens": int(cached_tokens),
        "first_tokens": [[int(t) for t in ids[:FIRST_TOKENS]] for ids in token_ids],
        "exact_lengths": all(len(ids) == r.max_tokens for r, ids in zip(requests, token_ids, strict=True)),
    }


def send(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def serve(out: TextIO, start_seconds: float, reset: Callable[[], None], run: Callable[[dict], dict[str, Any]]) -> None:
    """Answers the driver until it says quit (or closes stdin). `reset` empties the engine's
    caches before each run (untimed); `run(message)` runs the workload and returns
    `summarize(...)`; wall and CPU time (this process and its descendants) are added here."""
    send(out, {"ready": True, "start_seconds": start_seconds})
    for line in sys.stdin:
        message = json.loads(line)
        if message["cmd"] == "quit":
            return
        if message["cmd"] != "run":
            raise ValueError(f"unknown command {message['cmd']!r}")
        reset()
        gc.collect()
        user, system = cpu_times()
        t = time.perf_counter()
        result = run(message)
        seconds = time.perf_counter() - t
        user_after, system_after = cpu_times()
        send(out, {"seconds": seconds, "user": user_after - user, "sys": system_after - system,
                   "peak_rss_gb": peak_rss_bytes() / 1e9, **result})
