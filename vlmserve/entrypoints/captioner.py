"""Captioning (or embedding) files through the engine's continuous batching: rows (one
per file), the output file and its shards, and the Captioner that drives an engine over
a list of files with duplicates (same mm_hash) done once. The `caption` command
(caption.py) runs it on this machine, or on Ray (caption_ray.py); `embed` (embed.py)
runs it with pooling, each row a vector instead of a caption."""

from __future__ import annotations

import functools
import glob
import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from vlmserve.engine.feeder import EngineFeeder
from vlmserve.engine.processing_pool import processing_pool
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.hashing import mm_hash
from vlmserve.multimodal.media import MediaLoader, modality_of
from vlmserve.multimodal.processor import normalize_settings
from vlmserve.pooling_params import PoolingParams


TEXT_PREFIX = "text:"  # a row of a text (`embed --texts`), not of a file


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
    embedding: list[float] | None = None  # `embed`'s rows: the file's vector


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
    verb: str = "captioned"  # what the engine did to each original

    def line(self) -> str:
        rate = self.done / self.seconds if self.seconds else 0.0
        extras = "".join(f", {k} {v}" for k, v in self.extra.items())
        return (f"done {self.done} (of which duplicates {self.duplicates}, {self.verb} {self.captioned}), "
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
                 concurrency: int, lora: LoRARequest | None = None, pooling: PoolingParams | None = None) -> None:
        """With `pooling`, each file is embedded (the engine pools) instead of captioned."""
        self.engine = engine
        self.params = params
        self.lora = lora
        self.pooling = pooling
        if lora is not None:
            engine.check_lora(lora)  # LoRAError before any file is read
        self.settings = normalize_settings(settings)
        self.concurrency = concurrency
        self.prompts = {
            m: engine.render_chat([{"role": "user", "content": [{"type": m, m: "placeholder"}, q]}]).prompt
            for m, q in (("image", prompt), ("video", video_prompt))
        }
        self.loader = MediaLoader(engine.args.media_limits())  # the engine's checks, on files the user named
        self.pool = processing_pool(engine.args.processing_threads, "vlmserve-caption")
        self._feeder: EngineFeeder | None = None

    def _prepare(self, path: str):
        """Reads a file and hashes it (duplicates stop here: they are not decoded); a text
        to embed (`text:...`, from `embed --texts`) is its own content."""
        if path.startswith(TEXT_PREFIX):
            return "text", path.removeprefix(TEXT_PREFIX), mm_hash("text", path.encode(), {})
        modality = modality_of(path) or "image"
        # the files are the ones the user named: read them directly, then apply the size checks
        raw = self.loader.read(Path(path).read_bytes(), modality)
        return modality, raw, mm_hash(modality, raw.content, self.settings)

    def _process(self, rid: str, modality: str, raw) -> Any:
        from vlmserve.engine.input_processor import PromptInput

        if modality == "text":
            prompt = self.engine.render_chat([{"role": "user", "content": raw}])
        else:
            prompt = PromptInput(prompt=self.prompts[modality], media={modality: [raw.content]},
                                 media_settings={modality: [dict(self.settings)]})
        return self.engine.process_request(rid, prompt, self.params, lora_request=self.lora,
                                           pooling_params=self.pooling)

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
                row = Row(path, caption=None if self.pooling else c.text, mm_hash=key,
                          prompt_tokens=out.num_prompt_tokens, output_tokens=len(c.token_ids),
                          finish_reason=c.finish_reason, error=out.error, embedding=out.embedding)
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
               original.finish_reason, original.error, duplicate_of=original.path, embedding=original.embedding)


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
    lora: LoRARequest | None = None  # the adapter every file is captioned under
    pooling: PoolingParams | None = None  # embed: each file's vector instead of a caption


def write_row(f: TextIO, row: Row) -> None:
    fields = asdict(row)
    if row.embedding is None:  # a caption's row, or a failure: no vector to write
        del fields["embedding"]
    f.write(json.dumps(fields) + "\n")
    f.flush()  # a crash or Ctrl-C loses nothing that was written
