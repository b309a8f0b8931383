"""Captioning a folder: `vlmserve caption` (the CLI's engine loop, continuous batching)
against a plain loop over transformers' `generate`, one image at a time, on the same
folder and checkpoint. Prints images/s for both and the ratio.

    python benchmarks/bench_caption.py [--images 64] [--model PATH] [--max-tokens 32]

Default model: the shipped one (shapes pictures are generated for it); with --model, the
pictures are generic synthetic photos.
"""

from __future__ import annotations

import argparse
import io
import random
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


def run_cli(model: str | None, paths: list[str], out: Path, max_tokens: int, batch: int) -> float:
    from vlmserve.engine.args import EngineArgs
    from vlmserve.engine.llm_engine import LLMEngine
    from vlmserve.entrypoints.caption import Captioner
    from vlmserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=model, dtype="float32"))
    captioner = Captioner(engine, "Describe the image.", "Describe the video.",
                          SamplingParams(temperature=0, max_tokens=max_tokens), {}, batch)
    start = time.perf_counter()
    rows = list(captioner.run(paths))
    seconds = time.perf_counter() - start
    assert all(r.error is None for r in rows)
    return seconds


def run_transformers(model: str, paths: list[str], max_tokens: int) -> float:
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}],
        add_generation_prompt=True)
    start = time.perf_counter()
    for path in paths:
        inputs = processor(text=[prompt], images=[Image.open(path).convert("RGB")], return_tensors="pt")
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    from vlmserve.engine.llm_engine import resolve_model_path

    model = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_folder(Path(tmp), args.images, shapes_world=args.model is None)
        t_cli = run_cli(args.model, paths, Path(tmp) / "out.jsonl", args.max_tokens, args.batch_size)
        t_hf = run_transformers(model, paths, args.max_tokens)
    print(f"{args.images} images, model {Path(model).name}, fp32, greedy, up to {args.max_tokens} tokens")
    print(f"vlmserve caption:              {args.images / t_cli:7.2f} images/s ({t_cli:.1f}s)")
    print(f"transformers generate loop:    {args.images / t_hf:7.2f} images/s ({t_hf:.1f}s)")
    print(f"ratio: {t_hf / t_cli:.2f}x")


if __name__ == "__main__":
    main()
