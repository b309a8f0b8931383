"""The engine core behind a client, in this process or in a process of its own.

`InProcessCore` steps the core when asked (the `LLM` class, the caption CLI, tests).
`ProcessCore` runs it in a child process that steps on its own as long as it has
requests (the servers): the model's step loop then never waits for the interpreter lock
that HTTP, media processing and detokenizing hold in the front end, and the front end
never waits for a step. Requests go to the child and outputs come back over a pipe
(pickled; a picture's pixels are a few hundred KB), with the scheduler's numbers riding
along for /metrics.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import socket
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from vlmserve import envs
from vlmserve.allocator import IdleMemoryReturn
from vlmserve.core.sched_output import EngineCoreOutput, SchedulerStats
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.engine_core import CoreInfo, EngineCore, build_engine_core
from vlmserve.errors import ConfigError
from vlmserve.phase_timer import PhaseTimer
from vlmserve.request import FinishReason, Request

logger = logging.getLogger(__name__)

STATS_INTERVAL = 0.05  # seconds between two stats messages while busy (always one when idle)


class EngineCoreDead(RuntimeError):
    """The engine core's process exited."""


class InProcessCore:
    def __init__(self, args: EngineArgs, model_path: str, eos_token_id: int | None, timer: PhaseTimer) -> None:
        self.core, self.info = build_engine_core(args, model_path, eos_token_id, timer)

    def add_request(self, request: Request) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def step(self, wake: socket.socket | None = None) -> list[EngineCoreOutput]:
        return self.core.step()

    def has_requests(self) -> bool:
        return self.core.has_requests()

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def reset_caches(self) -> bool:
        return self.core.reset_caches()

    def shutdown(self) -> None:
        self.core.shutdown()


