"""The caption and embed commands' rows (one per file) and their output: the JSONL file,
the Ray path's shards, resuming from an earlier run's rows, and what a run has to do.
Light on purpose: Ray's workers import it to hash files, without the engine."""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from vlmserve.multimodal.media import modality_of

if TYPE_CHECKING:
    from vlmserve.lora.request import LoRARequest
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

