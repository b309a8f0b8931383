"""The ranks of a model split across processes (tensor parallelism, pipeline stages),
driven in lockstep from one scheduler. Rank 0 runs in the engine core's process, beside
the scheduler; the others are processes of this machine (`--distributed-executor-backend
mp`) or Ray actors, on any machine of the Ray cluster (`ray`). Each holds its part of the model (a share of
every layer of its stage's, distributed.py) and runs a runner of its own over it
(engine/rank_worker.py).

Every step's SchedulerOutput goes to every rank, broadcast from a thread of its own on a
group of its own, so that sending never waits on the model's collectives nor holds up
rank 0's host work; so does word of each step whose output rank 0 takes, which the
others take then too (its sampling, which may gather over them). Every rank computes the
step and samples the same tokens: the logits are the same on every rank after their
gather (and the last stage's output reaches every stage), and so are the sampling
settings and generators, which the same SchedulerOutputs drive. Only rank 0's output
reaches the scheduler.

A rank that dies ends the engine with a RankFailure naming it: its peers' collectives
fail at once (their connection to it closes) and rank 0 checks the processes' lives at
every step. A step that fails on rank 0 does too, since the ranks may no longer agree.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from vlmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vlmserve.distributed import Channel, PipelineStage, TensorParallel, join_group
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.rank_worker import RankJob, RayRank, run_rank
from vlmserve.engine.runner_setup import RunnerPlan, rank_device
from vlmserve.errors import RankFailure
from vlmserve.lora.request import LoRARequest
from vlmserve.structured_output.manager import GrammarBitmask
from vlmserve.worker.device_queue import run_into
from vlmserve.worker.model_runner import ModelRunner, PendingStep

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0  # seconds a rank has to stop before it is killed
JOIN_POLL = 0.5  # seconds between checks on the ranks' lives while they join


def free_address() -> str:
    """host:port where rank 0 can listen for the other ranks."""
    host = "127.0.0.1"
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def compute_backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass
class RankHandle:
    """One of the other ranks: a process of this machine, or a Ray actor."""

    rank: int
    process: Any = None  # multiprocessing.Process
    actor: Any = None  # a Ray actor
    done: Any = None  # the Ray actor's run(): an ObjectRef that resolves when it ends

    def exit_status(self) -> str | None:
        """Why it is gone (None: alive)."""
        if self.process is not None:
            return None if self.process.is_alive() else f"exit code {self.process.exitcode}"
        import ray

        finished, _ = ray.wait([self.done], timeout=0)
        if not finished:
            return None
        try:
            ray.get(finished[0])
            return "it stopped"
        except Exception as e:  # the actor's error, or its death
            return f"{type(e).__name__}: {str(e)[:300]}"

    def stop(self, wait: float = STOP_TIMEOUT) -> None:
        """Waits for it to stop (told so before), then ends it."""
        if self.process is not None:
            self.process.join(timeout=wait)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=STOP_TIMEOUT)
            return
        import ray

        if not ray.wait([self.done], timeout=wait)[0]:
            ray.kill(self.actor)


class Ranks:
    """Rank 0's view of the other ranks: started with `start`, then followed by rank 0's
    runner (`follow`)."""

    def __init__(self, tp: TensorParallel, stage: PipelineStage, channel: Channel, others: list[RankHandle]) -> None:
        self.tp, self.stage = tp, stage
        self.size = tp.size * stage.size
        self.others = others
        self._channel = channel
        self._stopped = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._send_error: BaseException | None = None
        self._sender = threading.Thread(target=self._send_loop, name="vlmserve-rank-sender", daemon=True)
        self._sender.start()

    @classmethod
    def start(cls, args: EngineArgs, model_path: str, draft_path: str | None) -> Ranks:
        """Starts ranks 1..N-1 and joins them in a group as rank 0."""
        tp_size, pp_size, backend = args.tensor_parallel_size, args.pipeline_parallel_size, compute_backend(args.device)
        size = tp_size * pp_size
        threads = max(1, torch.get_num_threads() // size)  # on the CPU the ranks share its cores
        ray_backend = args.distributed_executor_backend == "ray"
        address = free_address() if not ray_backend else _ray_address()
        # a Ray actor sees only the GPU it was given (cuda:0); a process here, every GPU
        jobs = [RankJob(args, model_path, draft_path, rank, tp_size, pp_size, address, backend, threads,
                        rank_device(args.device, 0 if ray_backend else rank)) for rank in range(1, size)]
        others = [_start_ray(job) if ray_backend else _start_process(job) for job in jobs]
        torch.set_num_threads(threads)
        logger.info("%d ranks (%d stages of %d; %s, %s), %d threads each", size, pp_size, tp_size,
                    args.distributed_executor_backend, backend, threads)
        try:
            return cls(*_join_while_alive(backend, address, tp_size, pp_size, others), others)
        except BaseException:
            for other in others:
                other.stop(wait=0)
            raise

    def follow(self, runner: ModelRunner, plan: RunnerPlan) -> ParallelRunner:
        """Sends the other ranks the plan their runners are built from; returns rank 0's
        runner with the others following it."""
        self.send("plan", plan)
        return ParallelRunner(runner, self)

    def send(self, kind: str, payload: Any = None) -> None:
        self.check()
        self._outbox.put((kind, payload))

    def check(self) -> None:
        """RankFailure if a rank is gone (or the sender could not reach one)."""
        for other in self.others:
            status = other.exit_status()
            if status is not None:
                raise RankFailure(f"rank {other.rank} died ({status}); the engine stops")
        if self._send_error is not None:
            raise RankFailure(f"the ranks could not be reached: {self._send_error}")

    def failure(self, error: BaseException) -> RankFailure:
        """The error a failed step ends the engine with (a dead rank's, where one is); the
        other ranks are ended."""
        try:
            self.check()
            failure = RankFailure(f"a step failed on rank 0 of {self.size} (the ranks may disagree now; the "
                                  f"engine stops): {type(error).__name__}: {error}")
        except RankFailure as dead:
            failure = dead
        logger.error("%s", failure)
        self.stop(wait=0)
        return failure

    def stop(self, wait: float = STOP_TIMEOUT) -> None:
        """Tells the other ranks to stop and waits up to `wait` seconds for them before
        ending them."""
        if self._stopped:
            return
        self._stopped = True
        if wait and self._send_error is None and all(o.exit_status() is None for o in self.others):
            self._outbox.put(("stop", None))
        self._outbox.put(None)
        for other in self.others:
            other.stop(wait)
        self._sender.join(timeout=STOP_TIMEOUT)

    def _send_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._channel.send(message)
            except Exception as e:  # a rank is gone: the next step says which
                self._send_error = e
                return


class ParallelRunner:
    """Rank 0's runner, with the other ranks doing each step alongside (the runner's
    interface, as the engine core calls it)."""

    def __init__(self, runner: ModelRunner, ranks: Ranks) -> None:
        self.runner = runner
        self.ranks = ranks
        self._sent_loras: set[tuple[int, str]] = set()  # the adapters the other ranks were sent

    @property
    def proposer(self):
        return self.runner.proposer

    @property
    def lora(self):
        return self.runner.lora

    @property
    def encoder_runs(self) -> int:
        return self.runner.encoder_runs

    def kv_connector_seconds(self) -> dict[str, float]:
        return self.runner.kv_connector_seconds()  # rank 0's (every rank copies its share alike)

    def submit(self, so: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ParallelPendingStep:
        self.ranks.send("step", (so, grammar))
        try:
            return ParallelPendingStep(self.runner.submit(so, grammar), self.ranks)
        except Exception as e:
            raise self.ranks.failure(e) from e

    def execute_model(self, so: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        return self.submit(so, grammar).result()

    def load_lora(self, lora: LoRARequest) -> None:
        """Rank 0 reads (and checks) the adapter, and sends it to the others the first time:
        no other rank reads its folder (which a rank on another machine may not have), and
        none can fail on it after rank 0 took it."""
        adapter = self.runner.load_lora(lora)
        if (lora.lora_int_id, lora.lora_path) not in self._sent_loras:
            self.ranks.send("lora", (lora, adapter))
            self._sent_loras.add((lora.lora_int_id, lora.lora_path))

    def clear_encoder_cache(self) -> None:
        self.ranks.send("clear_encoder_cache")
        self.runner.clear_encoder_cache()

    def shutdown(self) -> None:
        self.ranks.stop()
        self.runner.shutdown()


class ParallelPendingStep:
    def __init__(self, pending: PendingStep, ranks: Ranks) -> None:
        self.pending, self.ranks = pending, ranks

    def result(self) -> ModelRunnerOutput:
        self.ranks.send("take")  # the others take theirs alongside (its sampling may gather over them)
        try:
            return self.pending.result()
        except Exception as e:
            raise self.ranks.failure(e) from e


def _join_while_alive(backend: str, address: str, tp_size: int, pp_size: int, others: list[RankHandle]
                      ) -> tuple[TensorParallel, PipelineStage, Channel]:
    """Joins the group as rank 0, on a thread of its own, while checking that the other
    ranks live: one that dies starting (its import, its device) fails the start at once
    instead of leaving rank 0 waiting for it."""
    joined: Future = Future()
    threading.Thread(target=lambda: run_into(joined, lambda: join_group(backend, address, 0, tp_size, pp_size)),
                     name="vlmserve-rank-join", daemon=True).start()
    while True:
        try:
            return joined.result(timeout=JOIN_POLL)
        except TimeoutError:
            for other in others:
                status = other.exit_status()
                if status is not None:
                    raise RankFailure(f"rank {other.rank} died starting ({status}); its log says why")


def _start_process(job: RankJob) -> RankHandle:
    import multiprocessing

    # spawn: a fork would copy the front end's threads (OpenMP's, the tokenizer's)
    process = multiprocessing.get_context("spawn").Process(target=run_rank, args=(job,), name=f"vlmserve-rank-{job.rank}",
                                                           daemon=True)
    process.start()
    logger.info("rank %d is process %d", job.rank, process.pid)
    return RankHandle(job.rank, process=process)


def _ray_address() -> str:
    """An address on this node that ranks on other nodes of the Ray cluster can reach."""
    import ray

    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True)  # the cluster RAY_ADDRESS names, else a local one
    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


def _start_ray(job: RankJob) -> RankHandle:
    import ray

    gpus = 1 if torch.device(job.args.device).type == "cuda" else 0
    actor = ray.remote(num_cpus=job.threads, num_gpus=gpus)(RayRank).remote()
    return RankHandle(job.rank, actor=actor, done=actor.run.remote(job))
