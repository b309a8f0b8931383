"""bench_host_step.py's worker: the time of one decode step of a batch, on a checkpoint with
almost no weights (so the step is the engine's own work, not the model's), run by the
engine's own python (the vLLM venv must not import vlmserve).

    python step_worker.py --engine vlmserve|vlmserve-sync|vllm --model DIR --batch B

Prints one JSON line: {"step_ms": whole decode step, "host_ms": vlmserve's host work a
step (phase timer; null for vLLM), "phases": vlmserve's ms a step per phase}. A decode
step's time is the difference of two runs' wall times over the difference of their
lengths, so prefill and start-up cancel out (medians of REPEATS).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from protocol import protocol_stdout

SHORT, LONG = 32, 160  # output tokens of the two runs
REPEATS = 3


def main() -> None:
    out = protocol_stdout()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--engine", choices=["vlmserve", "vlmserve-sync", "vllm"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = ap.parse_args()
    prompts = [f"Tell me a story about the number {i} and what it means." for i in range(args.batch)]
    if args.engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=args.model, dtype="float32", gpu_memory_utilization=0.3, max_model_len=1024,
                  max_num_seqs=max(args.batch, 1), seed=0)

        def run(n: int) -> None:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        timer = None
    else:
        import torch

        torch.set_num_threads(args.threads)
        from vlmserve import LLM, SamplingParams

        llm = LLM(args.model, dtype="float32", max_num_seqs=max(args.batch, 1), num_kv_blocks=4096,
                  time_steps=True, async_scheduling=args.engine == "vlmserve")
        timer = llm.engine.timer

        def run(n: int) -> None:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    run(8)  # warm-up
    steps, phases, host = [], {}, []
    for _ in range(REPEATS):
        t = time.perf_counter()
        run(SHORT)
        short = time.perf_counter() - t
        if timer is not None:
            timer.reset()
        t = time.perf_counter()
        run(LONG)
        long = time.perf_counter() - t
        steps.append((long - short) / (LONG - SHORT))
        if timer is not None:
            n = max(timer.steps, 1)
            host.append(timer.host_seconds() / n)
            for name, seconds in timer.report().items():
                phases.setdefault(name, []).append(seconds / n * 1e3)
    print(json.dumps({"step_ms": statistics.median(steps) * 1e3,
                      "host_ms": statistics.median(host) * 1e3 if host else None,
                      "phases": {k: statistics.median(v) for k, v in phases.items()}}), file=out, flush=True)


if __name__ == "__main__":
    main()
