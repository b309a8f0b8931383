"""A rank other than 0 of a model split across processes (engine/ranks.py): it joins the
ranks' groups, loads its part of the model, builds its runner from rank 0's plan, then does
every step rank 0 sends it, taking each step's output when rank 0 does (the ranks' collectives
stay in one order), until told to stop. It keeps no outputs: rank 0's reach the
scheduler. Any error ends the process (its peers see its connection close), since a rank
that skipped a step would no longer agree with the others."""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass

import torch

from vlmserve import envs
from vlmserve.distributed import Channel, PipelineStage, TensorParallel, join_group
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.runner_setup import load_models, make_runner
from vlmserve.kernels import kernel_table
from vlmserve.phase_timer import PhaseTimer
from vlmserve.worker.device_queue import DeviceQueue
from vlmserve.worker.model_runner import PendingStep

logger = logging.getLogger(__name__)


@dataclass
class RankJob:
    args: EngineArgs
    model_path: str
    draft_path: str | None
    rank: int
    tp_size: int
    pp_size: int
    address: str  # rank 0's host:port
    backend: str  # the model's collectives: gloo (CPU) or nccl
    threads: int  # torch's compute threads
    device: str


def run_rank(job: RankJob) -> None:
    logging.basicConfig(level=envs.VLMSERVE_CORE_LOG_LEVEL,
                        format=f"%(asctime)s %(levelname)s %(name)s [rank {job.rank}]: %(message)s")
    torch.set_num_threads(job.threads)
    try:
        _serve(job, *join_group(job.backend, job.address, job.rank, job.tp_size, job.pp_size))
    except Exception:
        logger.exception("rank %d failed; it stops, and the engine with it", job.rank)
        os._exit(1)


def _serve(job: RankJob, tp: TensorParallel, stage: PipelineStage, channel: Channel) -> None:
    args = job.args
    kernels = kernel_table(torch.device(job.device).type, args.use_triton)
    model, _, draft_model = load_models(args, job.model_path, kernels, job.draft_path, tp, stage, job.device)
    kind, plan = channel.receive()
    if kind != "plan":
        raise ValueError(f"expected the runner's plan, got {kind!r}")
    runner = make_runner(args, model, draft_model, kernels, plan, job.device, PhaseTimer(False), DeviceQueue())
    steps: deque[PendingStep] = deque()  # submitted, their outputs not taken yet: rank 0's, in its order
    while True:
        kind, payload = channel.receive()
        if kind == "step":
            steps.append(runner.submit(*payload))
            steps[-1].raise_failure()  # at once: the ranks after this one may wait for it
            continue
        if kind == "take":
            steps.popleft().result()
            continue
        if kind == "lora":
            runner.add_lora(*payload)
        elif kind == "clear_encoder_cache":
            runner.clear_encoder_cache()
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown message {kind!r}")


class RayRank:
    """The rank as a Ray actor (ray.remote wraps it where it is started): run() returns when
    the rank stops."""

    def run(self, job: RankJob) -> None:
        run_rank(job)

