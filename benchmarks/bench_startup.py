"""Time from `vlmserve serve` to a server that answers: /health up, then a first chat
completion with a picture. Median of several cold process starts.

    python benchmarks/bench_startup.py [--model PATH] [--runs 3]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import start_vlmserve  # noqa: E402

SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "shapes1.png"


def one_start(model: str | None) -> tuple[float, float]:
    start = time.perf_counter()
    proc, base = start_vlmserve(model=model)
    try:
        ready = time.perf_counter() - start
        url = "data:image/png;base64," + base64.b64encode(SAMPLE.read_bytes()).decode()
        httpx.post(base + "/v1/chat/completions", timeout=60, json={"max_tokens": 16, "messages": [{
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": "Describe the image."}]}]}).raise_for_status()
        return ready, time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the shipped model")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    runs = [one_start(args.model) for _ in range(args.runs)]
    ready = statistics.median(r for r, _ in runs)
    first = statistics.median(f for _, f in runs)
    print(f"vlmserve serve ({args.model or 'shipped model'}): /health up after {ready:.1f}s, "
          f"first answer with a picture after {first:.1f}s (median of {args.runs} cold starts)")


if __name__ == "__main__":
    main()
