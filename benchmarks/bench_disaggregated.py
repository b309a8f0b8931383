"""Prefill and decode on different replicas (`serve --prefill-replicas`) against the same
number of ordinary replicas, under a mixed load: clients that each ask about a new picture
and stream a long answer. Time to first token and tokens/s, each setup on a local Ray
cluster of its own, the KV passing through a Mooncake pool (`--kv-transfer-config`).
Checkpoint: Qwen2.5-VL-3B's widths with random weights, cut to --layers.

    python benchmarks/bench_disaggregated.py          # 2 replicas of 1 CPU: 1+1 against 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import httpx  # noqa: E402
from bench_kv_pool import picture_url, start_master  # noqa: E402
from common import cpu_flags, free_port  # noqa: E402


def start_server(model: str, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", "--port", str(port),
                             "--model", model, "--served-model-name", "m", "--log-level", "WARNING", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError("vlmserve serve did not start")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)


def one_client(base: str, url: str, max_tokens: int) -> tuple[float, int, float]:
    """(seconds to the first token, tokens, seconds to the end) of one streamed answer."""
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "Describe the image."}]}]}
    start, first, tokens = time.perf_counter(), None, 0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                first = first or time.perf_counter() - start
                tokens += 1
    return first or float("nan"), tokens, time.perf_counter() - start


def load(base: str, clients: int, requests: int, max_tokens: int, seed: int) -> dict:
    urls = [picture_url(seed + i, 448) for i in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda u: one_client(base, u, max_tokens), urls))
    wall = time.perf_counter() - start
    ttft = sorted(r[0] for r in results)
    return {"ttft_p50": statistics.median(ttft), "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
            "tok_s": sum(r[1] for r in results) / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    from scale_checkpoints import build

    print(f"CPU: {cpu_flags()}", flush=True)
    model = str(build("qwen2_5_vl_3b", args.layers))
    master, pool = start_master()
    common = ["--replica-cpus", "1", "--dtype", "bfloat16", "--kv-cache-memory-gb", "0.5",
              "--kv-transfer-config", json.dumps(pool)]
    setups = {"2 replicas": ["--replicas", "2"], "1 prefill + 1 decode": ["--replicas", "1", "--prefill-replicas", "1"]}
    results = {}
    try:
        for i, (name, flags) in enumerate(setups.items()):
            proc, base = start_server(model, [*flags, *common])
            try:
                load(base, 2, 2, 4, seed=90_000 + 100 * i)  # warm-up: each replica's first requests
                results[name] = r = load(base, args.clients, args.requests, args.max_tokens, seed=1000 * (i + 1))
            finally:
                proc.terminate()
                proc.wait(timeout=120)
            print(f"{name}: first token p50 {r['ttft_p50']:.2f} s, p90 {r['ttft_p90']:.2f} s; {r['tok_s']:.1f} tok/s",
                  flush=True)
    finally:
        master.kill()
    print(f"Qwen2.5-VL-3B widths, {args.layers} layers, bf16; {args.clients} clients, {args.requests} requests, each a "
          f"new 448x448 picture and {args.max_tokens} tokens streamed; replicas of 1 CPU each")
    a, b = results["2 replicas"], results["1 prefill + 1 decode"]
    print(f"disaggregated / colocated: first token p50 {a['ttft_p50'] / b['ttft_p50']:.2f}x sooner, "
          f"tokens/s {b['tok_s'] / a['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
