"""bench_embed.py's worker: embeds the workload's prompts (one picture each) with
vlmserve's or vLLM's `LLM.embed` (last token, normalised), or with transformers (the bare
model's last hidden state, static batches), run by the engine's own python."""

from __future__ import annotations

import os
import time
from typing import Any

from protocol import load_workload, protocol_stdout, serve, worker_args


def main() -> None:
    out = protocol_stdout()
    ap = worker_args(__doc__)
    ap.add_argument("--engine", choices=["vlmserve", "vllm", "transformers"], required=True)
    ap.add_argument("--batch", type=int, default=8, help="transformers: pictures per forward")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    args = ap.parse_args()
    requests = load_workload(args.workload)
    prompts = [{"prompt": r.prompt, "multi_modal_data": {"image": r.images}} for r in requests]
    t = time.perf_counter()
    if args.engine == "vlmserve":
        import torch

        torch.set_num_threads(args.threads)
        from vlmserve import LLM

        llm = LLM(args.model, dtype=args.dtype, runner="pooling", max_model_len=args.max_model_len,
                  kv_cache_memory_gb=2.0, limit_mm_per_prompt={"image": args.max_images, "video": 0})
        reset = llm.engine.reset_caches

        def embed() -> list:
            return [o.outputs.embedding for o in llm.embed(prompts)]
    elif args.engine == "vllm":
        from vllm import LLM

        llm = LLM(model=args.model, dtype=args.dtype, runner="pooling", gpu_memory_utilization=0.3,
                  max_model_len=args.max_model_len, enable_prefix_caching=True,
                  limit_mm_per_prompt={"image": args.max_images, "video": 0}, seed=0,
                  pooler_config={"pooling_type": "LAST", "use_activation": True})  # 0.32's name for normalize

        def reset() -> None:
            llm.reset_prefix_cache()
            if hasattr(llm, "reset_mm_cache"):
                llm.reset_mm_cache()

        def embed() -> list:
            return [o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)]
    else:
        import torch
        from transformers import AutoModel, AutoProcessor

        torch.set_num_threads(args.threads)
        processor = AutoProcessor.from_pretrained(args.model)
        processor.tokenizer.padding_side = "left"  # the last token of every row is the prompt's last
        model = AutoModel.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()

        def reset() -> None:
            pass

        @torch.no_grad()
        def embed() -> list:
            vectors = []
            for i in range(0, len(requests), args.batch):
                chunk = requests[i : i + args.batch]
                inputs = processor(text=[r.prompt for r in chunk], images=[r.images for r in chunk], padding=True,
                                   return_tensors="pt")
                hidden = model(**inputs).last_hidden_state[:, -1].float()
                vectors += torch.nn.functional.normalize(hidden, dim=-1).tolist()
            return vectors
    start_seconds = time.perf_counter() - t

    def run(message: dict) -> dict[str, Any]:
        vectors = embed()
        return {"tokens": len(vectors), "first": [round(v, 4) for v in vectors[0][:8]], "exact_lengths": True,
                "cached_tokens": 0, "first_tokens": [], "ttft": None}

    serve(out, start_seconds, reset, run)


if __name__ == "__main__":
    main()
