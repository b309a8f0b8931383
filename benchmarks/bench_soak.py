"""Soak: `vlmserve serve` under N concurrent streaming clients for M minutes, a share of
them hanging up mid-stream or during prefill, bad inputs mixed in; then, once idle,
everything the requests held must be back to idle.

    python benchmarks/bench_soak.py [--model PATH] [--clients 64] [--minutes 3]
        [--hangup-share 0.1] [--bad-share 0.05]

Reports requests completed, errors by status, time to first token p50/p99, tok/s, the
server's RSS every 30 s, and, once idle: requests running and waiting, KV blocks in use,
state slots, encoder-cache entries (all from /metrics). Default model: the shipped one.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import io
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_flags, start_vlmserve  # noqa: E402

BAD_BODIES = [  # each must be refused with a 4xx
    {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64},
    {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**63},
    {"messages": [{"role": "user", "content": "hi"}], "n": 10**4},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": [{"type": {}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [10**7], "min_tokens": 1},
]


def picture_url(seed: int) -> str:
    rng = np.random.RandomState(seed)
    img = Image.fromarray(rng.randint(0, 256, (4, 4, 3), dtype=np.uint8)).resize((160 + seed % 5 * 32, 160))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^vlmserve:{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Tally:
    def __init__(self) -> None:
        self.completed = 0
        self.hung_up = 0
        self.tokens = 0
        self.ttft: list[float] = []
        self.status: collections.Counter = collections.Counter()


async def one_request(http: httpx.AsyncClient, base: str, rng: random.Random, pictures: list[str], args,
                      tally: Tally) -> None:
    if rng.random() < args.bad_share:
        r = await http.post(base + "/v1/chat/completions", json=rng.choice(BAD_BODIES))
        tally.status[r.status_code] += 1
        return
    content = [{"type": "image_url", "image_url": {"url": rng.choice(pictures)}}] if rng.random() < 0.8 else []
    body = {"messages": [{"role": "user", "content": content + [{"type": "text", "text": "Describe the image."}]}],
            "max_tokens": rng.randint(8, 48), "stream": True, "temperature": 0.7, "ignore_eos": True}
    hang_up_after = rng.choice([0, 2]) if rng.random() < args.hangup_share else None  # during prefill, or mid-stream
    start = time.perf_counter()
    chunks = 0
    async with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
        tally.status[r.status_code] += 1
        if r.status_code != 200:
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                tally.status["stream error"] += 1
                return
            if event["choices"] and event["choices"][0]["delta"].get("content") is not None:
                if chunks == 0:
                    tally.ttft.append(time.perf_counter() - start)
                chunks += 1
                tally.tokens += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                tally.hung_up += 1
                return  # leaving the `async with` closes the connection
    tally.completed += 1


async def client_loop(i: int, base: str, pictures: list[str], args, tally: Tally, stop_at: float) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(timeout=300) as http:
        while time.time() < stop_at:
            try:
                await one_request(http, base, rng, pictures, args, tally)
            except httpx.HTTPError as e:
                tally.status[type(e).__name__] += 1


async def soak(base: str, pid: int, args) -> Tally:
    pictures = [picture_url(s) for s in range(32)]
    tally = Tally()
    start = time.time()
    stop_at = start + args.minutes * 60
    clients = [asyncio.ensure_future(client_loop(i, base, pictures, args, tally, stop_at)) for i in range(args.clients)]
    last_tokens, last_time = 0, start
    while not all(c.done() for c in clients):
        await asyncio.sleep(min(30, max(stop_at - time.time(), 1)))
        now = time.time()
        rate = (tally.tokens - last_tokens) / (now - last_time)
        print(f"  {now - start:6.0f}s  RSS {rss_mb(pid):7.0f} MB  {rate:7.0f} tok/s  completed {tally.completed}",
              flush=True)
        last_tokens, last_time = tally.tokens, now
    tally.seconds = time.time() - start
    return tally


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the shipped model")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--hangup-share", type=float, default=0.1)
    ap.add_argument("--bad-share", type=float, default=0.05)
    args = ap.parse_args()
    print(f"CPU flags: {cpu_flags()}")
    proc, base = start_vlmserve("--max-num-seqs", str(max(args.clients, 8)), model=args.model)
    try:
        print(f"{args.clients} streaming clients for {args.minutes:g} min, {args.hangup_share:.0%} hanging up, "
              f"{args.bad_share:.0%} bad requests; RSS every 30 s:")
        tally = asyncio.run(soak(base, proc.pid, args))
        deadline = time.time() + 30
        while True:  # the last hang-ups are noticed within a moment
            text = httpx.get(base + "/metrics").text
            if metric(text, "num_requests_running") == 0 or time.time() > deadline:
                break
            time.sleep(0.2)
        ttft = sorted(tally.ttft) or [0.0]
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(tally.status.items(), key=lambda kv: str(kv[0])))
        print(f"completed {tally.completed}, hung up {tally.hung_up}, by status: {statuses}")
        print(f"TTFT p50 {statistics.median(ttft):.2f}s p99 {ttft[int(0.99 * (len(ttft) - 1))]:.2f}s, "
              f"{tally.tokens / tally.seconds:.0f} tok/s, RSS at the end {rss_mb(proc.pid):.0f} MB")
        idle = {name: metric(text, name) for name in ("num_requests_running", "num_requests_waiting",
                                                      "kv_cache_blocks_in_use", "state_slots_in_use",
                                                      "encoder_cache_entries_in_use")}
        kept = metric(text, "encoder_cache_entries")
        print("idle: " + ", ".join(f"{k} {v:g}" for k, v in idle.items())
              + f" (encoder-cache entries kept for reuse: {kept:g})")
        print("back to idle: " + ("yes" if not any(idle.values()) else "NO"))
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
