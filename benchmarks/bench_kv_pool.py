"""Two replicas sharing KV blocks (and encoder outputs) through a Mooncake pool
(`--kv-transfer-config`): each picture asked about on both, its first question on one
replica and its second on the other.
Prompt tokens served from caches, and the second question's first token, against one
replica serving the same workload alone and against two replicas without the pool.

Each replica is a `vlmserve serve` process; the pool a `mooncake_master` this script starts
(from the venv: `pip install -e ".[mooncake]"`, and Debian's libibverbs1). Checkpoint:
Qwen2.5-VL-3B's widths with random weights, cut to --layers.

    python benchmarks/bench_kv_pool.py                   # 8 pictures of 448x448, 2 layers
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import httpx  # noqa: E402
from common import cpu_flags, free_port, start_vlmserve, synthetic_image  # noqa: E402

QUESTIONS = ("Describe the image.", "What colours are in the picture?")


def start_master() -> tuple[subprocess.Popen, dict]:
    rpc, http, metrics = free_port(), free_port(), free_port()
    master = subprocess.Popen([str(Path(sys.executable).parent / "mooncake_master"), f"--rpc_port={rpc}",
                               "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
                               f"--metrics_port={metrics}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=1)
            break
        except httpx.HTTPError:
            if time.time() > deadline:
                raise RuntimeError("mooncake_master did not start") from None
            time.sleep(0.2)
    return master, {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {
        "local_hostname": "127.0.0.1", "metadata_server": f"http://127.0.0.1:{http}/metadata",
        "master_server_address": f"127.0.0.1:{rpc}", "global_segment_size": 1 << 30, "local_buffer_size": 256 << 20}}


def picture_url(seed: int, side: int) -> str:
    buf = io.BytesIO()
    synthetic_image(side, side, seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(base: str, url: str, question: str) -> tuple[int, int, float]:
    """(prompt tokens, cached tokens, seconds to the answer of one token)."""
    body = {"model": "m", "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]}]}
    start = time.perf_counter()
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - start
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], seconds


def run(first: str, second: str, urls: list[str]) -> dict:
    prompt = cached = 0
    seconds = []
    for url in urls:
        for base, question in ((first, QUESTIONS[0]), (second, QUESTIONS[1])):
            p, c, s = ask(base, url, question)
            prompt, cached = prompt + p, cached + c
            if question == QUESTIONS[1]:
                seconds.append(s)
    return {"prompt": prompt, "cached": cached, "second_question_s": statistics.median(seconds)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pictures", type=int, default=8)
    p.add_argument("--side", type=int, default=448, help="the pictures' side (448: 256 picture tokens)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model", default=None, help="a full-attention checkpoint folder instead of the 3B-width one")
    args = p.parse_args()
    from scale_checkpoints import build

    print(f"CPU: {cpu_flags()}", flush=True)
    model = args.model or str(build("qwen2_5_vl_3b", args.layers))
    master, pool = start_master()
    flags = ("--served-model-name", "m", "--dtype", "bfloat16", "--kv-cache-memory-gb", "0.5")
    results = {}
    try:
        for name, pooled, replicas in (("one replica", False, 1), ("two replicas, no pool", False, 2),
                                       ("two replicas, one pool", True, 2)):
            extra = ("--kv-transfer-config", json.dumps(pool)) if pooled else ()
            servers = [start_vlmserve(*flags, *extra, model=model) for _ in range(replicas)]
            bases = [base for _, base in servers]
            urls = [picture_url(1000 * len(results) + i, args.side) for i in range(args.pictures)]  # new each run
            results[name] = run(bases[0], bases[-1], urls)
            for proc, _ in servers:
                proc.terminate()
                proc.wait(timeout=60)
            r = results[name]
            print(f"{name}: {r['cached']}/{r['prompt']} prompt tokens from caches, the second question's answer "
                  f"{r['second_question_s']:.3f} s (median)", flush=True)
    finally:
        master.kill()
    one = results["one replica"]["cached"]
    checkpoint = args.model or f"Qwen2.5-VL-3B widths, {args.layers} layers"
    print(f"{checkpoint}, bf16; {args.pictures} pictures of {args.side}x{args.side}, "
          f"each asked twice (on two replicas: once on each)")
    for name in ("two replicas, no pool", "two replicas, one pool"):
        print(f"{name} / one replica: cached tokens {results[name]['cached'] / max(one, 1):.1%}")
    apart = results["two replicas, no pool"]["second_question_s"]
    print(f"the second question's answer on the other replica: "
          f"{apart / results['two replicas, one pool']['second_question_s']:.1f}x sooner with the pool "
          f"(on the same replica: {apart / results['one replica']['second_question_s']:.1f}x)")


if __name__ == "__main__":
    main()
