"""`vlmserve caption --ray`: the same job on a Ray cluster, with Ray Data.

Two stages, as on one machine: every file is read and hashed (a map over the cluster),
the driver picks one original per mm_hash, then an actor pool — one engine per actor —
captions the originals with `map_batches`. Rows stream back to the driver, which writes
them (and the duplicates' rows) to the output as they arrive, so `--resume` works the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from vlmserve.entrypoints.caption import Row, Summary, copy_row, modality_of


def _hash_file(row: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    from pathlib import Path

    from vlmserve.multimodal.hashing import mm_hash
    from vlmserve.multimodal.media import MediaLoader

    path = row["path"]
    modality = modality_of(path) or "image"
    try:
        raw = MediaLoader().read(Path(path).read_bytes(), modality)
        return {"path": path, "mm_hash": mm_hash(modality, raw.content, settings), "error": ""}
    except Exception as e:
        return {"path": path, "mm_hash": "", "error": f"{type(e).__name__}: {e}"}


class CaptionActor:
    """One engine per actor; captions each batch of paths with continuous batching."""

    def __init__(self, engine_args, prompt: str, video_prompt: str, params, settings: dict[str, Any],
                 concurrency: int) -> None:
        from vlmserve.engine.llm_engine import LLMEngine
        from vlmserve.entrypoints.caption import Captioner

        self.captioner = Captioner(LLMEngine(engine_args), prompt, video_prompt, params, settings, concurrency)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows = list(self.captioner.run(list(batch["path"])))
        columns = {k: [] for k in asdict(Row("")).keys()}
        for row in rows:
            for k, v in asdict(row).items():
                columns[k].append(v)
        return columns


def run_on_ray(address: str, workers: int, paths: list[str], engine_args, prompt: str, video_prompt: str, params,
               settings: dict[str, Any], concurrency: int, known: dict[str, Row], summary: Summary) -> Iterator[Row]:
    """Rows as on one machine; `known`: originals captioned by an earlier run, by mm_hash."""
    import ray

    from vlmserve.multimodal.processor import normalize_settings

    settings = normalize_settings(settings)
    if not ray.is_initialized():
        if address == "local":
            ray.init(num_cpus=max(workers, 1), include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    if not paths:
        return
    hashed = ray.data.from_items([{"path": p} for p in paths]).map(_hash_file, fn_kwargs={"settings": settings})
    originals: dict[str, str] = {}
    copies: dict[str, list[str]] = {}
    todo: list[str] = []
    for row in hashed.iter_rows():
        if row["error"]:
            yield Row(row["path"], error=row["error"])
            continue
        if row["mm_hash"] in known:
            yield copy_row(known[row["mm_hash"]], row["path"])
            continue
        original = originals.setdefault(row["mm_hash"], row["path"])
        if original == row["path"]:
            todo.append(row["path"])
        else:
            copies.setdefault(original, []).append(row["path"])
    if not todo:
        return
    batch_size = max(1, min(4 * concurrency, -(-len(todo) // workers)))
    captions = ray.data.from_items([{"path": p} for p in todo]).map_batches(
        CaptionActor,
        fn_constructor_args=(engine_args, prompt, video_prompt, params, settings, concurrency),
        batch_size=batch_size,
        concurrency=workers,
        num_cpus=1,
    )
    for item in captions.iter_rows():
        fields = dict(item)
        for k in ("prompt_tokens", "output_tokens"):
            fields[k] = int(fields[k] or 0)  # numpy ints from the dataset -> plain ints for JSON
        row = Row(**fields)
        summary.captioned += row.error is None
        yield row
        for path in copies.get(row.path, []):
            yield copy_row(row, path)
