"""Feeding an engine from a batch of requests (the `LLM` class, the caption CLI): each
request's processing (media, tokens) runs in a thread pool while the engine steps, and a
request joins the batch as soon as it is processed — in the order they were submitted,
and at once when the engine would otherwise sit idle."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from vlmserve.engine.llm_engine import LLMEngine, ProcessedRequest
from vlmserve.outputs import RequestOutput


class EngineFeeder:
    def __init__(self, engine: LLMEngine, pool: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.pool = pool
        self._processing: list[tuple[str, Future]] = []  # submitted, not yet added, in order
        self._added: set[str] = set()  # added, not yet finished

    def submit(self, request_id: str, process: Callable[[], ProcessedRequest]) -> None:
        """Starts processing a request in the pool (process() returns it processed)."""
        self._processing.append((request_id, self.pool.submit(process)))

    def pending(self) -> int:
        """Requests submitted and not finished (processing, or in the engine)."""
        return len(self._processing) + len(self._added)

    def step(self) -> tuple[list[RequestOutput], list[tuple[str, Exception]]]:
        """Adds the requests whose processing is done, steps the engine once, and returns
        the requests that finished and those whose processing failed (with the error)."""
        failed = self._add_ready()
        finished = []
        if self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    self._added.discard(out.request_id)
                    finished.append(out)
        return finished, failed

    def abort_all(self) -> None:
        """Drops whatever is still processing and aborts what the engine holds."""
        for _, future in self._processing:
            future.cancel()
        self._processing.clear()
        self.engine.abort_request(list(self._added))
        self._added.clear()

    def _add_ready(self) -> list[tuple[str, Exception]]:
        failed = []
        while self._processing:
            request_id, future = self._processing[0]
            if not (future.done() or not self.engine.has_unfinished_requests()):
                break  # the engine has work: add this one next step
            self._processing.pop(0)
            try:
                self.engine.add_processed(future.result())
            except Exception as e:  # bad input (processing), or a refused request
                failed.append((request_id, e))
                continue
            self._added.add(request_id)
        return failed
