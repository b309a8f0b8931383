"""Shared benchmark setup: a ~29M-parameter Qwen2.5-VL built once and cached, and a
mixed image workload (several sizes, some pictures repeated, text-only prompts)."""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image

CACHE = Path(os.environ.get("VLMSERVE_BENCH_CACHE", Path.home() / ".cache" / "vlmserve-bench"))


def bench_checkpoint() -> str:
    """Qwen2.5-VL architecture, 29M parameters: 6 text layers of width 512, ViT depth 4."""
    from vlmserve.testing.checkpoints import build_qwen2_5_vl

    path = CACHE / "qwen2_5_vl-29m-v2"
    if not (path / "model.safetensors").exists():
        build_qwen2_5_vl(
            path, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=2, intermediate_size=2048,
            sliding_window=None, vision_hidden=256, vision_depth=6, vision_heads=4,
            max_pixels=448 * 448, min_pixels=56 * 56, vocab_size=4096, seed=0,
        )
    return str(path)


def cpu_flags() -> str:
    """What bf16 speed depends on: printed with every benchmark."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    return " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))


def synthetic_image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    base = rng.randint(0, 256, (4, 4, 3), dtype=np.uint8)  # smooth-ish, like a photo
    return Image.fromarray(base).resize((w, h), Image.BILINEAR)


QUESTIONS = [
    "Describe the image.",
    "What is in this picture?",
    "How many shapes are there?",
    "Answer the question about the picture in one sentence.",
]


def workload(n: int = 32, seed: int = 0) -> list[dict]:
    """n requests: 3/4 with one image (6 sizes, a quarter of them repeated), 1/4 text only."""
    rng = random.Random(seed)
    sizes = [(224, 224), (320, 240), (448, 336), (160, 160), (280, 420), (336, 336)]
    pictures = [synthetic_image(*sizes[i % len(sizes)], seed=i) for i in range(n // 2)]
    reqs = []
    for i in range(n):
        q = rng.choice(QUESTIONS)
        if i % 4 == 3:
            reqs.append({"text": q + " " + "Tell me a story about a fox." * rng.randint(1, 3), "images": []})
        else:
            img = pictures[rng.randrange(len(pictures) // 2)] if rng.random() < 0.25 else pictures[i % len(pictures)]
            reqs.append({"text": q, "images": [img]})
        reqs[-1]["max_tokens"] = rng.choice([32, 48, 64])
    return reqs


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times
