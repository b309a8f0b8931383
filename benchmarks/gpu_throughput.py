"""Throughput at published widths on a GPU: vlmserve (CUDA graphs for decode and
asynchronous scheduling, its defaults; without asynchronous scheduling; eager), and
transformers `generate`, on the same GPU, one engine at a time, on scale_checkpoints.py's
checkpoints (published widths, full depth or cut by --layers, random weights drawn on the
GPU):

- one user: one chat about a 1-megapixel picture, 256 answer tokens (after a warm-up run
  of the same); decode tokens/s and its share of the HBM roofline: the weights a decode
  step reads (common.checkpoint_costs) times the steps a second, over the bandwidth of a
  large device-to-device copy (bytes read plus written) measured first;
- batches: for each of --batch-requests, that many chats about pictures of 336-1024 px,
  32-256 answer tokens, all at once (every engine is sized to run the largest whole;
  transformers: one generate call over the batch), and each batch's tokens/s against one
  user's decode;
- CUDA graphs and asynchronous scheduling: the one user's tokens the same with and
  without each, and their speed-ups;
- where vlmserve's one-user steps spend their time (milliseconds a step per phase: the
  host's scheduling, inputs, sampling, update and output processing, its wait for the
  GPU) and the host's milliseconds a step in all.

    python benchmarks/gpu_throughput.py OUT.json [--families qwen2_5_vl_3b,qwen3_5] [--layers 0]
        [--batch-requests 16,64] [--budget 300]

Run by benchmarks/gpu_check.py (its throughput step); OUT.json is rewritten after each
engine, so a run cut short still leaves its numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_peers import WORKERS, Worker, write_workload  # noqa: E402
from common import checkpoint_costs  # noqa: E402
from scale_checkpoints import build as build_scale_checkpoint  # noqa: E402

MIN_FAMILY_SECONDS = 100.0  # a family is left out when less than this is left of the budget


def gpu_limits() -> dict[str, float]:
    """The device's bandwidth (a 2 GiB bf16 device-to-device copy: bytes read plus
    written, GB/s) and bf16 matmul peak (8192^3 on random data, TFLOP/s): medians."""
    import torch
    from triton.testing import do_bench

    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    x = y = a = b = None  # the memory back to the engines
    torch.cuda.empty_cache()
    return {"copy_gbs": 2 * (1 << 31) / copy_ms / 1e6, "bf16_tflops": 2 * 8192**3 / mm_ms / 1e9,
            "device": torch.cuda.get_device_name(0)}


def one_user_figures(run: dict[str, Any], step_bytes: float, copy_gbs: float) -> dict[str, Any]:
    """Time to first token, decode tokens/s after it, that decode's share of the
    bandwidth roofline, and (vlmserve) the host's milliseconds a step in each phase."""
    ttft = run["ttft"][0] if run.get("ttft") else None
    decode = (run["tokens"] - 1) / (run["seconds"] - ttft) if ttft is not None else None
    figures = {"seconds": round(run["seconds"], 3), "tokens": run["tokens"], "ttft_s": ttft and round(ttft, 3),
               "decode_tok_s": decode and round(decode, 1),
               "hbm_share": decode and round(decode * step_bytes / (copy_gbs * 1e9), 3),
               "first_tokens": run["first_tokens"]}
    if run.get("steps"):
        figures["phase_ms_per_step"] = {name: round(1e3 * seconds / run["steps"], 3)
                                        for name, seconds in sorted(run["phases"].items(), key=lambda x: -x[1])}
        if "host_seconds" in run:
            figures["host_ms_per_step"] = round(1e3 * run["host_seconds"] / run["steps"], 3)
    return figures


def run_engine(name: str, command: list[str], folder: Path, batches: dict[int, Path], step_bytes: float,
               copy_gbs: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "8"}
    worker = Worker(name, command, env, folder / f"{name.replace(' ', '-')}.log")
    try:
        ready = worker.receive()
        worker.run(sequential=True)  # warm-up: compiles, captures, the allocator's first growth
        one = worker.run(sequential=True)
        runs = {size: worker.run(workload=str(workload)) for size, workload in batches.items()}
    except Exception as e:  # noqa: BLE001 - the engine's failure is a finding
        return {"error": f"{type(e).__name__}: {e}", "log_tail": worker.stderr_tail(4000)}
    finally:
        worker.stop()
    one_user = one_user_figures(one, step_bytes, copy_gbs)
    return {"start_s": round(ready["start_seconds"], 2), "one_user": one_user,
            "batches": {size: batch_figures(run, one_user) for size, run in runs.items()}}


def batch_figures(run: dict[str, Any], one_user: dict[str, Any]) -> dict[str, Any]:
    """A batch's tokens/s, and against one user's decode (a batch that ran whole costs about
    a step of one a step: with 16 requests, many times one user's tokens/s)."""
    tok_s = run["tokens"] / run["seconds"]
    return {"seconds": round(run["seconds"], 3), "tokens": run["tokens"], "tok_s": round(tok_s, 1),
            "x_one_user": one_user["decode_tok_s"] and round(tok_s / one_user["decode_tok_s"], 2),
            "first_tokens": run["first_tokens"]}


