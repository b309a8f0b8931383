"""`vlmserve caption --ray`: the same job on a Ray cluster, with Ray Data.

Two stages, as on one machine: every file is read and hashed (a map over the cluster),
the driver picks one original per mm_hash, then an actor pool — one engine per actor —
captions the originals with `map_batches`. Each actor appends its rows (an original's,
then its copies') to an output shard of its own, synced batch by batch; the driver
writes every row it has — its own (unreadable files, copies of originals an earlier run
captioned) and each one the actors send back — to a shard of its own, so a row is lost
only if both copies are. At the end, the driver merges the shards into `--out`; a run
that is interrupted leaves them, and `--resume` merges them first. Like the inputs, the
output must be on a file system every worker sees.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vlmserve.engine.args import EngineArgs
from vlmserve.multimodal.media import modality_of
from vlmserve.entrypoints.caption_rows import CaptionJob, Row, copy_row, shard_dir, write_row

# per-batch engine counters an actor sends back with its rows (on the batch's first row)
COUNTERS = ("encoder_cache_hits", "prefix_cached_tokens")


def _hash_file(row: dict[str, Any], engine_args: EngineArgs, settings: dict[str, Any]) -> dict[str, Any]:
    from vlmserve.multimodal.hashing import mm_hash
    from vlmserve.multimodal.media import MediaLoader

    path = row["path"]
    modality = modality_of(path) or "image"
    try:
        raw = MediaLoader(engine_args.media_limits()).read(Path(path).read_bytes(), modality)
        return {"path": path, "mm_hash": mm_hash(modality, raw.content, settings), "error": ""}
    except Exception as e:
        return {"path": path, "mm_hash": "", "error": f"{type(e).__name__}: {e}"}


class CaptionActor:
    """One engine per actor; captions each batch of originals with continuous batching and
    appends the rows, the originals' and their copies', to this actor's shard."""

    def __init__(self, engine_args: EngineArgs, prompt: str, video_prompt: str, params, settings: dict[str, Any],
                 concurrency: int, shards: str, lora=None, pooling=None) -> None:
        import socket
        import uuid

        from vlmserve.engine.llm_engine import LLMEngine
        from vlmserve.entrypoints.captioner import Captioner

        self.engine = LLMEngine(engine_args)
        self.captioner = Captioner(self.engine, prompt, video_prompt, params, settings, concurrency, lora, pooling)
        # a name no restarted actor reuses: a torn last row stays at the end of its own file
        self.shard = Path(shards) / f"part-{socket.gethostname()}-{uuid.uuid4().hex[:12]}.jsonl"
        self.counted = {k: 0 for k in COUNTERS}

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        copies = {p: json.loads(c) for p, c in zip(batch["path"], batch["copies"])}
        columns: dict[str, list] = {k: [] for k in [*asdict(Row("")), *COUNTERS]}
        # opened and synced per batch: on a network file system, another host (the driver,
        # merging) sees the rows only once the file is synced or closed. The folder is made
        # here, not when the actor starts: an actor still loading its model when the last
        # batch is done would make it again after the driver's merge removed it
        self.shard.parent.mkdir(parents=True, exist_ok=True)
        with open(self.shard, "a") as shard:
            for original in self.captioner.run(list(batch["path"])):
                for row in [original, *(copy_row(original, p) for p in copies[original.path])]:
                    write_row(shard, row)
                    for k, v in asdict(row).items():
                        columns[k].append(v)
            os.fsync(shard.fileno())
        # what the engine's caches saved on this batch, for the driver's summary
        stats = self.engine.stats()
        now = {"encoder_cache_hits": stats.encoder_cache_hits, "prefix_cached_tokens": sum(stats.prefix_cache_hits)}
        for k in COUNTERS:
            columns[k] = [now[k] - self.counted[k]] + [0] * (len(columns["path"]) - 1)
        self.counted = now
        return columns


def run_on_ray(address: str, workers: int, job: CaptionJob, engine_args: EngineArgs, concurrency: int,
               out: Path) -> Generator[Row, None, None]:
    """Yields every row once it is written to a shard (for the progress bar and the summary)."""
    import ray

    from vlmserve.multimodal.processor import normalize_settings

    if not job.todo:
        return
    settings = normalize_settings(job.settings)
    _init_ray(address, workers)
    shards = shard_dir(out).resolve()  # the workers' working directories are not the driver's
    shards.mkdir(parents=True, exist_ok=True)
    with open(shards / "part-driver.jsonl", "a") as own:
        copies_of: dict[str, list[str]] = {}  # each original to caption (by path) -> its copies
        for row in _hash_and_pick_originals(job, engine_args, settings, copies_of):
            write_row(own, row)
            yield row
        if not copies_of:
            return
        batch_size = max(1, min(4 * concurrency, -(-len(copies_of) // workers)))
        # a block per batch: each batch's rows reach the driver (its progress bar, its
        # Ctrl-C) as soon as an actor is done with it, not when a larger block is
        captions = ray.data.from_items([{"path": p, "copies": json.dumps(c)} for p, c in copies_of.items()],
                                       override_num_blocks=-(-len(copies_of) // batch_size))
        captions = captions.map_batches(
            CaptionActor,
            fn_constructor_args=(engine_args, job.prompt, job.video_prompt, job.params, settings, concurrency,
                                 str(shards), job.lora, job.pooling),
            batch_size=batch_size,
            compute=ray.data.ActorPoolStrategy(size=workers),
            num_cpus=1,
        )
        counters = {k: 0 for k in COUNTERS}
        for item in captions.iter_rows():
            fields = dict(item)
            for k in COUNTERS:
                counters[k] += int(fields.pop(k))
            for k in ("prompt_tokens", "output_tokens"):
                fields[k] = int(fields[k] or 0)  # numpy ints from the dataset -> plain ints
            row = Row(**fields)
            write_row(own, row)  # the driver's copy of the actor's row
            yield row
        os.fsync(own.fileno())
    job.summary.extra["encoder cache hits"] = counters["encoder_cache_hits"]
    job.summary.extra["prefix-cached tokens"] = counters["prefix_cached_tokens"]


def _init_ray(address: str, workers: int) -> None:
    import ray

    if not ray.is_initialized():
        if address == "local":
            ray.init(num_cpus=max(workers, 1), include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False


def _hash_and_pick_originals(job: CaptionJob, engine_args: EngineArgs, settings: dict[str, Any],
                             copies_of: dict[str, list[str]]) -> Iterator[Row]:
    """Hashes every file across the cluster; yields the rows the driver writes itself
    (unreadable files, copies of originals an earlier run captioned) and fills copies_of
    with one original per mm_hash and its copies."""
    import ray

    hashed = ray.data.from_items([{"path": p} for p in job.todo]).map(
        _hash_file, fn_kwargs={"engine_args": engine_args, "settings": settings})
    by_hash: dict[str, str] = {}
    for item in hashed.iter_rows():
        if item["error"]:
            yield Row(item["path"], error=item["error"])
        elif item["mm_hash"] in job.known:
            yield copy_row(job.known[item["mm_hash"]], item["path"])
        else:
            original = by_hash.setdefault(item["mm_hash"], item["path"])
            copies = copies_of.setdefault(original, [])
            if original != item["path"]:
                copies.append(item["path"])
