"""Same multimodal workload through vlmserve and through transformers' batched
`generate`, in one run, on one checkpoint. Prints both throughputs and their ratio.

    python benchmarks/bench_throughput.py [--requests 32] [--repeats 3] [--hf-batch 8]

Both sides decode greedily with EOS ignored, so they produce the same number of tokens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_checkpoint, median_time, workload  # noqa: E402


def chat_prompt(processor, text: str, n_images: int) -> str:
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def run_vlmserve(llm, reqs) -> int:
    from vlmserve import SamplingParams

    proc = llm.engine.mm_processor.hf_processor
    prompts = [{"prompt": chat_prompt(proc, r["text"], len(r["images"])), "multi_modal_data": {"image": r["images"]}}
               for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(model, processor, reqs, batch_size: int) -> int:
    total = 0
    for i in range(0, len(reqs), batch_size):
        chunk = reqs[i : i + batch_size]
        texts = [chat_prompt(processor, r["text"], len(r["images"])) for r in chunk]
        images = [img for r in chunk for img in r["images"]]
        inp = processor(text=texts, images=images or None, return_tensors="pt", padding=True, padding_side="left")
        max_new = max(r["max_tokens"] for r in chunk)
        with torch.no_grad():
            out = model.generate(**inp, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
        # count what each request asked for (the batch runs to the longest one)
        total += sum(min(r["max_tokens"], out.shape[1] - inp["input_ids"].shape[1]) for r in chunk)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf-batch", default="8,16,32", help="batch sizes tried for transformers; its best counts")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    path = bench_checkpoint()
    reqs = workload(args.requests)

    from transformers import AutoModelForImageTextToText, AutoProcessor

    from vlmserve import LLM

    t = time.perf_counter()
    llm = LLM(path, dtype=args.dtype)
    vlm_startup = time.perf_counter() - t
    params_m = sum(p.numel() for p in llm.engine.engine_core.runner.model.parameters()) / 1e6

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()

    tokens = {}

    def vlm():
        llm.engine.reset_caches()  # every repeat starts cold: no prefix, encoder or processor cache hits across runs
        tokens["vlmserve"] = run_vlmserve(llm, reqs)

    vlm()  # warm-up (first-call allocations)
    t_vlm, all_vlm = median_time(vlm, args.repeats)
    hf_results = {}
    for batch in [int(b) for b in args.hf_batch.split(",")]:
        def hf():
            tokens["transformers"] = run_transformers(model, processor, reqs, batch)

        hf()
        hf_results[batch] = median_time(hf, args.repeats)
    best_batch = min(hf_results, key=lambda b: hf_results[b][0])
    t_hf = hf_results[best_batch][0]
    tps_vlm = tokens["vlmserve"] / t_vlm
    tps_hf = tokens["transformers"] / t_hf
    print(f"checkpoint: Qwen2.5-VL {params_m:.1f}M parameters, {args.dtype}, {args.threads} threads")
    print(f"workload: {len(reqs)} requests ({sum(bool(r['images']) for r in reqs)} with an image), "
          f"{tokens['vlmserve']} output tokens, median of {args.repeats} runs")
    print(f"vlmserve startup: {vlm_startup:.2f}s")
    print(f"vlmserve:     {t_vlm:6.2f}s  {tps_vlm:8.1f} tok/s  (runs: {', '.join(f'{x:.2f}' for x in all_vlm)})")
    for batch, (t, runs) in hf_results.items():
        mark = "  <- best" if batch == best_batch else ""
        print(f"transformers: {t:6.2f}s  {tokens['transformers'] / t:8.1f} tok/s  "
              f"(generate, batch {batch}; runs: {', '.join(f'{x:.2f}' for x in runs)}){mark}")
    print(f"ratio (vlmserve / best transformers, median throughput): {tps_vlm / tps_hf:.2f}x")


if __name__ == "__main__":
    main()
