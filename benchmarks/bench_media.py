"""Images per second through vlmserve's media layer (read, hash, decode, resize, patch),
cold and warm processor cache, one thread and a pool; and transformers' processor alone.

    python benchmarks/bench_media.py [--images 64] [--threads 4]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import peer_checkpoint, synthetic_image  # noqa: E402


def encoded_images(n: int) -> list[bytes]:
    sizes = [(640, 480), (1024, 768), (800, 800), (1280, 720)]
    out = []
    for i in range(n):
        buf = io.BytesIO()
        synthetic_image(*sizes[i % len(sizes)], seed=i).save(buf, format="JPEG" if i % 2 else "PNG", quality=90)
        out.append(buf.getvalue())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()
    from PIL import Image
    from transformers import AutoConfig

    from vlmserve.multimodal.media import MediaLoader
    from vlmserve.multimodal.processor import MultiModalProcessor

    path = peer_checkpoint("qwen2_5_vl")
    config = AutoConfig.from_pretrained(path)
    images = encoded_images(args.images)

    def run(proc, pool_size):
        t = time.perf_counter()
        with ThreadPoolExecutor(pool_size) as pool:
            list(pool.map(lambda b: proc.process(b, "image"), images))
        return args.images / (time.perf_counter() - t)

    print(f"{args.images} images, 640x480 to 1280x720, PNG and JPEG; processor of {Path(path).name}")
    for threads in (1, args.threads):
        proc = MultiModalProcessor(path, config, MediaLoader())
        cold = run(proc, threads)
        warm = run(proc, threads)
        print(f"vlmserve, {threads} thread(s): cold cache {cold:7.1f} images/s, warm cache {warm:8.1f} images/s "
              f"(hits {proc.cache.stats.hits})")
    hf = proc.image_processor
    t = time.perf_counter()
    for b in images:
        hf(images=[Image.open(io.BytesIO(b)).convert("RGB")], return_tensors="pt")
    print(f"transformers processor alone, 1 thread: {args.images / (time.perf_counter() - t):7.1f} images/s")


if __name__ == "__main__":
    main()
