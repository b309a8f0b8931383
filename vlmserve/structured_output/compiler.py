"""Compiles the grammars of structured-output requests for the engine's tokenizer, several
at once, each under a deadline. A spec is first compiled in a worker process
(compile_worker.py): one that misses the deadline is abandoned — the process killed, its
memory freed — and its request refused; one that is invalid or matches nothing is refused
with the reason. A spec that passed is compiled again here, in a thread (xgrammar lets go
of the interpreter while it compiles), where it takes the time it just took: moving the
compiled grammar out of the worker costs more than compiling it twice (xgrammar's
serialized form is up to a hundred times its size in memory). Results are cached by
spec, so a schema that many requests share compiles once.

The front end awaits the compile before it queues a request, so a bad or unsatisfiable
grammar is a 400 before the engine sees the request, a client that leaves while its
grammar compiles is counted nowhere, and neither the event loop nor the engine's step
loop ever waits for a compile."""

from __future__ import annotations

import logging
import pickle
import queue
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vlmserve.sampling_params import ParamError, StructuredOutputsParams
from vlmserve.structured_output.grammar import build_grammar

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT = 120.0  # seconds for a new worker to import xgrammar and load the tokenizer


@dataclass
class CompiledSpec:
    """A compiled grammar as it travels with a request. Across a process boundary (an
    engine core in a process of its own) only the spec goes: the core compiles it again."""

    spec: StructuredOutputsParams
    grammar: Any = field(default=None, compare=False)  # xgr.CompiledGrammar; not pickled

    @property
    def key(self) -> tuple[str, str]:
        return self.spec.key

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": self.spec, "grammar": None}


class GrammarCompiler:
    """A pool of compile workers, started on first use, with a cache of results (and of
    errors: a spec that failed once fails the same way again)."""

    def __init__(self, tokenizer_info: Callable[[], Any], num_workers: int = 2, timeout: float = 10.0,
                 cache_entries: int = 256, cache_bytes: int = 256 << 20) -> None:
        self._make_info = tokenizer_info
        self._info = None
        self.num_workers = max(1, num_workers)
        self.timeout = timeout
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_entries = cache_entries
        self._cache_bytes = cache_bytes
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._drivers: list[threading.Thread] = []
        self._workers: set[subprocess.Popen] = set()
        self._closed = False

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A future of the spec's CompiledSpec; ParamError if the spec is invalid, matches
        nothing, or missed the deadline."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = Future()
            self._cache[spec.key] = future
            self._evict()
            if len(self._drivers) < self.num_workers:
                driver = threading.Thread(target=self._drive, name=f"vlmserve-grammar-{len(self._drivers)}", daemon=True)
                self._drivers.append(driver)
                driver.start()
        self._jobs.put((spec, future))
        return future

    def tokenizer_info(self):
        with self._lock:
            if self._info is None:
                self._info = self._make_info()
            return self._info

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        for _ in self._drivers:
            self._jobs.put(None)
        for proc in workers:
            proc.kill()

    def _evict(self) -> None:
        """Oldest entries first, never one still compiling."""
        def size(f: Future) -> int:
            return f.result().grammar.memory_size_bytes if f.done() and f.exception() is None else 0

        total = sum(size(f) for f in self._cache.values())
        for key in list(self._cache):
            if len(self._cache) <= self._cache_entries and total <= self._cache_bytes:
                break
            future = self._cache[key]
            if future.done():
                total -= size(future)
                del self._cache[key]

    # -- one driver thread per worker process -------------------------------------------------------
    def _drive(self) -> None:
        import xgrammar as xgr

        proc: subprocess.Popen | None = None
        compiler = None
        while True:
            job = self._jobs.get()
            if job is None:
                break
            spec, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if proc is None or proc.poll() is not None:
                    proc = self._start_worker()
                result = self._vet(proc, spec)
                if result is None:
                    compiler = compiler or xgr.GrammarCompiler(self.tokenizer_info(), max_threads=1,
                                                               cache_enabled=False)
                    result = CompiledSpec(spec, compiler.compile_grammar(build_grammar(spec)))
            except _WorkerLost as e:
                self._stop_worker(proc)
                proc = None
                future.set_exception(e.error)
                continue
            except BaseException as e:  # a fault here must not leave the request waiting forever
                logger.exception("grammar compile failed")
                self._stop_worker(proc)
                proc = None
                future.set_exception(RuntimeError(f"the grammar compiler failed: {e!r}"))
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        self._stop_worker(proc)

    def _start_worker(self) -> subprocess.Popen:
        info = self.tokenizer_info()
        proc = subprocess.Popen([sys.executable, "-m", "vlmserve.structured_output.compile_worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        with self._lock:
            self._workers.add(proc)
            closed = self._closed
        if closed:
            proc.kill()
            raise _WorkerLost(RuntimeError("the grammar compiler is shut down"))
        try:
            pickle.dump(info.serialize_json(), proc.stdin)
            proc.stdin.flush()
        except OSError as e:
            raise _WorkerLost(RuntimeError(f"a grammar compile worker did not start: {e}")) from None
        if self._read(proc, WORKER_START_TIMEOUT) != ("ready",):
            raise _WorkerLost(RuntimeError("a grammar compile worker did not start"))
        return proc

    def _vet(self, proc: subprocess.Popen, spec: StructuredOutputsParams) -> ParamError | None:
        """The worker's verdict on a spec: None if it compiled in time, else why not."""
        try:
            pickle.dump(spec, proc.stdin)
            proc.stdin.flush()
        except OSError as e:
            raise _WorkerLost(RuntimeError(f"the grammar compile worker exited: {e}")) from None
        answer = self._read(proc, self.timeout)
        if answer is None:
            logger.warning("a %s missed the compile deadline of %.1f s: abandoned", spec.name, self.timeout)
            raise _WorkerLost(ParamError(
                "structured_outputs", f"the {spec.name} did not compile within {self.timeout:g} s "
                f"(--grammar-compile-timeout): simplify it (fewer optional properties, less nesting)"))
        status, payload = answer
        if status != "ok":
            return ParamError("structured_outputs", payload)
        logger.debug("a %s grammar compiled in %.3f s", spec.key[0], payload)
        return None

    @staticmethod
    def _read(proc: subprocess.Popen, timeout: float) -> Any:
        """The worker's next answer; None if none came within the timeout."""
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            return None
        try:
            return pickle.load(proc.stdout)
        except (EOFError, pickle.UnpicklingError, OSError):
            raise _WorkerLost(RuntimeError(f"the grammar compile worker exited (code {proc.poll()})")) from None

    def _stop_worker(self, proc: subprocess.Popen | None) -> None:
        if proc is None:
            return
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        with self._lock:
            self._workers.discard(proc)


class _WorkerLost(Exception):
    """The worker was killed or died; `error` is what the request gets."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error
