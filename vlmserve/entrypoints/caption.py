"""`vlmserve caption`: one caption per image (or video) into a JSONL file, through the
engine's continuous batching — resumable, deduplicated, and on Ray when asked.

Rows are written (and flushed) as they finish, so an interrupted run loses nothing that
was done; `--resume` skips the paths already in the output. Byte-identical files (same
mm_hash) are captioned once, across resumed runs too; each copy gets its original's
caption and `duplicate_of`.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from vlmserve.entrypoints.caption_rows import (CaptionJob, Row, Summary, captioned_originals, expand_inputs,
                                              merge_shards, previous_rows, shard_dir, write_row)
from vlmserve.errors import ConfigError
from vlmserve.lora.request import LoRARequest
from vlmserve.pooling_params import PoolingParams

# called with each row once it is written (and the number written so far): a progress
# hook for a program that runs the command in-process
RowHook = Callable[[Row, int], None]


# -- command line ----------------------------------------------------------------------------------
def add_file_run_args(p: argparse.ArgumentParser, out_help: str) -> None:
    """What `caption` and `embed` share: the files, the output, the question asked with
    each, batching, resuming, Ray, an adapter, the progress bar."""
    p.add_argument("--out", required=True, type=Path, help=out_help)
    p.add_argument("--prompt", default="Describe the image.", help="the question asked about each picture")
    p.add_argument("--video-prompt", default="Describe the video.", help="the question asked about each video")
    p.add_argument("--max-pixels", type=int, default=None, help="resize images to at most this many pixels")
    p.add_argument("--batch-size", type=int, default=32, help="files in flight at once")
    p.add_argument("--resume", action="store_true", help="skip paths already in --out")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on a Ray cluster (a local one when no address is given)")
    p.add_argument("--ray-workers", type=int, default=2, help="engines (actors) on the Ray cluster")
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="run under this PEFT LoRA adapter (turns on --enable-lora, and raises --max-lora-rank "
                        "to the adapter's rank)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(text_items=[])  # `embed --texts`: texts to do after the files


def add_caption_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="files, folders, globs, or .txt/.jsonl lists of paths")
    add_file_run_args(p, "JSONL output, one row per input")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens (benchmarks)")
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")


def run_caption(args: argparse.Namespace, on_row: RowHook | None = None, pooling: PoolingParams | None = None) -> int:
    """Captions the files (with `pooling`, embeds them: `vlmserve embed`) into args.out."""
    from vlmserve.engine.args import EngineArgs
    from vlmserve.lora.adapter import LoRAError  # imports torch: not at the module's import (`vlmserve --help`)

    # (the settings and --model were checked by the command, before the output is touched)
    job = _prepare(args)  # (--lora turns on the engine's LoRA flags)
    job.pooling = pooling
    job.summary.verb = "embedded" if pooling else "captioned"
    run = _caption_on_ray if args.ray else _caption_here
    try:
        start, interrupted = run(args, job, EngineArgs.from_namespace(args), on_row)
    except LoRAError as e:
        raise ConfigError(f"--lora: {e}") from None
    job.summary.seconds = time.time() - start
    if interrupted:
        print(f"interrupted: {job.summary.line()}; rerun with --resume to continue", file=sys.stderr)
        return 130
    print(job.summary.line(), file=sys.stderr)
    return 1 if job.summary.failed else 0


def _prepare(args: argparse.Namespace) -> CaptionJob:
    from vlmserve.lora.adapter import configured_rank
    from vlmserve.sampling_params import SamplingParams

    paths = expand_inputs(args.inputs) + args.text_items
    summary = Summary(total=len(paths))
    if not args.resume:  # a fresh run starts a fresh file
        args.out.unlink(missing_ok=True)
        shutil.rmtree(shard_dir(args.out), ignore_errors=True)
    previous = previous_rows(args.out)
    already = {r.path for r in previous}
    todo = [p for p in paths if p not in already]
    summary.skipped = len(paths) - len(todo)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.sample_seed, ignore_eos=args.ignore_eos)
    lora = None
    if args.lora:  # one adapter for every file: the engine is sized for it
        args.enable_lora = True
        args.max_lora_rank = max(args.max_lora_rank, configured_rank(args.lora) or 0)
        lora = LoRARequest(Path(args.lora).name, 1, str(Path(args.lora).resolve()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.touch()  # there is an output, if an empty one, even when nothing is left to do
    return CaptionJob(todo, captioned_originals(previous), params,
                      {"max_pixels": args.max_pixels} if args.max_pixels else {}, args.prompt,
                      args.video_prompt, summary, lora)


def _caption_on_ray(args: argparse.Namespace, job: CaptionJob, engine_args, on_row: RowHook | None
                    ) -> tuple[float, bool]:
    """Returns when the work started (Ray's start-up and the workers' model loading
    included) and whether Ctrl-C cut it short."""
    import ray

    from vlmserve.entrypoints.caption_ray import run_on_ray

    start = time.time()
    rows = run_on_ray(args.ray, args.ray_workers, job, engine_args, args.batch_size, args.out)
    job.summary.extra["workers"] = args.ray_workers
    try:
        track(rows, job.summary, len(job.todo), not args.no_progress, on_row=on_row)  # the workers write the rows
        merge_shards(args.out)
    except KeyboardInterrupt:  # the shards stay, for --resume
        # Ray Data's iterators clean up while Ray is still up (left to the garbage
        # collector after the shutdown, their clean-up started a second local Ray)
        rows.close()
        ray.shutdown()  # the job's actors stop too: none writes to a shard after this
        return start, True
    return start, False


def _caption_here(args: argparse.Namespace, job: CaptionJob, engine_args, on_row: RowHook | None
                  ) -> tuple[float, bool]:
    """Returns when the captioning started (the model loaded) and whether Ctrl-C cut it short."""
    # the engine's imports (torch, transformers: seconds) only where an engine runs
    from vlmserve.engine.llm_engine import LLMEngine
    from vlmserve.entrypoints.captioner import Captioner

    engine = LLMEngine(engine_args)
    captioner = Captioner(engine, job.prompt, job.video_prompt, job.params, job.settings, args.batch_size, job.lora,
                          job.pooling)
    start = time.time()
    stop = {"now": False}

    def on_interrupt(*_):
        stop["now"] = True

    previous_handler = signal.signal(signal.SIGINT, on_interrupt)
    try:
        with open(args.out, "a") as out:
            track(_until(captioner.run(job.todo, job.known), stop), job.summary, len(job.todo), not args.no_progress,
                  out, on_row)
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    if stop["now"]:
        captioner.abort_all()
    stats = engine.stats()
    # stopped before the interpreter exits: a forward still running on the engine's device
    # thread while C++'s statics are torn down aborts the process
    engine.shutdown()
    job.summary.extra["encoder cache hits"] = stats.encoder_cache_hits
    job.summary.extra["prefix-cached tokens"] = sum(stats.prefix_cache_hits)
    return start, stop["now"]


def _until(rows: Iterator[Row], interrupted: dict) -> Iterator[Row]:
    for row in rows:
        yield row
        if interrupted["now"]:
            return


def track(rows: Iterator[Row], summary: Summary, total: int, progress: bool, out: TextIO | None = None,
          on_row: RowHook | None = None) -> None:
    """Counts the rows into the summary and the progress bar (files, files/s, ETA), writes
    them to `out` when given, and calls `on_row` with each."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="file", disable=not progress, dynamic_ncols=True)
    for n, row in enumerate(rows, 1):
        if out is not None:
            write_row(out, row)
        summary.done += row.error is None
        summary.captioned += row.error is None and row.duplicate_of is None  # an original, this run
        summary.failed += row.error is not None
        summary.duplicates += row.duplicate_of is not None
        bar.update(1)
        bar.set_postfix(failed=summary.failed, refresh=False)
        if on_row is not None:
            on_row(row, n)
    bar.close()
