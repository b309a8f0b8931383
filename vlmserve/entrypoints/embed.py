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

from vlmserve.entrypoints.caption_rows import TEXT_PREFIX, Row, parse_rows
from vlmserve.errors import ConfigError
from vlmserve.pooling_params import PoolingParams

FORMATS = (".parquet", ".npy")


def add_embed_args(p: argparse.ArgumentParser) -> None:
    from vlmserve.entrypoints.caption import add_file_run_args

    p.add_argument("inputs", nargs="*", help="files, folders, globs, or .txt/.jsonl lists of paths")
    add_file_run_args(p, "a .parquet or .npy file")
    p.add_argument("--texts", type=Path, default=None, help="a file of texts to embed too, one per line")
    p.add_argument("--dimensions", type=int, default=None, help="keep the first this many (Matryoshka)")
    # what the caption machinery reads, fixed for embedding: nothing is sampled
    p.set_defaults(temperature=0.0, top_p=1.0, max_tokens=1, ignore_eos=False, sample_seed=None)


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
