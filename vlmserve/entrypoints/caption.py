"""`vlmserve caption`: one caption per image (or video) into a JSONL file, through the
engine's continuous batching — resumable, deduplicated, and on Ray when asked.

Rows are written (and flushed) as they finish, so an interrupted run loses nothing that
was done; `--resume` skips the paths already in the output. Byte-identical files (same
mm_hash) are captioned once, across resumed runs too; each copy gets its original's
caption and `duplicate_of`.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from vlmserve.engine.feeder import EngineFeeder
from vlmserve.multimodal.hashing import mm_hash
from vlmserve.multimodal.media import MediaLoader, modality_of
from vlmserve.multimodal.processor import normalize_settings


# Test hook: a process that has written this many rows holds there until it is
# interrupted (or killed), so a test interrupts a run at a known row whatever the
# machine's speed. Read once per process; Ray workers get it from the driver.
HOLD_AFTER_ROWS_ENV = "VLMSERVE_TEST_HOLD_AFTER_ROWS"
_hold_after_rows = int(os.environ.get(HOLD_AFTER_ROWS_ENV) or 0)
_rows_written = 0
_interrupted = threading.Event()  # set by the local run's Ctrl-C handler


@dataclass
class Row:
    path: str
    caption: str | None = None
    mm_hash: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    duplicate_of: str | None = None


@dataclass
class Summary:
    total: int = 0
    done: int = 0
    captioned: int = 0  # files the engine captioned (each original once; copies and failures not)
    skipped: int = 0  # already in the output (--resume)
    duplicates: int = 0
    failed: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        rate = self.done / self.seconds if self.seconds else 0.0
        extras = "".join(f", {k} {v}" for k, v in self.extra.items())
        return (f"done {self.done} (of which duplicates {self.duplicates}, captioned {self.captioned}), "
                f"skipped {self.skipped}, failed "
                f"{self.failed}, in {self.seconds:.1f}s: {rate:.2f} files/s{extras}")


# -- inputs ---------------------------------------------------------------------------------
def expand_inputs(inputs: list[str]) -> list[str]:
    """Files, folders (recursive), globs, and .txt / .jsonl lists of paths, in order, once each."""
    out: list[str] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            out += sorted(str(f) for f in p.rglob("*") if f.is_file() and modality_of(str(f)))
        elif p.suffix.lower() in (".txt", ".jsonl") and p.is_file():
            for line in p.read_text().splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                out.append(json.loads(line)["path"] if p.suffix.lower() == ".jsonl" else line)
        elif any(ch in item for ch in "*?["):
            out += sorted(f for f in glob.glob(item, recursive=True) if os.path.isfile(f))
        else:
            out.append(item)  # a missing file becomes an error row, not a crash
    seen: set[str] = set()
    return [p for p in out if not (p in seen or seen.add(p))]


def complete_lines(path: Path) -> bytes:
    """A JSONL file's whole lines. A torn last line (a crash mid-write) is cut off the
    file, so the rows appended next start on a line of their own."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return data[:end]


