"""The Captioner: drives an engine's continuous batching over a list of files (captions,
or with pooling the files' vectors), duplicates (same mm_hash) done once. The `caption`
command (caption.py) runs it on this machine, or in each Ray actor (caption_ray.py);
`embed` (embed.py) runs it with pooling. Its rows and output file: caption_rows.py."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from vlmserve.engine.feeder import EngineFeeder
from vlmserve.engine.processing_pool import processing_pool
from vlmserve.entrypoints.caption_rows import TEXT_PREFIX, Row, copy_row
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.hashing import mm_hash
from vlmserve.multimodal.media import MediaLoader, modality_of
from vlmserve.multimodal.processor import normalize_settings
from vlmserve.pooling_params import PoolingParams


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
