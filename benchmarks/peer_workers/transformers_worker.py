"""bench_peers.py's transformers worker: `generate` over static batches of `--batch`
requests (a run message may carry another "batch"), left padded, greedy; each batch runs
to its longest request and each request counts its own max_tokens."""

from __future__ import annotations

import os
import time
from typing import Any

from protocol import Request, load_workload, protocol_stdout, serve, summarize, worker_args, workload_of


def main() -> None:
    out = protocol_stdout()
    ap = worker_args(__doc__)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--batch", type=int, default=16, help="requests per generate call")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForImageTextToText, AutoProcessor, LogitsProcessor, LogitsProcessorList

    class FirstToken(LogitsProcessor):
        """Notes when generate first has logits: a batch's first tokens come then."""

        def __init__(self) -> None:
            self.time: float | None = None

        def __call__(self, input_ids, scores):
            self.time = self.time or time.time()
            return scores

    default = load_workload(args.workload)
    do_sample = args.sampling.get("temperature", 0) > 0  # as vlmserve and vLLM: greedy at temperature 0
    sampling = args.sampling if do_sample else {}
    t = time.perf_counter()
    processor = AutoProcessor.from_pretrained(args.model)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    start_seconds = time.perf_counter() - t

    def generate(chunk: list[Request]) -> tuple[list[list[int]], float]:
        images = [r.images for r in chunk]  # per prompt (Gemma 3's processor needs them so)
        inputs = processor(text=[r.prompt for r in chunk], images=images if any(images) else None, return_tensors="pt",
                           padding=True, padding_side="left").to(args.device)
        longest = max(r.max_tokens for r in chunk)
        first = FirstToken()
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=longest, min_new_tokens=longest,
                                 do_sample=do_sample, **sampling,
                                 logits_processor=LogitsProcessorList([first]))
        new = out[:, inputs["input_ids"].shape[1] :]
        return [new[i, : r.max_tokens].tolist() for i, r in enumerate(chunk)], first.time

    def run(message: dict) -> dict[str, Any]:
        requests = workload_of(message, default)
        batch = 1 if message.get("sequential") else int(message.get("batch", args.batch))
        token_ids, first_times = [], []
        run_start = time.time()
        for i in range(0, len(requests), batch):
            ids, first = generate(requests[i : i + batch])
            token_ids += ids
            first_times += [first] * len(ids)
        return summarize(requests, token_ids, 0, first_times, run_start)

    serve(out, start_seconds, lambda: None, run)


if __name__ == "__main__":
    main()
