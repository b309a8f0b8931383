"""Captioning a folder: the `vlmserve caption` command (continuous batching) against a
plain loop over transformers' `generate`, one image at a time, on the same folder and
checkpoint. Prints images/s for both (medians, model loading included) and the ratio.

    python benchmarks/bench_caption.py [--images 128] [--repeats 3] [--model PATH] [--max-tokens 32]

Default model: the shipped one (shapes pictures are generated for it); with --model, the
pictures are generic synthetic photos.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import synthetic_image  # noqa: E402


def make_folder(folder: Path, n: int, shapes_world: bool) -> list[str]:
    from vlmserve.training import shapes

    rng = random.Random(0)
    paths = []
    for i in range(n):
        if shapes_world:
            img = shapes.render(shapes.random_scene(rng), rng)
        else:
            img = synthetic_image(rng.choice([320, 448, 640]), rng.choice([240, 336, 480]), seed=i)
        path = folder / f"img{i:04d}.png"
        img.save(path)
        paths.append(str(path))
    return paths


def run_cli(model: str | None, folder: Path, out: Path, max_tokens: int, batch: int) -> tuple[float, float]:
    """The `vlmserve caption` command itself, in a process of its own. Returns the whole
    command's seconds (start-up included) and the captioning's (from its summary line,
    which starts once the model is loaded)."""
    cmd = [sys.executable, "-m", "vlmserve.entrypoints.cli", "caption", str(folder), "--out", str(out), "--dtype", "float32", "--max-tokens",
           str(max_tokens), "--batch-size", str(batch), "--no-progress", *(["--model", model] if model else [])]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["error"] is None for r in rows), result.stderr
    rate = float(re.search(r"([0-9.]+) files/s", result.stderr).group(1))  # finer than the seconds printed
    return seconds, len(rows) / rate


def run_transformers(model: str, paths: list[str], max_tokens: int) -> tuple[float, float]:
    """Seconds for the whole script (loading included) and for the loop alone."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    start = time.perf_counter()
    processor = AutoProcessor.from_pretrained(model)
    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}],
        add_generation_prompt=True)
    loop = time.perf_counter()
    for path in paths:
        inputs = processor(text=[prompt], images=[Image.open(path).convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    end = time.perf_counter()
    return end - start, end - loop


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from vlmserve.engine.model_source import resolve_model_path

    model = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "pictures"
        folder.mkdir()
        paths = make_folder(folder, args.images, shapes_world=args.model is None)
        cli = [run_cli(args.model, folder, Path(tmp) / f"out{i}.jsonl", args.max_tokens, args.batch_size)
               for i in range(args.repeats)]
        hf = [run_transformers(model, paths, args.max_tokens) for _ in range(args.repeats)]
    (cli_all, cli_work), (hf_all, hf_work) = ([statistics.median(run[k] for run in runs) for k in (0, 1)]
                                              for runs in (cli, hf))
    n = args.images
    print(f"{n} images, model {Path(model).name}, fp32, greedy, up to {args.max_tokens} tokens, "
          f"median of {args.repeats} runs")
    print("                               whole run (loading included)   captioning alone")
    print(f"vlmserve caption (the command): {n / cli_all:7.2f} images/s ({cli_all:5.1f}s)      "
          f"{n / cli_work:7.2f} images/s ({cli_work:.1f}s)")
    print(f"transformers generate loop:     {n / hf_all:7.2f} images/s ({hf_all:5.1f}s)      "
          f"{n / hf_work:7.2f} images/s ({hf_work:.1f}s)")
    print(f"ratio:                          {hf_all / cli_all:7.2f}x                        {hf_work / cli_work:7.2f}x")


if __name__ == "__main__":
    main()
