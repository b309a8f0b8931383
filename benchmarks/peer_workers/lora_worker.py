"""bench_lora.py's worker: vlmserve's or vLLM's `LLM` with LoRA on (both take the same
`LoRARequest(name, id, path)` per prompt), run by the engine's own python. A run message
names each request's adapter folder (None: the base model)."""

from __future__ import annotations

import os
import time
from typing import Any

from protocol import load_workload, protocol_stdout, serve, summarize, worker_args


def main() -> None:
    out = protocol_stdout()
    ap = worker_args(__doc__)
    ap.add_argument("--engine", choices=["vlmserve", "vllm"], required=True)
    ap.add_argument("--max-loras", type=int, default=4)
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = ap.parse_args()
    requests = load_workload(args.workload)
    lora = dict(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    t = time.perf_counter()
    if args.engine == "vlmserve":
        import torch

        torch.set_num_threads(args.threads)
        from vlmserve import LLM, LoRARequest, SamplingParams

        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_memory_gb=2.0,
                  limit_mm_per_prompt={"image": args.max_images, "video": 0}, **lora)
        reset = llm.engine.reset_caches
    else:
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        llm = LLM(model=args.model, dtype=args.dtype, gpu_memory_utilization=0.3, max_model_len=args.max_model_len,
                  enable_prefix_caching=True, limit_mm_per_prompt={"image": args.max_images, "video": 0}, seed=0,
                  max_num_seqs=256, max_num_batched_tokens=4096, **lora)

        def reset() -> None:
            llm.reset_prefix_cache()
            if hasattr(llm, "reset_mm_cache"):
                llm.reset_mm_cache()
    start_seconds = time.perf_counter() - t
    ids: dict[str, int] = {}

    def adapter(path: str | None):
        if path is None:
            return None
        ids.setdefault(path, len(ids) + 1)
        return LoRARequest(os.path.basename(path), ids[path], path)

    def run(message: dict) -> dict[str, Any]:
        prompts = [{"prompt": r.prompt, "multi_modal_data": {"image": r.images}} for r in requests]
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        loras = [adapter(p) for p in message["adapters"]]
        outs = llm.generate(prompts, params, lora_request=loras)
        return summarize(requests, [o.outputs[0].token_ids for o in outs], 0)

    serve(out, start_seconds, reset, run)


if __name__ == "__main__":
    main()
