"""`vlmserve embed`: pictures, videos (and texts) to vectors, for image search and
duplicate detection, through the engine's pooling runner; a Parquet or .npy file.

The rows go first to `<out>.rows.jsonl` as each file finishes (the caption command's
machinery: byte-identical files embedded once, broken ones error rows, --resume, Ray,
a progress bar); once every file is done they become `--out`:
- .parquet: columns path, embedding (float32 list), mm_hash, duplicate_of, error;
- .npy: a float32 [files, dimensions] matrix of the files that worked, and beside it
  `<out>.paths.txt`, their paths in the same order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from vlmserve.entrypoints.captioner import TEXT_PREFIX, Row, parse_rows
from vlmserve.errors import ConfigError
from vlmserve.pooling_params import PoolingParams

FORMATS = (".parquet", ".npy")


def add_embed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="*", help="files, folders, globs, or .txt/.jsonl lists of paths")
    p.add_argument("--out", required=True, type=Path, help="a .parquet or .npy file")
    p.add_argument("--texts", type=Path, default=None, help="a file of texts to embed too, one per line")
    p.add_argument("--prompt", default="Describe the image.",
                   help="the text each picture is embedded with (as a chat turn, before the answer)")
    p.add_argument("--video-prompt", default="Describe the video.")
    p.add_argument("--dimensions", type=int, default=None, help="keep the first this many (Matryoshka)")
    p.add_argument("--max-pixels", type=int, default=None, help="resize images to at most this many pixels")
    p.add_argument("--batch-size", type=int, default=32, help="files in flight at once")
    p.add_argument("--resume", action="store_true", help="skip files already done by an earlier run")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on a Ray cluster (Ray Data; default: a local one)")
    p.add_argument("--ray-workers", type=int, default=2, help="engines (actors) on the Ray cluster")
    p.add_argument("--lora", default=None, metavar="PATH", help="embed under this PEFT LoRA adapter")
    p.add_argument("--no-progress", action="store_true")
    # what the caption machinery reads, fixed for embedding: nothing is sampled
    p.set_defaults(temperature=0.0, top_p=1.0, max_tokens=1, ignore_eos=False, sample_seed=None, text_items=[])


def run_embed(args: argparse.Namespace) -> int:
    from vlmserve.entrypoints.caption import run_caption

    out = args.out
    if out.suffix not in FORMATS:
        raise ConfigError(f"--out {out}: a {' or '.join(FORMATS)} file")
    if not args.inputs and args.texts is None:
        raise ConfigError("nothing to embed: give files, folders or globs, or --texts")
    if args.runner == "generate":
        raise ConfigError("--runner generate: embed needs the pooling runner")
    args.runner = "pooling"  # a sentence-transformers checkpoint keeps its own pooling settings
    if args.texts is not None:
        args.text_items = [TEXT_PREFIX + line for line in args.texts.read_text().splitlines() if line.strip()]
    args.out = rows_file(out)
    code = run_caption(args, pooling=PoolingParams(dimensions=args.dimensions))
    if code != 130:  # interrupted: the rows stay, for --resume
        write_vectors(parse_rows(args.out.read_bytes()), out)
    return code


def rows_file(out: Path) -> Path:
    return out.with_name(out.name + ".rows.jsonl")


def write_vectors(rows: list[Row], out: Path) -> None:
    if out.suffix == ".npy":
        done = [r for r in rows if r.embedding is not None]
        np.save(out, np.asarray([r.embedding for r in done], dtype=np.float32).reshape(len(done), -1))
        out.with_name(out.stem + ".paths.txt").write_text("".join(r.path + "\n" for r in done))
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "path": [r.path for r in rows],
        "embedding": pa.array([r.embedding for r in rows], type=pa.list_(pa.float32())),
        "mm_hash": [r.mm_hash for r in rows],
        "duplicate_of": [r.duplicate_of for r in rows],
        "error": [r.error for r in rows],
    })
    pq.write_table(table, out)
