"""One user decoding with bf16 weights and with the language layers quantized at load,
the engines in one process taking turns every few tokens: this machine's read bandwidth
moves by +-20% within tens of seconds, so engines measured in separate, longer runs do not
compare. Each round decodes `--tokens` tokens with every engine (a text prompt, greedy,
EOS ignored; from the first token to the last); printed: each round's tok/s and ratio to
bf16, the medians, and each engine's share of the bandwidth roofline (bytes a step reads /
the read bandwidth measured before the rounds).

    python benchmarks/bench_quantized_decode.py [--model PATH] [--quantizations int8,int4] [--rounds 12]

The default model is the Qwen2.5-VL-3B-wide checkpoint at full depth
(`python benchmarks/scale_checkpoints.py qwen2_5_vl_3b` builds it).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import CACHE, checkpoint_costs, cpu_flags, decode_step_bytes, machine_limits  # noqa: E402


def tokens_per_second(llm, seed: int, tokens: int) -> float:
    """Decode speed of one request: its tokens after the first over the time between its
    first and last token (the engine's own timestamps)."""
    from vlmserve import SamplingParams

    chat = [{"role": "user", "content": [{"type": "text", "text": f"Tell me a story, number {seed}."}]}]
    [out] = llm.chat(chat, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    m = out.metrics
    return (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=CACHE / "scale-qwen2_5_vl_3b-full-v2")
    ap.add_argument("--quantizations", default="int8,int4")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=33, help="tokens each engine decodes per round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import torch

    from vlmserve import LLM

    torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_flags()}, {args.threads} threads")
    limits = machine_limits(args.threads)
    print(f"machine: read {limits['read_gbs']:.1f} GB/s (measured before the rounds)")
    methods: list[str | None] = [None] + [q for q in args.quantizations.split(",") if q]
    names = {m: m or "bf16" for m in methods}
    llms = {m: LLM(str(args.model), dtype="bfloat16", quantization=m) for m in methods}
    for m in methods:  # warm-up
        tokens_per_second(llms[m], 0, 9)
    speeds: dict[str | None, list[float]] = {m: [] for m in methods}
    for r in range(args.rounds):
        for m in methods:
            speeds[m].append(tokens_per_second(llms[m], r + 1, args.tokens))
        print(f"round {r + 1}: " + ", ".join(
            f"{names[m]} {speeds[m][-1]:.2f} tok/s ({speeds[m][-1] / speeds[None][-1]:.2f}x)" for m in methods),
            flush=True)
    costs = checkpoint_costs(str(args.model))
    print(f"{'weights':<8}{'tok/s':>8}{'x bf16':>8}{'rounds (x bf16)':>20}{'GB a step':>11}{'of roofline':>13}")
    for m in methods:
        ratios = [a / b for a, b in zip(speeds[m], speeds[None])]
        step = decode_step_bytes(costs, m, head_quantized=m is not None)
        median = statistics.median(speeds[m])
        print(f"{names[m]:<8}{median:>8.2f}{statistics.median(ratios):>8.2f}"
              f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>20}{step / 1e9:>11.3f}"
              f"{median * step / (limits['read_gbs'] * 1e9):>13.0%}")


if __name__ == "__main__":
    main()
