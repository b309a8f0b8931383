"""What every rank builds the same way from the engine's settings: its part of the model
(and a draft model, which every rank holds whole), and the runner over it, from the plan
rank 0 made after loading (the KV cache's layout and the scheduler's limits)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlmserve.config import SchedulerConfig
from vlmserve.core.kv_cache_spec import KVCacheConfig
from vlmserve.distributed import PipelineStage, TensorParallel
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.model_source import resolve_pooler
from vlmserve.kernels import KernelTable
from vlmserve.phase_timer import PhaseTimer
from vlmserve.spec_decode.draft_model import DraftModelProposer
from vlmserve.spec_decode.ngram_proposer import NgramProposer
from vlmserve.worker.device_queue import DeviceQueue
from vlmserve.worker.lora_slots import LoRASlots
from vlmserve.worker.model_loader import load_model
from vlmserve.worker.model_runner import ModelRunner


@dataclass
class RunnerPlan:
    """What rank 0 decides once its part of the model is loaded, and every rank's runner
    is built from."""

    kv_config: KVCacheConfig
    sched_config: SchedulerConfig
    eos_token_id: int | None


def rank_device(device: str, rank: int) -> str:
    """Each rank's device: its own GPU (cuda:rank), or the CPU."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else device


def load_models(args: EngineArgs, model_path: str, kernels: KernelTable, draft_path: str | None,
                tp: TensorParallel, stage: PipelineStage, device: str
                ) -> tuple[torch.nn.Module, Any, torch.nn.Module | None]:
    """The rank's part of the model (and the draft model, for speculative decoding with one)."""
    pooler = resolve_pooler(args.runner, args.pooler_config, model_path)
    embeds = pooler is not None and pooler.task == "embed"  # a reranker keeps its head: its score is two logits
    model, hf_config = load_model(model_path, args.dtype, kernels, device, args.pack_weights, args.quantization,
                                  embeds, tp, args.enable_expert_parallel, stage)
    draft_model = None
    if draft_path:
        draft_model = load_model(draft_path, next(model.parameters()).dtype, kernels, device, args.pack_weights)[0]
    return model, hf_config, draft_model


def make_runner(args: EngineArgs, model: torch.nn.Module, draft_model: torch.nn.Module | None, kernels: KernelTable,
                plan: RunnerPlan, device: str, timer: PhaseTimer, queue: DeviceQueue) -> ModelRunner:
    """The runner over the rank's model, with its proposer (speculative decoding) and LoRA
    slots where those are on."""
    speculative = args.speculative()
    sched = plan.sched_config
    proposer = None
    if draft_model is not None:
        proposer = DraftModelProposer(draft_model, speculative.num_speculative_tokens, plan.kv_config,
                                      sched.max_num_seqs, sched.max_model_len)
    elif speculative is not None:
        proposer = NgramProposer(speculative)
    lora = LoRASlots(model, args.max_loras, args.max_lora_rank, args.max_cpu_loras, torch.device(device)) \
        if args.enable_lora else None
    return ModelRunner(model, kernels, plan.kv_config, sched, plan.eos_token_id, device, args.seed, timer, proposer,
                       lora, not args.enforce_eager, queue)
