"""bench_peers.py's vlmserve worker: `vlmserve.LLM` with continuous batching, prefix,
encoder and processor caches emptied before every run."""

from __future__ import annotations

import os
import time
from typing import Any

from protocol import load_workload, protocol_stdout, serve, summarize, worker_args, workload_of


def main() -> None:
    out = protocol_stdout()
    ap = worker_args(__doc__)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--profile", action="store_true", help="time each phase of the engine's steps")
    ap.add_argument("--quantization", choices=["int8", "int4"], default=None)
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for the decode steps")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="requests running at once (default: the workload's, at most 256); the batches of a "
                         "run's other workloads must fit it, or they run partly one after another")
    ap.add_argument("--async-scheduling", choices=["on", "off"], default=None,
                    help="one step in flight, or none (default: the engine's)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from vlmserve import LLM, SamplingParams

    default = load_workload(args.workload)
    t = time.perf_counter()
    # as many sequences as the workload has (at most 256): a hybrid model's recurrent states
    # are reserved per sequence, and at Qwen3.5's widths 256 of them outgrow the 2 GB budget
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs or min(256, len(default)),
              max_num_batched_tokens=4096,
              kv_cache_memory_gb=2, max_model_len=args.max_model_len, time_steps=args.profile,
              quantization=args.quantization, **({"enforce_eager": True} if args.enforce_eager else {}),
              **({} if args.async_scheduling is None else {"async_scheduling": args.async_scheduling == "on"}))
    start_seconds = time.perf_counter() - t

    def reset() -> None:
        if not llm.engine.reset_caches():
            raise RuntimeError("vlmserve did not reset its caches: requests are still running")
        llm.engine.timer.reset()

    def run(message: dict) -> dict[str, Any]:
        requests = workload_of(message, default)
        prompts = [{"prompt": r.prompt, "multi_modal_data": {"image": r.images}} for r in requests]
        params = [SamplingParams(**{"temperature": 0, **args.sampling}, max_tokens=r.max_tokens, ignore_eos=True)
                  for r in requests]
        run_start = time.time()
        if message.get("sequential"):
            outs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
        else:
            outs = llm.generate(prompts, params)
        result = summarize(requests, [o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs),
                           [o.metrics.first_token_time for o in outs], run_start)
        if args.profile:
            timer = llm.engine.timer
            result.update(phases=timer.report(), steps=timer.steps, host_seconds=timer.host_seconds())
        return result

    serve(out, start_seconds, reset, run)


if __name__ == "__main__":
    main()
