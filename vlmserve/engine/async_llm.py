"""The engine for servers: it steps in a background thread while asyncio code awaits
results, so an HTTP server stays responsive however busy the model is.

Media processing runs in a thread pool (never on the event loop, never on the step
loop); the engine thread builds and owns the engine and takes new requests and aborts
between steps from a queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from vlmserve.allocator import IdleMemoryReturn
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.input_processor import PromptInput
from vlmserve.engine.llm_engine import EMBEDDING_SAMPLING, LLMEngine, ProcessedRequest
from vlmserve.engine.model_source import served_name
from vlmserve.engine.processing_pool import processing_pool
from vlmserve.lora.request import LoRARequest
from vlmserve.metrics import EngineMetrics
from vlmserve.outputs import RequestOutput
from vlmserve.pooling_params import PoolingParams
from vlmserve.reasoning.parsers import ReasoningParser
from vlmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class QueueFullError(RuntimeError):
    pass


# a prompt with more characters than this is processed in a pool of its own, so that
# tokenizing it never holds the threads the other requests' media need
LARGE_PROMPT_CHARS = 100_000


class AsyncLLM:
    """An engine stepping in a thread of its own behind asyncio code: the EngineClient
    (engine/protocol.py) of a server with the engine in its process."""

    def __init__(self, args: EngineArgs, max_pending_requests: int = 512, served_model_name: str | None = None,
                 metrics_names: str = "vllm") -> None:
        """served_model_name: the name its metrics carry (default: the model's folder or hub
        id); metrics_names: vLLM's series names ("vllm") or vlmserve's older ones."""
        self.max_pending_requests = max_pending_requests
        self.pool = processing_pool(args.processing_threads, "vlmserve-media")
        # prompts without media never queue behind pictures waiting for decode memory
        self.text_pool = processing_pool(2, "vlmserve-text")
        self.large_pool = processing_pool(1, "vlmserve-large-prompt")
        self._commands: queue.Queue = queue.Queue()
        # written to with every command: wakes the engine thread while it waits for the
        # outputs of an engine core in a process of its own
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        # request id -> (its event loop, its output queue, completions it asked for)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.step_listeners: list[Callable[[list[RequestOutput]], None]] = []
        self.death_listeners: list[Callable[[BaseException], None]] = []  # e.g. the server exits
        # The engine is built by the thread that steps it: loading the weights here would
        # give this thread a team of OpenMP threads beside the engine thread's, and with
        # more OpenMP threads than cores every kernel call of every step waits for a
        # wake-up (engine/processing_pool.py).
        built: Future[LLMEngine] = Future()
        self._stepping = threading.Event()  # set once the fields below exist
        self._thread = threading.Thread(target=self._run, args=(args, built), name="vlmserve-engine", daemon=True)
        self._thread.start()
        try:
            self._engine = built.result()  # raises what building it raised
        except BaseException:
            self._wake_r.close()
            self._wake_w.close()
            raise
        try:
            self.stats = self._engine.stats()  # refreshed by the engine thread, read by /metrics
            name = served_model_name or served_name(args.model, self._engine.model_path)
            self.metrics = EngineMetrics(lambda: self.stats, name, self._engine.max_model_len, metrics_names)
            self.step_listeners.append(self.metrics.on_step)
        except BaseException:
            self._stop.set()
            self._stepping.set()
            self.shutdown()
            raise
        self._stepping.set()

    # -- what the entry points need of the model (engine/protocol.py) -------------------------
    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def model_path(self) -> str:
        return self._engine.model_path

    @property
    def task(self) -> str:
        return self._engine.task

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return self._engine.sampling_defaults

    @property
    def reasoning(self) -> ReasoningParser | None:
        return self._engine.reasoning

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False) -> PromptInput:
        return self._engine.render_chat(messages, add_generation_prompt, chat_template_kwargs, tools,
                                        continue_final_message)

    def check_lora(self, lora: LoRARequest) -> None:
        """LoRAError (a ValueError) if this engine cannot serve the adapter."""
        self._engine.check_lora(lora)

    async def prompt_token_ids(self, prompt: PromptInput) -> list[int]:
        """The tokens a prompt becomes (its media processed), in the media pool."""
        loop = asyncio.get_running_loop()
        processed = await loop.run_in_executor(self._pool_for(prompt), self._engine.process_inputs,
                                               f"tokenize-{uuid.uuid4().hex}",
                                               prompt, SamplingParams(max_tokens=1))
        return processed.request.prompt_token_ids

    # -- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | dict | Any,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as they improve; the last one is finished (an
        embedding request, with pooling_params: one output, its `embedding` set).

        Processing errors (bad media, a prompt too long) raise ValueError before anything
        is yielded. Cancelling the iteration (a client that hangs up) aborts the request.
        """
        self._check_alive()
        # a request that can never run is refused before it is counted (cheap checks only:
        # the grammar compiles in worker processes, media are processed in the pool)
        if pooling_params is not None:
            params = EMBEDDING_SAMPLING
        params = self._engine.check_params(params)
        loop = asyncio.get_running_loop()
        out_queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            pending = sum(n for _, _, n in self._streams.values())
            if pending + params.n > self.max_pending_requests:
                raise QueueFullError(f"the server has {pending} completions in flight (a request asking for n "
                                     f"counts n); try again later")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, out_queue, params.n)
        finished = False
        try:
            grammar = self._engine.compile_grammar(params)
            pool = self._pool_for(prompt)
            processed: ProcessedRequest = await loop.run_in_executor(
                pool, self._engine.process_inputs, request_id, prompt, params, priority, cache_salt, time.time(),
                lora_request, pooling_params)
            if grammar is not None:
                # shielded: the compile is shared with every request of the same spec, and
                # this one leaving must not cancel it
                processed.grammar = await asyncio.shield(asyncio.wrap_future(grammar))
            self._command("add", processed)
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                logger.info("request %s aborted before it finished: its caller stopped waiting (a client that "
                            "hung up, or a shutdown)", request_id)
                self._command("abort", request_id)

    def _pool_for(self, prompt: Any) -> Any:
        if _prompt_chars(prompt) > LARGE_PROMPT_CHARS:
            return self.large_pool
        return self.pool if _has_media(prompt) else self.text_pool

    def abort(self, request_id: str) -> None:
        self._command("abort", request_id)

    def abort_all(self, error: str) -> None:
        """Ends every request in flight with an error (the drain deadline of a shutdown)."""
        self._command("abort_all", error)

    def _command(self, kind: str, payload: Any) -> None:
        self._commands.put((kind, payload))
        try:
            self._wake_w.send(b"x")
        except OSError:  # shut down
            pass

    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def shutdown(self) -> None:
        self._stop.set()
        self._command("wake", None)
        self._thread.join(timeout=10)
        for pool in (self.pool, self.text_pool, self.large_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self._engine.shutdown()

    # -- engine thread ------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if not self.is_alive():
            raise EngineDeadError(f"the engine stopped: {self._error!r}")

    def _run(self, args: EngineArgs, built: Future) -> None:
        try:
            engine = LLMEngine(args)
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(engine)
        self._stepping.wait()
        memory = IdleMemoryReturn()
        try:
            while not self._stop.is_set():
                # block for work only when idle; otherwise just drain what arrived
                self._drain_commands(block=not engine.has_unfinished_requests())
                busy = engine.has_unfinished_requests()
                if busy:
                    # in-process: one step; a core process: its next outputs, or a new command
                    self._publish(engine.step(self._wake_r))
                memory.tick(busy)
                self.stats = engine.stats()
        except BaseException as e:  # a bug, not bad input: fail every open stream loudly
            logger.exception("engine thread died")
            self._error = e
            with self._lock:
                streams = list(self._streams)
            for rid in streams:
                self._deliver(rid, EngineDeadError(f"engine failure: {e!r}"))
            for listener in self.death_listeners:
                listener(e)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for listener in self.step_listeners:
            try:
                listener(outputs)
            except Exception:  # a listener (metrics) never stops the engine
                logger.exception("step listener %r failed", listener)
        # one wake-up of each event loop per step, not one per request: a step of 256
        # streams would otherwise cost 256 writes to the loop's self-pipe
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _drain_commands(self, block: bool) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._execute(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _execute(self, kind: str, payload: Any) -> None:
        engine = self._engine
        if kind == "add":
            if payload.request_id not in self._streams:
                return  # the client left while its media was being processed
            try:
                engine.add_processed(payload)
            except ValueError as e:  # refused before anything was registered (a duplicate id)
                self._deliver(payload.request_id, e)
            except Exception as e:  # a fault: this request fails alone, leaving nothing behind
                logger.exception("request %s could not be queued", payload.request_id)
                engine.abort_request(payload.request_id)
                self._deliver(payload.request_id, e)
        elif kind == "abort":
            self._publish(engine.abort_request(payload))
        elif kind == "abort_all":
            with self._lock:
                ids = list(self._streams)
            self._publish(engine.abort_request(ids, error=payload))

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, out_queue, _ = target
            loop.call_soon_threadsafe(out_queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for out_queue, item in items:
        out_queue.put_nowait(item)


def _has_media(prompt: Any) -> bool:
    media = prompt.get("multi_modal_data") if isinstance(prompt, dict) else getattr(prompt, "media", None)
    return bool(media) and any(bool(items) for items in media.values())


def _prompt_chars(prompt: Any) -> int:
    text = prompt if isinstance(prompt, str) else getattr(prompt, "prompt", None)
    if isinstance(prompt, dict):
        text = prompt.get("prompt")
    return len(text) if isinstance(text, str) else 0
