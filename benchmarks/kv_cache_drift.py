"""How far an FP8 KV cache (`--kv-cache-dtype fp8`, scales 1.0 as a checkpoint without
k_scale/v_scale gives them) moves a model from a bf16 KV cache, both with bf16 weights:

- the shipped model on a held-out set of the shapes world (`vlmserve eval`'s questions, a
  seed training never uses): accuracy with each cache, how many greedy answers stay the
  same, and the |logprob difference| of the answers' tokens up to where they part;
- a checkpoint at Qwen2.5-VL-3B's widths (random weights, `scale_checkpoints.py`, cut to
  `--layers`): the prompt's logprobs (a picture and text, teacher-forced) and the greedy
  continuation's, the same measures;
- the KV blocks each cache fits into the same memory.

    python benchmarks/kv_cache_drift.py                         # 100 pictures, 20 clips, 3B at 2 layers
    python benchmarks/kv_cache_drift.py --pictures 500 --videos 100 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import cpu_flags  # noqa: E402
from PIL import Image  # noqa: E402

from vlmserve import LLM, SamplingParams  # noqa: E402
from vlmserve.engine.model_source import SHIPPED_MODEL  # noqa: E402
from vlmserve.training import evaluate  # noqa: E402

CACHES = ("auto", "fp8")


def parted(reference: list[int], other: list[int]) -> int:
    """How many leading tokens two answers share."""
    n = 0
    while n < min(len(reference), len(other)) and reference[n] == other[n]:
        n += 1
    return n


def drift(ref_runs: list, runs: list) -> tuple[list[float], int, list[float]]:
    """|logprob difference| of every token two runs' answers share up to where they part,
    how many answers are the same throughout, and where they part, how far apart the
    reference's two best tokens were (logprobs=2: the chosen token, then the two best)."""
    diffs, same, margins = [], 0, []
    for ref, got in zip(ref_runs, runs):
        n = parted(ref.token_ids, got.token_ids)
        same += n == len(ref.token_ids) == len(got.token_ids)
        diffs += [abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(ref.logprobs[:n], got.logprobs[:n])]
        if n < min(len(ref.token_ids), len(got.token_ids)):
            margins.append(ref.logprobs[n].logprobs[1] - ref.logprobs[n].logprobs[2])
    return diffs, same, margins


def summary(diffs: list[float], margins: list[float]) -> str:
    parting = f"; where they part, the reference's two best within {max(margins):.4f}" if margins else ""
    return f"|dlogprob| max {max(diffs, default=0):.4f}, mean {statistics.mean(diffs) if diffs else 0:.5f}{parting}"


def engine(model: str, kv_cache_dtype: str, memory_gb: float, dtype: str = "bfloat16") -> tuple[LLM, int]:
    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gb=memory_gb)
    return llm, llm.engine.core.info.num_kv_blocks


def held_out(pictures: int, videos: int, memory_gb: float) -> None:
    items = evaluate.held_out_set(pictures, videos // 2, video_captions=videos - videos // 2)
    params = SamplingParams(temperature=0, max_tokens=evaluate.MAX_TOKENS, logprobs=2)
    runs, lines = {}, []
    for cache in CACHES:
        llm, blocks = engine(str(SHIPPED_MODEL), cache, memory_gb)
        runs[cache] = [o.outputs[0] for o in llm.chat([evaluate.chat_for(i) for i in items], params)]
        results = evaluate.score(items, [o.text for o in runs[cache]])
        good, total = sum(g for g, _ in results.values()), sum(t for _, t in results.values())
        lines.append(f"  {cache:<5} KV: {blocks:>6} blocks in {memory_gb} GB, accuracy {good}/{total} "
                     f"({100 * good / total:.1f}%)")
        del llm
    diffs, same, margins = drift(runs["auto"], runs["fp8"])
    print(f"the shipped model, held-out set ({pictures} pictures, {videos} clips, {len(items)} questions; "
          f"bf16 weights)")
    print("\n".join(lines))
    print(f"  greedy answers the same: {same}/{len(items)}; over their {len(diffs)} shared tokens "
          + summary(diffs, margins))


def three_b(layers: int, memory_gb: float, tokens: int) -> None:
    from scale_checkpoints import build

    path = build("qwen2_5_vl_3b", layers)
    chats = [[{"role": "user", "content": [{"type": "image", "image": Image.open(REPO / "samples" / name)},
                                           {"type": "text", "text": f"What is in picture {i}? Describe its shapes."}]}]
             for i, name in enumerate(["shapes1.png", "shapes2.png", "shapes3.jpg", "shapes4.png"])]
    params = SamplingParams(temperature=0, max_tokens=tokens, logprobs=2, prompt_logprobs=0, ignore_eos=True)
    runs, prompt_runs, blocks = {}, {}, {}
    # the yardstick: fp32 weights and KV against bf16's, the change bf16 itself makes
    for name, dtype, cache in (("bf16", "bfloat16", "auto"), ("fp8", "bfloat16", "fp8"), ("fp32", "float32", "auto")):
        llm, blocks[name] = engine(str(path), cache, memory_gb, dtype=dtype)
        outs = llm.chat(chats, params)
        runs[name] = [o.outputs[0] for o in outs]
        prompt_runs[name] = [o.prompt_logprobs[1:] for o in outs]  # the first token has none
        del llm
    print(f"Qwen2.5-VL-3B widths, {layers} layers, random weights ({len(chats)} prompts with a picture, "
          f"{tokens} greedy tokens each; bf16 weights)")
    print(f"  blocks in {memory_gb} GB: bf16 KV {blocks['bf16']}, fp8 KV {blocks['fp8']} "
          f"({blocks['fp8'] / blocks['bf16']:.2f}x)")
    for name, label in (("fp8", "fp8 KV against bf16 KV"), ("fp32", "(yardstick) fp32 against bf16 weights and KV")):
        prompt_diffs = [abs(a.logprobs[0] - b.logprobs[0]) for ref, got in zip(prompt_runs["bf16"], prompt_runs[name])
                        for a, b in zip(ref, got)]
        diffs, same, margins = drift(runs["bf16"], runs[name])
        print(f"  {label}: prompt tokens ({len(prompt_diffs)}) " + summary(prompt_diffs, []))
        print(f"    greedy: {len(diffs)}/{len(chats) * tokens} tokens before the answers part, {same}/{len(chats)} "
              f"the same throughout; " + summary(diffs, margins))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pictures", type=int, default=100, help="held-out pictures (each with every question kind)")
    p.add_argument("--videos", type=int, default=20, help="held-out clips (half direction, half caption questions)")
    p.add_argument("--layers", type=int, default=2, help="layers of the 3B-width checkpoint (0: skip it)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens a 3B-width prompt")
    p.add_argument("--memory-gb", type=float, default=0.5, help="KV cache memory of every engine")
    args = p.parse_args()
    print(f"CPU: {cpu_flags()}", flush=True)
    held_out(args.pictures, args.videos, args.memory_gb)
    if args.layers:
        three_b(args.layers, args.memory_gb, args.tokens)


if __name__ == "__main__":
    main()
