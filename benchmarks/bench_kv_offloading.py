"""A chat about a picture that comes back after its KV blocks were evicted: time to first
token with the host tier (`--kv-offloading-size`, the blocks copied back) against without it
(the prefix computed again), at Qwen2.5-VL-3B's widths (random weights, cut to --layers).

Both engines are loaded at once and take turns; each round asks about the returning
picture's rivals first (they evict its blocks from the device cache), then about it with a
new question, timed to its one token. The picture's encoder output stays in the encoder
cache in both (the recompute's best case: its tower does not run again).

    python benchmarks/bench_kv_offloading.py                # 8 layers, a 896x896 picture, 5 rounds
    python benchmarks/bench_kv_offloading.py --layers 36    # the whole depth
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import cpu_flags, machine_limits, synthetic_image  # noqa: E402

from vlmserve import LLM, SamplingParams  # noqa: E402

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def chat(seed: int, side: int, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": synthetic_image(side, side, seed)},
                                         {"type": "text", "text": question}]}]


def timed_return(llm: LLM, side: int, rivals: int, round_: int) -> tuple[float, int]:
    """Evicts the returning picture (seed 0) with `rivals` other pictures, then asks about it
    again: seconds to its first token, and its cached prompt tokens."""
    for seed in range(1, rivals + 1):
        llm.chat(chat(1000 * round_ + seed, side, "Describe the image."), ONE_TOKEN)
    start = time.perf_counter()
    out = llm.chat(chat(0, side, f"Question {round_}: what is in the picture?"), ONE_TOKEN)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="text and vision layers of the 3B-width checkpoint")
    p.add_argument("--model", default=None, help="a full-attention checkpoint folder instead of the 3B-width one")
    p.add_argument("--side", type=int, default=896, help="the pictures' side in pixels (896: 1024 picture tokens)")
    p.add_argument("--rivals", type=int, default=3, help="other pictures asked about between the returns")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--host-gb", type=float, default=2.0, help="--kv-offloading-size")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    from scale_checkpoints import build

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_flags()}", flush=True)
    limits = machine_limits(args.threads)
    path = args.model or str(build("qwen2_5_vl_3b", args.layers))
    # room for one picture's prompt and a little more: each rival evicts the one before it
    tokens = (args.side // 28) ** 2 + 64
    blocks = 2 * tokens // 16
    common = dict(dtype="bfloat16", num_kv_blocks=blocks, max_model_len=tokens + 32)
    engines = {"recompute": LLM(path, **common), "host tier": LLM(path, kv_offloading_size=args.host_gb, **common)}
    for llm in engines.values():  # each engine's first picture (warm-up, not timed)
        llm.chat(chat(0, args.side, "Describe the image."), ONE_TOKEN)
    times: dict[str, list[float]] = {name: [] for name in engines}
    cached: dict[str, list[int]] = {name: [] for name in engines}
    for r in range(1, args.rounds + 1):
        for name, llm in engines.items():
            seconds, hits = timed_return(llm, args.side, args.rivals, r)
            times[name].append(seconds)
            cached[name].append(hits)
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.3f} s ({cached[n][-1]} cached)" for n in engines),
              flush=True)
    host = engines["host tier"].engine.stats()
    checkpoint = args.model or f"Qwen2.5-VL-3B widths, {args.layers} layers"
    print(f"{checkpoint}, bf16, a {args.side}x{args.side} picture "
          f"({tokens - 64} picture tokens), {blocks} device blocks; {args.rivals} rivals a round, {args.rounds} rounds")
    print(f"machine: copy {limits['copy_gbs']:.1f} GB/s, {limits['matmul_dtype']} matmul "
          f"{limits['matmul_tflops']:.2f} TFLOP/s")
    medians = {n: statistics.median(t) for n, t in times.items()}
    for name in engines:
        print(f"{name:<10} first token: median {medians[name]:.3f} s, cached tokens {statistics.median(cached[name]):.0f}")
    loaded = host.connector_blocks_loaded * host.connector_block_bytes
    print(f"host tier: {host.connector_blocks_saved} blocks saved, {host.connector_blocks_loaded} loaded "
          f"({loaded / 1e6:.0f} MB back over {args.rounds + 0} returns), {host.connector_blocks_held} held")
    print(f"host tier / recompute: {medians['recompute'] / medians['host tier']:.1f}x faster to the first token")


if __name__ == "__main__":
    main()