def run_family(family: str, args: argparse.Namespace, limits: dict[str, float], report: dict[str, Any],
               save) -> dict[str, Any]:
    t = time.perf_counter()
    model = str(build_scale_checkpoint(family, args.layers or None, device="cuda"))
    out: dict[str, Any] = {"checkpoint": model, "layers": args.layers or "published",
                           "build_s": round(time.perf_counter() - t, 1)}
    report[family] = out
    costs = checkpoint_costs(model)
    step_bytes = costs["decode_bytes"]
    out["decode_gb_per_step"] = round(step_bytes / 1e9, 3)
    out["roofline_tok_s"] = round(limits["copy_gbs"] * 1e9 / step_bytes, 1)
    folder = Path(tempfile.mkdtemp(prefix=f"gpu-throughput-{family}-"))
    (folder / "one").mkdir()
    one_spec, _ = write_workload(folder / "one", model, "one-user", 1)
    sizes = [int(n) for n in str(args.batch_requests).split(",")]
    batches, specs = {}, list(one_spec)
    for size in sizes:
        (folder / f"batch{size}").mkdir()
        specs += write_workload(folder / f"batch{size}", model, "batch", size)[0]
        batches[size] = folder / f"batch{size}" / "workload.json"
    longest = max(r["prompt_tokens"] + r["max_tokens"] for r in specs)
    common = ["--workload", str(folder / "one" / "workload.json"), "--model", model, "--dtype", "bfloat16",
              "--device", "cuda", "--max-model-len", str(max(4096, 1024 * -(-longest // 1024))),
              "--max-images", "2", "--threads", "8"]
    # --profile: wall time per phase of the steps; sized for the largest batch (sized for the
    # one-user workload the engine ran a batch one request at a time: the first GPU run's
    # batch of 16 at 1.1x one user)
    vlmserve = [sys.executable, str(WORKERS / "vlmserve_worker.py"), *common, "--profile",
                "--max-num-seqs", str(max(sizes))]
    engines = {"vlmserve": vlmserve, "vlmserve sync": [*vlmserve, "--async-scheduling", "off"],
               "vlmserve eager": [*vlmserve, "--enforce-eager"],
               "transformers": [sys.executable, str(WORKERS / "transformers_worker.py"), *common,
                                "--batch", str(max(sizes))]}
    out["engines"] = {}
    for name, command in engines.items():
        out["engines"][name] = run_engine(name, command, folder, batches, step_bytes, limits["copy_gbs"])
        save()
    out.update(compare(out["engines"]))
    return out


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The engines against each other: CUDA graphs against eager (the one user's tokens
    equal: a batch of one runs the same kernels either way; in a batch, padded to a
    captured size, bf16 matmuls of another height may round differently, so there the
    share of requests whose first 8 tokens agree), vlmserve against transformers (speed
    ratios, first tokens agreeing); ok when every engine ran and the one user's tokens
    are the same with graphs as without."""
    out: dict[str, Any] = {}
    fine = [n for n, r in results.items() if "error" not in r]
    for other, key in (("vlmserve eager", "cuda_graphs"), ("vlmserve sync", "async_scheduling")):
        if {"vlmserve", other} <= set(fine):
            out[key] = speedups(results["vlmserve"], results[other])
    if {"vlmserve", "transformers"} <= set(fine):
        ours, theirs = results["vlmserve"], results["transformers"]
        largest = max(ours["batches"])
        out["vs_transformers"] = {
            "one_user_decode": round(ours["one_user"]["decode_tok_s"] / theirs["one_user"]["decode_tok_s"], 2),
            "batch": round(ours["batches"][largest]["tok_s"] / theirs["batches"][largest]["tok_s"], 2),
            "first_token_agreement": agreement(ours["batches"][largest]["first_tokens"],
                                               theirs["batches"][largest]["first_tokens"], 1)}
    out["ok"] = len(fine) == len(results) and all(out.get(k, {}).get("same_tokens", False)
                                                  for k in ("cuda_graphs", "async_scheduling"))
    return out


def speedups(ours: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """vlmserve's defaults against a run without one of them: the one user's tokens the same,
    in batches the share of requests whose first 8 agree (padded to a captured size, bf16
    matmuls of another height may round differently), and the speed-ups."""
    largest = max(ours["batches"])
    return {"same_tokens": ours["one_user"]["first_tokens"] == other["one_user"]["first_tokens"],
            "batch_agreement": agreement(ours["batches"][largest]["first_tokens"],
                                         other["batches"][largest]["first_tokens"], 8),
            "decode_speedup": round(ours["one_user"]["decode_tok_s"] / other["one_user"]["decode_tok_s"], 2),
            "batch_speedup": round(ours["batches"][largest]["tok_s"] / other["batches"][largest]["tok_s"], 2)}


def agreement(a: list[list[int]], b: list[list[int]], n: int) -> float:
    """The share of requests whose first n tokens are the same."""
    return round(sum(x[:n] == y[:n] for x, y in zip(a, b)) / max(len(a), 1), 3)


def measure(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """The throughput step (gpu_steps.py throughput): every family that fits the budget."""
    start = time.perf_counter()
    report: dict[str, Any] = {"budget_s": args.budget}

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    # the check ends a step that overruns with SIGTERM: stop the engines' workers first
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    report["limits"] = limits = gpu_limits()
    save()
    families = {}
    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        left = args.budget - (time.perf_counter() - start)
        if left < MIN_FAMILY_SECONDS:
            report.setdefault("left_out", []).append(f"{family}: {left:.0f} s of the budget left")
            continue
        families[family] = run_family(family, args, limits, report, save)
        save()
    report["seconds"] = round(time.perf_counter() - start, 1)
    return bool(families) and all(f["ok"] for f in families.values()), report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--families", default="qwen2_5_vl_3b,qwen3_5")
    ap.add_argument("--layers", type=int, default=0, help="text and vision layers kept (0: the published depth)")
    ap.add_argument("--batch-requests", default="16,64", help="the batches' sizes")
    ap.add_argument("--budget", type=float, default=300.0)
    args = ap.parse_args()
    ok, report = measure(args)
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: v for k, v in report.items() if k != "limits"}, indent=1, default=str)[:6000])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
