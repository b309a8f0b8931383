"""bench_peers.py's vLLM-CPU worker, run by the vLLM venv's python (it must not import
vlmserve). Its compiled mode by default, `--eager` for enforce_eager. The driver sets
VLLM_CPU_OMP_THREADS_BIND and VLLM_CPU_NUM_OF_RESERVED_CPU: vLLM's CPU worker ignores
OMP_NUM_THREADS and binds its threads itself."""

from __future__ import annotations

import time
from typing import Any

from protocol import load_workload, protocol_stdout, serve, summarize, worker_args


def first_token_time(output) -> float | None:
    """Wall-clock time of a request's first token, from vLLM's per-request stats."""
    stats = getattr(output, "metrics", None)
    if stats is None or not getattr(stats, "first_token_latency", 0.0):
        return None
    return stats.arrival_time + stats.first_token_latency


def main() -> None:
    out = protocol_stdout()
    ap = worker_args(__doc__)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (no torch.compile)")
    ap.add_argument("--memory-share", type=float, default=0.3,
                    help="gpu_memory_utilization: the share of memory for weights and KV cache")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    requests = load_workload(args.workload)
    t = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, gpu_memory_utilization=args.memory_share,
              max_model_len=args.max_model_len, enable_prefix_caching=True,
              limit_mm_per_prompt={"image": args.max_images, "video": 0}, seed=0,
              max_num_seqs=256, max_num_batched_tokens=4096, enforce_eager=args.eager,
              disable_log_stats=False)  # per-request metrics: the time of each first token
    start_seconds = time.perf_counter() - t

    def reset() -> None:
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")
        if hasattr(llm, "reset_mm_cache"):  # the processor's multimodal cache
            llm.reset_mm_cache()
        if hasattr(llm.llm_engine, "reset_encoder_cache"):  # vision embeddings kept by the engine core
            llm.llm_engine.reset_encoder_cache()

    def run(message: dict) -> dict[str, Any]:
        prompts = [{"prompt": r.prompt, "multi_modal_data": {"image": r.images}} for r in requests]
        params = [SamplingParams(**{"temperature": 0, **args.sampling}, max_tokens=r.max_tokens, ignore_eos=True)
                  for r in requests]
        run_start = time.time()
        if message.get("sequential"):
            outs = [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        cached = sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)
        firsts = [first_token_time(o) for o in outs]
        return summarize(requests, [o.outputs[0].token_ids for o in outs], cached,
                         None if None in firsts else firsts, run_start)

    serve(out, start_seconds, reset, run)


if __name__ == "__main__":
    main()