def parse_rows(data: bytes) -> list[Row]:
    rows = []
    for line in data.decode(errors="replace").splitlines():
        try:
            rows.append(Row(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return rows


def shard_dir(out: Path) -> Path:
    """Where the Ray path's workers write their output shards until they are merged."""
    return out.with_name(out.name + ".shards")


def merge_shards(out: Path) -> None:
    """Appends the rows of the output shards to `out`, then deletes them. A row whose path
    `out` already has is skipped, so a merge cut short by a crash can simply run again."""
    shards = shard_dir(out)
    if not shards.is_dir():
        return
    have = {r.path for r in parse_rows(complete_lines(out))} if out.exists() else set()
    with open(out, "a") as f:
        for part in sorted(shards.glob("*.jsonl")):
            for row in parse_rows(complete_lines(part)):
                if row.path not in have:
                    have.add(row.path)
                    write_row(f, row)
        os.fsync(f.fileno())
    # a file a worker still holds open on NFS may linger as .nfsXXXX: a later merge of it
    # skips every row (their paths are in `out` now), so it is harmless
    shutil.rmtree(shards, ignore_errors=True)


def previous_rows(out: Path) -> list[Row]:
    """The rows of an earlier run's output (its shards merged first)."""
    merge_shards(out)
    return parse_rows(complete_lines(out)) if out.exists() else []


def captioned_originals(rows: list[Row]) -> dict[str, Row]:
    """mm_hash -> the row that captioned it, for copies met in a resumed run."""
    return {r.mm_hash: r for r in rows if r.mm_hash and r.error is None and r.duplicate_of is None}


# -- the job on one machine -----------------------------------------------------------------------
class Captioner:
    """Drives an LLMEngine over a list of files with a bounded number in flight."""

    def __init__(self, engine, prompt: str, video_prompt: str, params, settings: dict[str, Any],
                 concurrency: int) -> None:
        self.engine = engine
        self.params = params
        self.settings = normalize_settings(settings)
        self.concurrency = concurrency
        self.prompts = {
            m: engine.render_chat([{"role": "user", "content": [{"type": m, m: "placeholder"}, q]}]).prompt
            for m, q in (("image", prompt), ("video", video_prompt))
        }
        self.loader = MediaLoader(engine.args.media_limits())  # the engine's checks, on files the user named
        self.pool = ThreadPoolExecutor(engine.args.processing_threads, thread_name_prefix="vlmserve-caption")
        self._feeder: EngineFeeder | None = None

    def _prepare(self, path: str):
        """Reads a file and hashes it (duplicates stop here: they are not decoded)."""
        modality = modality_of(path) or "image"
        # the files are the ones the user named: read them directly, then apply the size checks
        raw = self.loader.read(Path(path).read_bytes(), modality)
        return modality, raw, mm_hash(modality, raw.content, self.settings)

    def _process(self, rid: str, modality: str, raw) -> Any:
        from vlmserve.engine.input_processor import PromptInput

        prompt = PromptInput(prompt=self.prompts[modality], media={modality: [raw.content]},
                             media_settings={modality: [dict(self.settings)]})
        return self.engine.process_request(rid, prompt, self.params)

    def run(self, paths: list[str], known: dict[str, Row] | None = None) -> Iterator[Row]:
        """Yields a row per path, as they finish (duplicates right after their original).
        `known`: originals captioned by an earlier run, by mm_hash."""
        reads: dict[str, Future] = {p: self.pool.submit(self._prepare, p) for p in paths[: 4 * self.concurrency]}
        queue = list(paths)
        known = known or {}
        by_hash: dict[str, str] = {k: r.path for k, r in known.items()}  # mm_hash -> the path captioned for it
        finished: dict[str, Row] = {r.path: r for r in known.values()}  # by original path
        waiting_copies: dict[str, list[str]] = {}  # original path -> copies
        in_flight: dict[str, tuple[str, str]] = {}  # request id -> (path, mm_hash)
        feeder = EngineFeeder(self.engine, self.pool)
        self._feeder = feeder
        ids = 0
        while queue or in_flight:
            # admit new files while there is room
            while queue and len(in_flight) < self.concurrency:
                path = queue.pop(0)
                for ahead in queue[: 4 * self.concurrency]:
                    if ahead not in reads:
                        reads[ahead] = self.pool.submit(self._prepare, ahead)
                future = reads.pop(path, None) or self.pool.submit(self._prepare, path)
                try:
                    modality, raw, key = future.result()
                except Exception as e:
                    yield Row(path, error=f"{type(e).__name__}: {e}")
                    continue
                original = by_hash.get(key)
                if original is not None:
                    if original in finished:
                        yield copy_row(finished[original], path)
                    else:
                        waiting_copies.setdefault(original, []).append(path)
                    continue
                by_hash[key] = path
                rid = f"caption-{ids}"
                ids += 1
                feeder.submit(rid, functools.partial(self._process, rid, modality, raw))
                in_flight[rid] = (path, key)
            outputs, failed = feeder.step()
            for rid, e in failed:
                path, key = in_flight.pop(rid)
                yield from self._finish(Row(path, mm_hash=key, error=f"{type(e).__name__}: {e}"), finished,
                                        waiting_copies)
            for out in outputs:
                path, key = in_flight.pop(out.request_id)
                c = out.outputs[0]
                row = Row(path, caption=c.text, mm_hash=key, prompt_tokens=out.num_prompt_tokens,
                          output_tokens=len(c.token_ids), finish_reason=c.finish_reason, error=out.error)
                yield from self._finish(row, finished, waiting_copies)

    @staticmethod
    def _finish(row: Row, finished: dict[str, Row], waiting_copies: dict[str, list[str]]) -> Iterator[Row]:
        finished[row.path] = row
        yield row
        for copy in waiting_copies.pop(row.path, []):
            yield copy_row(row, copy)

    def abort_all(self) -> None:
        """Aborts whatever the last run still has in flight (after Ctrl-C)."""
        if self._feeder is not None:
            self._feeder.abort_all()


def copy_row(original: Row, path: str) -> Row:
    return Row(path, original.caption, original.mm_hash, original.prompt_tokens, original.output_tokens,
               original.finish_reason, original.error, duplicate_of=original.path)


# -- command line ----------------------------------------------------------------------------------
def add_caption_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", help="files, folders, globs, or .txt/.jsonl lists of paths")
    p.add_argument("--out", required=True, type=Path, help="JSONL output, one row per input")
    p.add_argument("--prompt", default="Describe the image.")
    p.add_argument("--video-prompt", default=None, help="prompt for videos (default: --prompt)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens (benchmarks)")
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--max-pixels", type=int, default=None, help="resize images to at most this many pixels")
    p.add_argument("--batch-size", type=int, default=32, help="files in flight at once")
    p.add_argument("--resume", action="store_true", help="skip paths already in --out")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on a Ray cluster (a local one when no address is given)")
    p.add_argument("--ray-workers", type=int, default=2, help="engines (actors) on the Ray cluster")
    p.add_argument("--no-progress", action="store_true")


@dataclass
class CaptionJob:
    """What a run has to do, after --resume took out what an earlier run did."""

    todo: list[str]
    known: dict[str, Row]  # originals captioned by an earlier run, by mm_hash
    params: Any  # SamplingParams
    settings: dict[str, Any]  # media processing settings
    prompt: str
    video_prompt: str
    summary: Summary


def run_caption(args: argparse.Namespace) -> int:
    from vlmserve.entrypoints.cli import engine_args_from

    job = _prepare(args)
    run = _caption_on_ray if args.ray else _caption_here
    start, interrupted = run(args, job, engine_args_from(args))
    job.summary.seconds = time.time() - start
    if interrupted:
        print(f"interrupted: {job.summary.line()}; rerun with --resume to continue", file=sys.stderr)
        return 130
    print(job.summary.line(), file=sys.stderr)
    return 1 if job.summary.failed else 0


def _prepare(args: argparse.Namespace) -> CaptionJob:
    from vlmserve.sampling_params import SamplingParams

    paths = expand_inputs(args.inputs)
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.touch()  # there is an output, if an empty one, even when nothing is left to do
    return CaptionJob(todo, captioned_originals(previous), params,
                      {"max_pixels": args.max_pixels} if args.max_pixels else {}, args.prompt,
                      args.video_prompt or args.prompt, summary)


def _caption_on_ray(args: argparse.Namespace, job: CaptionJob, engine_args) -> tuple[float, bool]:
    """Returns when the work started (Ray's start-up and the workers' model loading
    included) and whether Ctrl-C cut it short."""
    import ray

    from vlmserve.entrypoints.caption_ray import run_on_ray

    start = time.time()
    rows = run_on_ray(args.ray, args.ray_workers, job, engine_args, args.batch_size, args.out)
    job.summary.extra["workers"] = args.ray_workers
    try:
        track(rows, job.summary, len(job.todo), not args.no_progress)  # the workers write the rows
        merge_shards(args.out)
    except KeyboardInterrupt:  # the shards stay, for --resume
        ray.shutdown()  # the job's actors stop too: none writes to a shard after this
        return start, True
    return start, False


def _caption_here(args: argparse.Namespace, job: CaptionJob, engine_args) -> tuple[float, bool]:
    """Returns when the captioning started (the model loaded) and whether Ctrl-C cut it short."""
    from vlmserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_args)
    captioner = Captioner(engine, job.prompt, job.video_prompt, job.params, job.settings, args.batch_size)
    start = time.time()
    stop = {"now": False}

    def on_interrupt(*_):
        stop["now"] = True
        _interrupted.set()

    previous_handler = signal.signal(signal.SIGINT, on_interrupt)
    try:
        with open(args.out, "a") as out:
            track(_until(captioner.run(job.todo, job.known), stop), job.summary, len(job.todo), not args.no_progress,
                  out)
    finally:
        signal.signal(signal.SIGINT, previous_handler)
    if stop["now"]:
        captioner.abort_all()
    stats = engine.stats()
    job.summary.extra["encoder cache hits"] = stats.encoder_cache_hits
    job.summary.extra["prefix-cached tokens"] = sum(stats.prefix_cache_hits)
    return start, stop["now"]


def _until(rows: Iterator[Row], interrupted: dict) -> Iterator[Row]:
    for row in rows:
        yield row
        if interrupted["now"]:
            return


def write_row(f: TextIO, row: Row) -> None:
    global _rows_written
    f.write(json.dumps(asdict(row)) + "\n")
    f.flush()  # a crash or Ctrl-C loses nothing that was written
    _rows_written += 1
    if _rows_written == _hold_after_rows:
        while not _interrupted.wait(0.05):  # Ctrl-C raises KeyboardInterrupt here, or sets the event
            pass


def track(rows: Iterator[Row], summary: Summary, total: int, progress: bool, out: TextIO | None = None) -> None:
    """Counts the rows into the summary and the progress bar (files, files/s, ETA), and
    writes them to `out` when given."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="file", disable=not progress, dynamic_ncols=True)
    for row in rows:
        if out is not None:
            write_row(out, row)
        summary.done += row.error is None
        summary.captioned += row.error is None and row.duplicate_of is None  # an original, this run
        summary.failed += row.error is not None
        summary.duplicates += row.duplicate_of is not None
        bar.update(1)
        bar.set_postfix(failed=summary.failed, refresh=False)
    bar.close()
