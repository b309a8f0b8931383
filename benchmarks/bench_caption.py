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
    command's seconds (start-up included) and the captioning's (from its summary line)."""
    cmd = ["vlmserve", "caption", str(folder), "--out", str(out), "--dtype", "float32", "--max-tokens",
           str(max_tokens), "--batch-size", str(batch), "--no-progress", *(["--model", model] if model else [])]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(r["error"] is None for r in rows), result.stderr
    return seconds, float(re.search(r" in ([0-9.]+)s:", result.stderr).group(1))


def run_transformers(model: str, paths: list[str], max_tokens: int) -> float:
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    start = time.perf_counter()  # loading included, as in the command's time
    processor = AutoProcessor.from_pretrained(model)
    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}],
        add_generation_prompt=True)
    for path in paths:
        inputs = processor(text=[prompt], images=[Image.open(path).convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from vlmserve.engine.llm_engine import resolve_model_path

    model = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "pictures"
        folder.mkdir()
        paths = make_folder(folder, args.images, shapes_world=args.model is None)
        cli = [run_cli(args.model, folder, Path(tmp) / f"out{i}.jsonl", args.max_tokens, args.batch_size)
               for i in range(args.repeats)]
        t_cli, t_captioning = statistics.median(c[0] for c in cli), statistics.median(c[1] for c in cli)
        t_hf = statistics.median(run_transformers(model, paths, args.max_tokens) for _ in range(args.repeats))
    print(f"{args.images} images, model {Path(model).name}, fp32, greedy, up to {args.max_tokens} tokens, "
          f"median of {args.repeats} runs, model loading included")
    print(f"vlmserve caption (the command):  {args.images / t_cli:7.2f} images/s ({t_cli:.1f}s; "
          f"{args.images / t_captioning:.2f} images/s once started)")
    print(f"transformers generate loop:      {args.images / t_hf:7.2f} images/s ({t_hf:.1f}s)")
    print(f"ratio: {t_hf / t_cli:.2f}x")


if __name__ == "__main__":
    main()