class ProcessCore:
    def __init__(self, args: EngineArgs, model_path: str, eos_token_id: int | None, timer: PhaseTimer) -> None:
        # spawn, not fork: the front end's OpenMP and tokenizer threads must not be cloned
        context = multiprocessing.get_context("spawn")
        commands_in, self._commands = context.Pipe(duplex=False)
        self._outputs, outputs_out = context.Pipe(duplex=False)
        self._process = context.Process(target=run_core_process,
                                        args=(args, model_path, eos_token_id, commands_in, outputs_out),
                                        name="vlmserve-engine-core", daemon=True)
        self._process.start()
        commands_in.close()
        outputs_out.close()
        # commands go out from a thread of their own: a large request (a picture's pixels)
        # may fill the pipe while the core is busy sending outputs, which this side must
        # keep reading
        self._outbox: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="vlmserve-core-sender", daemon=True)
        self._sender.start()
        self._stats: SchedulerStats | None = None
        self._pending: list[EngineCoreOutput] = []  # received, not yet handed out
        self.timer = timer
        kind, payload = self._receive()
        if kind == "error":
            self._process.join(timeout=10)
            if isinstance(payload, ConfigError):
                raise payload
            raise RuntimeError(f"the engine core could not start: {payload}")
        self.info: CoreInfo = payload
        self._stats = self._request("stats")

    def add_request(self, request: Request) -> None:
        self._send(("add", request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(("abort", request_ids))

    def step(self, wake: socket.socket | None = None) -> list[EngineCoreOutput]:
        """The core's next outputs; [] if `wake` became readable first (a new command)."""
        if not self._pending:
            ready = wait([self._outputs] + ([wake] if wake is not None else []))
            if self._outputs in ready:
                self._take(self._receive())
        outputs, self._pending = self._pending, []
        return outputs

    def _take(self, message: tuple[str, Any]) -> None:
        kind, (outputs, stats, phases) = message
        self._pending.extend(outputs)
        if stats is not None:
            self._stats = stats
        if phases and self.timer.enabled:
            for name, seconds in phases.items():
                self.timer.seconds[name] += seconds
            self.timer.steps += 1

    def has_requests(self) -> bool:
        return False  # the front end counts its own requests in flight

    def stats(self) -> SchedulerStats:
        """The numbers the core sent last (after every step, and when it went idle)."""
        while self._outputs.poll(0):
            self._take(self._receive())
        return self._stats

    def reset_caches(self) -> bool:
        return self._request("reset")

    def shutdown(self) -> None:
        if self._process.is_alive():
            self._outbox.put(("shutdown", None))
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
        self._outbox.put(None)

    # -- the pipes ------------------------------------------------------------------------
    def _send(self, message: tuple[str, Any]) -> None:
        if not self._process.is_alive():
            raise EngineCoreDead(f"the engine core process exited (code {self._process.exitcode})")
        self._outbox.put(message)

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._commands.send(message)
            except (BrokenPipeError, OSError):
                return  # the core is gone: the receiving side reports it

    def _receive(self) -> tuple[str, Any]:
        try:
            return self._outputs.recv()
        except (EOFError, OSError) as e:
            self._process.join(timeout=5)
            raise EngineCoreDead(f"the engine core process exited (code {self._process.exitcode})") from e

    def _request(self, kind: str) -> Any:
        """A command with an answer (only while no request runs: no outputs are in flight)."""
        self._send((kind, None))
        while True:
            answer_kind, payload = self._receive()
            if answer_kind == kind:
                return payload
            self._take((answer_kind, payload))


def run_core_process(args: EngineArgs, model_path: str, eos_token_id: int | None, commands: Connection,
                     outputs: Connection) -> None:
    """The child's loop: take commands between steps (block for them when idle), step
    while there are requests, send each step's outputs back."""
    logging.basicConfig(level=envs.VLMSERVE_CORE_LOG_LEVEL,
                        format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    timer = PhaseTimer(args.time_steps)
    try:
        core, info = build_engine_core(args, model_path, eos_token_id, timer)
    except ConfigError as e:  # the user's settings: the front end says it in one line
        outputs.send(("error", e))
        return
    except Exception as e:
        logger.exception("the engine core could not start")
        outputs.send(("error", f"{type(e).__name__}: {e}"))
        return
    outputs.send(("ready", info))
    last_stats = 0.0
    memory = IdleMemoryReturn()
    try:
        while True:
            while not core.has_requests() and not commands.poll(memory.idle_seconds / 2):
                memory.tick(busy=False)  # idle: wait for a command (or the front end's exit)
            handled = False
            while commands.poll(0):
                kind, payload = commands.recv()
                if kind == "shutdown":
                    return
                _handle(core, outputs, kind, payload)
                handled = True
            if handled and not core.has_requests():  # aborts left it idle: the metrics must say so
                outputs.send(("outputs", ([], core.stats(), None)))
            if core.has_requests():
                step_outputs = core.step()
                memory.tick(busy=True)
                now = time.monotonic()
                idle = not core.has_requests()
                stats = core.stats() if idle or now - last_stats > STATS_INTERVAL else None
                last_stats = now if stats is not None else last_stats
                phases = dict(timer.seconds) if timer.enabled else None
                timer.reset()
                outputs.send(("outputs", (step_outputs, stats, phases)))
    except (EOFError, BrokenPipeError, OSError):
        return  # the front end is gone
    finally:
        core.shutdown()


def _handle(core: EngineCore, conn: Connection, kind: str, payload: Any) -> None:
    if kind == "add":
        try:
            core.add_request(payload)
        except Exception as e:  # this request fails alone
            logger.exception("request %s could not be queued", payload.request_id)
            failed = EngineCoreOutput(payload.request_id, [], FinishReason.ERROR,
                                      error=f"internal error: {type(e).__name__}: {e}")
            conn.send(("outputs", ([failed], None, None)))
    elif kind == "abort":
        core.abort_requests(payload)
    elif kind == "reset":
        conn.send(("reset", core.reset_caches()))
    elif kind == "stats":
        conn.send(("stats", core.stats()))
    else:
        raise ValueError(f"unknown command {kind!r}")
