"""The cost of structured output: 64 concurrent requests of the peer workload (pictures,
a shared system prompt), half of them constrained by a JSON schema, against the same 64
requests unconstrained, alternating, caches emptied before each run. Every constrained
request has a schema of its own (a different enum), so 32 grammars compile during the
run: the longest step of each run shows whether compilation stalls the step loop. Then
the per-step cost of masking at Qwen's vocabulary (151,936 tokens).

    python benchmarks/bench_structured.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common import cpu_flags, peer_checkpoint, peer_workload, render_prompt

SHAPES = ["circle", "square", "triangle"]


def schema(i: int, run: int) -> dict:
    """Request i's schema in a given run: new every run, so its grammar is compiled cold."""
    return {"type": "object", "properties": {
        "request": {"type": "string", "enum": [f"r{i}.{run}"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "shapes": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "shape": {"type": "string", "enum": SHAPES},
            "where": {"type": "string", "maxLength": 16}}, "required": ["shape", "where"],
            "additionalProperties": False}}},
        "required": ["request", "count", "shapes"], "additionalProperties": False}


def run(llm, prompts, params) -> dict:
    engine = llm.engine
    if not engine.reset_caches():
        raise RuntimeError("requests still running")
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, p)
    steps, tokens, parsed, constrained = [], 0, 0, 0
    lengths = [0] * len(prompts)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                tokens += len(c.token_ids)
                lengths[int(out.request_id.split("-")[0][1:])] = len(c.token_ids)
                if out.request_id.split("-")[0] in constrained_ids:
                    constrained += 1
                    parsed += _parses(c.text)
        steps.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    return {"tok_s": tokens / wall, "wall": wall, "max_step": max(steps), "p50_step": statistics.median(steps),
            "parsed": parsed, "constrained": constrained, "lengths": lengths}


constrained_ids: set[str] = set()


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def mask_cost(rows: int, vocab: int = 151936, repeats: int = 20) -> float:
    """Seconds to apply a grammar bitmask to `rows` rows of logits at this vocabulary."""
    from vlmserve.worker.sampler import SamplingBatch, apply_logit_rules

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g)
    # a grammar allows a few hundred tokens at a time: 1% of the bits set, at random
    allowed = torch.rand(rows, (vocab + 31) // 32 * 32, generator=g) < 0.01
    bitmask = (allowed.view(rows, -1, 32).long() << torch.arange(32)).sum(-1).to(torch.int64)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)
    batch = SamplingBatch(torch.zeros(rows), torch.zeros(rows, dtype=torch.long), torch.ones(rows), torch.zeros(rows),
                          [None] * rows, [None] * rows, grammar=(torch.arange(rows), bitmask))
    copies = [logits.clone() for _ in range(repeats + 1)]
    apply_logit_rules(copies[-1], batch)
    t = time.perf_counter()
    for copy in copies[:repeats]:
        apply_logit_rules(copy, batch)
    return (time.perf_counter() - t) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from vlmserve import LLM, SamplingParams
    from vlmserve.sampling_params import StructuredOutputsParams

    model = peer_checkpoint("qwen2_5_vl")
    llm = LLM(model, max_num_seqs=256, max_num_batched_tokens=4096, kv_cache_memory_gb=2)
    processor = llm.engine.mm_processor.hf_processor
    requests, pictures = peer_workload(args.requests)
    prompts = [{"prompt": render_prompt(processor, r), "multi_modal_data": {"image": [pictures[i] for i in r["pictures"]]}}
               for r in requests]

    def half(run: int, lengths: list[int] | None = None) -> list:
        """Odd requests under a schema; even ones free, as long as `lengths` says."""
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=64,
                               structured_outputs=StructuredOutputsParams(json=schema(i, run))) if i % 2 else
                SamplingParams(temperature=1.0, seed=i, ignore_eos=True, max_tokens=lengths[i] if lengths else 64)
                for i in range(len(requests))]

    constrained_ids.update(f"r{i}" for i in range(1, len(requests), 2))
    print("CPU:", cpu_flags())
    print(f"model: peer qwen2_5_vl ({model}), vocabulary {len(processor.tokenizer)}, {args.threads} threads; "
          f"{len(requests)} requests at once, temperature 1; the constrained answers' lengths are measured first, "
          f"and each request then makes as many tokens in both runs")
    first = run(llm, prompts, half(9))  # warm-up; sets the lengths
    lengths = first["lengths"]
    free = [SamplingParams(temperature=1.0, seed=i, ignore_eos=True, max_tokens=n) for i, n in enumerate(lengths)]
    results = {"unconstrained": [], "half constrained": []}
    for rep in range(args.repeats):
        for name, params in (("unconstrained", free), ("half constrained", half(rep, lengths))):
            results[name].append(run(llm, prompts, params))
    print(f"{'run':<18} {'tok/s (median)':>14} {'runs':>18} {'tokens':>7} {'p50 step (ms)':>13} "
          f"{'longest step (ms)':>17} {'JSON that parses':>16}")
    for name, rs in results.items():
        tok = statistics.median(r["tok_s"] for r in rs)
        answers = f"{sum(r['parsed'] for r in rs)}/{sum(r['constrained'] for r in rs)}" if name != "unconstrained" else "-"
        tokens = sum(sum(r["lengths"]) for r in rs)
        runs = " ".join(f"{r['tok_s']:.0f}" for r in rs)
        print(f"{name:<18} {tok:>14.1f} {runs:>18} {tokens:>7} "
              f"{statistics.median(r['p50_step'] for r in rs) * 1e3:>13.1f} "
              f"{max(r['max_step'] for r in rs) * 1e3:>17.1f} {answers:>16}")
    ratio = statistics.median(r["tok_s"] for r in results["half constrained"]) / statistics.median(
        r["tok_s"] for r in results["unconstrained"])
    print(f"half constrained / unconstrained: {ratio:.3f} ({(1 - ratio) * 100:+.1f}% overhead)")
    for rows in (32, 64):
        print(f"grammar mask over {rows} rows at a 151,936-token vocabulary: {mask_cost(rows) * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
