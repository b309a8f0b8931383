"""Tensor and pipeline parallelism on this machine: the same cores as one rank or split
into ranks.

    python benchmarks/bench_tensor_parallel.py [--layers 8] [--rounds 2] [--splits 1x1,2x1,1x2]

On Qwen2.5-VL-3B's widths (`scale_checkpoints.py`, bf16, `--layers` deep), each engine in a
fresh process, alternating (each split TPxPP: one rank with every thread, then TP x PP
ranks with threads / ranks each):
- one user: a chat about a 1-megapixel picture, 128 answer tokens (time to first token,
  decode tokens/s);
- a batch: 16 chats over 5 pictures, 64 answer tokens each (output tokens/s);
- the peak resident memory of each rank's process (its weights are 1/N of the split ones).

On a CPU the ranks share the machine's memory bandwidth and cores, so splitting buys
nothing there but capacity (a rank holds 1/N of the language model); the figures say what
the all-reduces cost. Medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import checkpoint_costs, cpu_flags, read_bandwidth, render_prompt, synthetic_image  # noqa: E402


def peak_rss_of(pid: int) -> int:
    """A process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    return 0


def children_of(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def worker(model: str, tp: int, pp: int) -> dict:
    """One engine's run, in this process: timings and each rank's peak memory."""
    from transformers import AutoProcessor

    from vlmserve import LLM, SamplingParams

    processor = AutoProcessor.from_pretrained(model)
    llm = LLM(model, dtype="bfloat16", tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_seqs=16,
              kv_cache_memory_gb=2)

    def prompt(question: str, picture) -> dict:
        text = render_prompt(processor, {"question": question, "pictures": [0]})
        return {"prompt": text, "multi_modal_data": {"image": [picture]}}

    one = prompt("Describe the image.", synthetic_image(1024, 1024, 3000))
    llm.generate([prompt("Warm up.", synthetic_image(336, 336, 1))], SamplingParams(max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    out = llm.generate([one], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))[0]
    total = time.perf_counter() - start
    ttft = out.metrics.first_token_time - out.metrics.arrival_time
    pictures = [synthetic_image(448 + 64 * i, 512, 4000 + i) for i in range(5)]
    batch = [prompt(f"Picture {i}: what is in it?", pictures[i % 5]) for i in range(16)]
    start = time.perf_counter()
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    batch_s = time.perf_counter() - start
    ranks = [os.getpid(), *children_of(os.getpid())]
    peaks = sorted((peak_rss_of(pid) for pid in ranks), reverse=True)[: tp * pp]
    llm.engine.shutdown()
    return {"ttft_s": ttft, "decode_tok_s": 127 / (total - ttft),
            "batch_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / batch_s,
            "peak_gb": [p / 1e9 for p in peaks]}


def ranks_of(split: str) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes of a split written TPxPP."""
    tp, pp = split.split("x")
    return int(tp), int(pp)


def ranks(split: str) -> int:
    tp, pp = ranks_of(split)
    return tp * pp


def run(model: str, split: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, __file__, "--worker", split, "--model", model], capture_output=True,
                         text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{split} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--splits", default="1x1,2x1,1x2", help="tensor x pipeline parallel sizes")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.model, *ranks_of(args.worker))))
        return
    from scale_checkpoints import build

    model = str(build("qwen2_5_vl_3b", args.layers))
    splits = args.splits.split(",")
    print(f"CPU: {cpu_flags()}; {args.threads} threads in all; Qwen2.5-VL-3B widths, {args.layers} layers, bf16")
    results: dict[str, list[dict]] = {split: [] for split in splits}
    for _ in range(args.rounds):
        for split in splits:
            results[split].append(run(model, split, max(1, args.threads // ranks(split))))
    # one user's decode against the roofline: every rank together reads the whole language
    # model and head once a token, over the machine's one memory bus (measured after the runs)
    step_bytes, read_gbs = checkpoint_costs(model)["decode_bytes"], read_bandwidth(args.threads)
    print(f"a decode step reads {step_bytes / 1e9:.2f} GB; this machine reads {read_gbs:.1f} GB/s")
    print("\n| TP x PP (threads each) | one user: first token s | decode tok/s (of roofline) | batch of 16: tok/s "
          "| peak GB per rank |")
    print("| --- | --- | --- | --- | --- |")
    for split, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "decode_tok_s", "batch_tok_s")}
        peaks = ", ".join(f"{max(r['peak_gb'][i] for r in runs):.2f}" for i in range(ranks(split)))
        share = med["decode_tok_s"] * step_bytes / (read_gbs * 1e9)
        print(f"| {split} ({max(1, args.threads // ranks(split))}) | {med['ttft_s']:.2f} | {med['decode_tok_s']:.1f} "
              f"({share:.0%}) | {med['batch_tok_s']:.1f} | {peaks} |")


if __name__ == "__main__":
    main()
