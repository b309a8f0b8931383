"""What a worst-case structured-output request costs everyone else: the time to first token
of plain streaming chats, alone and while worst-case schemas compile, against a
`vlmserve serve` of the shipped model.

The worst cases are the reliability round's: a schema of 10,000 optional properties (it
never finished compiling), an object schema nested 350 deep (its grammar took seconds to
build on the event loop), and the largest schemas the default limits let through (512
optional properties; nesting 32 deep). Four of them are sent at once, then the bystanders'
first tokens are timed while those requests are unanswered.

    python benchmarks/bench_grammar_stall.py [--bystanders 20]

Run it against an older checkout (PYTHONPATH=that/tree) for the figure before a change.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_flags, start_vlmserve  # noqa: E402

from vlmserve.testing.schemas import nested, optional_properties  # noqa: E402

WORST = {"10,000 optional properties": optional_properties(10_000), "nested 350 deep": nested(350),
         "512 optional properties": optional_properties(512), "nested 32 deep": nested(32)}


def first_token_seconds(base: str, i: int) -> float:
    start = time.perf_counter()
    body = {"messages": [{"role": "user", "content": f"Tell me about shape {i}."}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line and '"content": ""' not in line:
                return time.perf_counter() - start
    raise RuntimeError("no token")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bystanders", type=int, default=20, help="plain streams timed in each phase")
    args = ap.parse_args()
    print(f"CPU flags: {cpu_flags()}")
    proc, base = start_vlmserve()
    try:
        for i in range(3):  # warm-up
            first_token_seconds(base, i)
        idle = [first_token_seconds(base, i) for i in range(args.bystanders)]
        answers: dict[str, tuple[int, float, str]] = {}

        def send(name: str, schema: dict) -> None:
            start = time.perf_counter()
            try:
                r = httpx.post(base + "/v1/chat/completions", timeout=600, json={
                    "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 8,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
                message = r.json().get("error", {}).get("message", "") if r.status_code != 200 else ""
                answers[name] = (r.status_code, time.perf_counter() - start, message)
            except httpx.HTTPError as e:
                answers[name] = (0, time.perf_counter() - start, repr(e))

        senders = [threading.Thread(target=send, args=item, daemon=True) for item in WORST.items()]
        for t in senders:
            t.start()
        time.sleep(0.2)
        during, pending_seen = [], 0
        for i in range(args.bystanders):
            pending_seen += len(WORST) - len(answers)
            during.append(first_token_seconds(base, 100 + i))
        deadline = time.time() + 60  # then the ones still compiling are reported unanswered
        for t in senders:
            t.join(timeout=max(deadline - time.time(), 0))
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    p50_idle, p50_during = statistics.median(idle), statistics.median(during)
    print(f"bystanders' first token, {args.bystanders} plain streams each: idle p50 {p50_idle * 1e3:.0f} ms "
          f"(max {max(idle) * 1e3:.0f}); while the worst-case schemas compile p50 {p50_during * 1e3:.0f} ms "
          f"(max {max(during) * 1e3:.0f}): {p50_during / p50_idle:.2f}x idle")
    print(f"worst-case requests still unanswered, averaged over the bystanders' starts: "
          f"{pending_seen / args.bystanders:.1f} of {len(WORST)}")
    for name, (status, seconds, message) in answers.items():
        print(f"  {name}: HTTP {status} after {seconds:.2f} s {message[:110]}")
    missing = set(WORST) - set(answers)
    for name in missing:
        print(f"  {name}: no answer within 60 s of the last bystander")


if __name__ == "__main__":
    main()
