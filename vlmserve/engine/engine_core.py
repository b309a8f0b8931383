"""The inner loop: schedule -> execute -> update, over one scheduler and one runner; and
how both are built from the engine's settings (model, KV cache budget, context length)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from vlmserve import envs
from vlmserve.allocator import keep_freed_memory
from vlmserve.config import SchedulerConfig
from vlmserve.core.encoder_cache_manager import EncoderCacheManager
from vlmserve.core.kv_cache_manager import KVCacheManager
from vlmserve.core.kv_cache_spec import (AttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroup,
                                         blocks_for_memory, group_layers, kv_cache_dtype, state_slot_bytes,
                                         with_kv_cache_dtype)
from vlmserve.core.mooncake_pool import PoolSettings
from vlmserve.core.sched_output import EngineCoreOutput, SchedulerOutput, SchedulerStats
from vlmserve.core.scheduler import Scheduler
from vlmserve.distributed import ONE_STAGE, SINGLE, PipelineStage
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.model_source import draft_checkpoint
from vlmserve.engine.ranks import ParallelRunner, Ranks
from vlmserve.engine.runner_setup import RunnerPlan, load_models, make_runner, rank_device
from vlmserve.errors import ConfigError, RankFailure
from vlmserve.kernels import kernel_table
from vlmserve.lora.adapter import LoRATarget
from vlmserve.models.kv_scales import check_kv_scales, describe_kv_scales
from vlmserve.models.pipeline_parallel import stage_layers
from vlmserve.phase_timer import PhaseTimer
from vlmserve.request import FinishReason, Request, RequestStatus
from vlmserve.spec_decode.draft_model import check_draft_model
from vlmserve.structured_output.manager import StructuredOutputManager
from vlmserve.worker.device_queue import DeviceQueue
from vlmserve.worker.model_runner import ModelRunner, PendingStep

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_SEQS = 64  # requests running at once where max_num_seqs is not given

EMPTY_STEPS_REPORTED = 100
EMPTY_STEP_SLEEP = 0.01


@dataclass
class CoreInfo:
    """What the front end learns from a built engine core."""

    max_model_len: int
    max_chunk_tokens: int  # prompt tokens one request computes in a step at most
    num_kv_blocks: int
    num_kv_cache_groups: int
    dtype: str
    seconds: float  # to build it
    # with LoRA on: what an adapter may adapt, by checkpoint name (the front end checks
    # adapters against it before a request names one)
    lora_targets: dict[str, LoRATarget] | None = None


@dataclass
class InFlight:
    """A step whose device work was queued and whose output the host has not taken yet."""

    so: SchedulerOutput
    pending: PendingStep


class EngineCore:
    """schedule -> execute -> update, one step at a time; or, with async_scheduling, with one
    step in flight: the next step is scheduled and its inputs prepared while the device
    computes the last one (its decodes' tokens are placeholders, filled on the device), and
    the last one's output is processed after the next is launched. Where the next step needs
    the last one's tokens on the host first (a grammar's mask, penalties, drafts to check,
    an adapter), the pipeline drains: the last step finishes before the next is scheduled.

    A model split into P pipeline stages keeps up to P steps in flight, of different
    requests (the scheduler leaves a request out while its token is in flight): vLLM's
    micro-batches, one in each stage at once."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner | ParallelRunner, structured: StructuredOutputManager,
                 timer: PhaseTimer | None = None, async_scheduling: bool = False, pipeline_stages: int = 1) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.structured = structured
        self.timer = timer or PhaseTimer()
        self.async_scheduling = async_scheduling
        self.pipelined = pipeline_stages > 1
        self.depth = pipeline_stages if self.pipelined else 2 if async_scheduling else 1  # steps in flight at most
        self.in_flight: deque[InFlight] = deque()  # oldest first
        self.num_steps = 0
        self.num_empty_steps = 0  # steps in a row that scheduled nothing while requests waited

    def _note_progress(self, progressed: bool) -> None:
        """Requests that wait while none can run (a step that frees memory by preemption may
        schedule nothing once; more is a bug, as the settings are fitted so that a lone
        request always fits): the loop waits instead of spinning, and says so."""
        if progressed:
            self.num_empty_steps = 0
            return
        self.num_empty_steps += 1
        if self.num_empty_steps == EMPTY_STEPS_REPORTED:
            logger.warning("%d steps in a row scheduled nothing while requests wait: %s", self.num_empty_steps,
                           self.scheduler.describe_waiting())
        if self.num_empty_steps > 1:
            time.sleep(EMPTY_STEP_SLEEP)

    def add_request(self, request: Request) -> None:
        if request.lora_request is not None:
            # read now: an adapter folder that changed since the front end checked it fails
            # this request alone, not the step it would have joined
            self.runner.load_lora(request.lora_request)
        budget = request.reasoning is not None and request.reasoning.budget is not None
        if request.compiled_grammar is not None or budget:
            # the grammar ends on the model's end-of-sequence token alone: a request's own
            # stop_token_ids end the answer where they appear, as without a grammar; a
            # thinking model's starts after its reasoning (and a budget closes that)
            stop_ids = [] if request.eos_token_id is None else [request.eos_token_id]
            request.grammar = self.structured.request_grammar(request.compiled_grammar, request.output_token_ids,
                                                              stop_ids, request.reasoning)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests() or bool(self.in_flight)

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        if stats.connector_block_bytes:  # a KV connector: the time its copies took on the runner's side
            seconds = self.runner.kv_connector_seconds()
            stats.connector_save_seconds = seconds["save"]
            stats.connector_load_seconds += seconds["load"]
        return stats

    def reset_caches(self) -> bool:
        """Forgets the prefix and encoder caches; False (and nothing done) while requests run."""
        if self.has_requests():
            return False
        self.scheduler.reset_caches()
        self.runner.clear_encoder_cache()
        return True

    def shutdown(self) -> None:
        self.runner.shutdown()

    def step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if self.in_flight and not self._can_schedule_ahead():
            while self.in_flight:  # drain: the next step needs their tokens
                outputs += self._finish_oldest()
        if self.scheduler.has_requests():
            launched = self._launch(outputs)
            if launched is not None:
                self.in_flight.append(launched)
        # the oldest steps' outputs, processed while the newest computes; all of them where
        # nothing is left to overlap with (without async scheduling, or when the steps in
        # flight hold the last requests, or only ones that have finished since)
        while len(self.in_flight) > (self.depth - 1 if self.scheduler.has_requests() else 0):
            outputs += self._finish_oldest()
        return outputs

    def _can_schedule_ahead(self) -> bool:
        if self.depth == 1 or self.runner.proposer is not None or \
                any(f.so.state_saves or f.so.state_restores for f in self.in_flight):
            return False
        return self.pipelined or self.scheduler.can_schedule_ahead()  # pipelined: requests in flight sit out

    def _launch(self, outputs: list[EngineCoreOutput]) -> InFlight | None:
        """Schedules a step and queues it on the runner (None: a fault ended its requests);
        requests ended before it runs (their grammar is done) go into outputs."""
        with self.timer.phase("schedule"):
            scheduler_output = self.scheduler.schedule()
        with self.timer.phase("grammar bitmask"):
            grammars = self.structured.step_grammars(self.scheduler.grammars_sampling(scheduler_output))
        # a grammar that admits no further token (a branch that cannot be completed) ends
        # the answer where it is; a matcher that cannot follow its answer is a fault
        ended = self.scheduler.end_scheduled(grammars.finished, RequestStatus.FINISHED_STOPPED)
        ended += self.scheduler.end_scheduled(list(grammars.broken), RequestStatus.FINISHED_ERROR, grammars.broken)
        outputs += ended
        # a step of none while others compute is no stall: its requests are all in them
        computing = any(f.so.total_num_scheduled_tokens for f in self.in_flight)
        self._note_progress(scheduler_output.total_num_scheduled_tokens > 0 or bool(ended) or computing)
        try:
            return InFlight(scheduler_output, self.runner.submit(scheduler_output, grammars.bitmask))
        except RankFailure:
            raise  # the engine cannot go on
        except Exception as e:
            outputs += self._fail(scheduler_output, e)
            return None

    def _finish_oldest(self) -> list[EngineCoreOutput]:
        """Takes the oldest step's output and updates the scheduler with it. If its device
        work failed, its requests end with an error, and the steps queued behind it (which
        ran on what it left) are undone: their requests start again."""
        flight = self.in_flight.popleft()
        try:
            runner_output = flight.pending.result()
        except RankFailure:
            raise
        except Exception as e:
            behind, self.in_flight = list(self.in_flight), deque()
            for later in reversed(behind):  # newest first: each undoes its own progress
                try:
                    later.pending.result()
                except Exception:  # it ran on the failed step's state: what it says is moot
                    pass
                self.scheduler.requeue_step(later.so, failing=set(flight.so.num_scheduled_tokens))
            return self._fail(flight.so, e)
        self.num_steps += 1
        with self.timer.phase("scheduler update"):
            return self.scheduler.update_from_output(flight.so, runner_output)

    def _fail(self, scheduler_output: SchedulerOutput, error: Exception) -> list[EngineCoreOutput]:
        """A fault in the model fails the requests of its step, not the engine."""
        logger.exception("model execution failed", exc_info=error)
        ids = [rid for rid in scheduler_output.num_scheduled_tokens if rid in self.scheduler.requests]
        self.scheduler.discard_step(scheduler_output)
        return [EngineCoreOutput(rid, [], FinishReason.ERROR, error=f"internal error: {type(error).__name__}: {error}")
                for rid in ids]


def build_engine_core(args: EngineArgs, model_path: str, eos_token_id: int | None,
                      timer: PhaseTimer | None = None) -> tuple[EngineCore, CoreInfo]:
    """Loads the model, sizes the KV cache from the memory budget, and builds the
    scheduler and the runner (over the model's ranks, where it is split across several)."""
    start = time.perf_counter()
    keep_freed_memory()  # before the model's weights and the KV cache are allocated
    torch.manual_seed(args.seed)
    speculative = args.speculative()
    draft_path = None
    if speculative and speculative.method == "draft_model":
        draft_path = draft_checkpoint(speculative, model_path, args.download_dir)  # before anything loads
    if speculative:
        logger.info("speculative decoding: %s", speculative)
    # the other ranks of a model split across processes: started first, they load their parts meanwhile
    ranks = Ranks.start(args, model_path, draft_path) if args.world_size() > 1 else None
    try:
        core, info = _build(args, model_path, eos_token_id, timer, draft_path, ranks)
    except BaseException:
        if ranks is not None:
            ranks.stop()
        raise
    info.seconds = time.perf_counter() - start
    return core, info


def _build(args: EngineArgs, model_path: str, eos_token_id: int | None, timer: PhaseTimer | None,
           draft_path: str | None, ranks: Ranks | None) -> tuple[EngineCore, CoreInfo]:
    # the device work's thread (async scheduling on the CPU) builds the models it runs
    overlap = args.overlaps_steps()
    queue = DeviceQueue(threaded=overlap and torch.device(args.device).type == "cpu")
    kernels = kernel_table(torch.device(args.device).type, args.use_triton)  # this engine's, chosen once
    device = rank_device(args.device, 0)
    model, hf_config, draft_model = queue.call(lambda: load_models(
        args, model_path, kernels, draft_path, ranks.tp if ranks else SINGLE, ranks.stage if ranks else ONE_STAGE,
        device))
    plan, max_chunk_tokens = plan_runner(args, model, hf_config, draft_model, eos_token_id)
    timer = timer or PhaseTimer(args.time_steps)
    runner = queue.call(lambda: make_runner(args, model, draft_model, kernels, plan, device, timer, queue))
    if ranks is not None:
        runner = ranks.follow(runner, plan)
    kv_config, sched_config = plan.kv_config, plan.sched_config
    kv_manager = KVCacheManager(kv_config, sched_config.max_model_len, args.prefix_caching)
    scheduler = Scheduler(sched_config, kv_manager, EncoderCacheManager(args.encoder_cache_size))
    structured = StructuredOutputManager(model_path, model.text_config.vocab_size, sched_config.max_num_seqs)
    info = CoreInfo(sched_config.max_model_len, max_chunk_tokens, kv_config.num_blocks, len(kv_config.groups),
                    str(next(model.parameters()).dtype).removeprefix("torch."), 0.0,
                    runner.lora.targets if runner.lora else None)
    return EngineCore(scheduler, runner, structured, timer, overlap, args.pipeline_parallel_size), info


def plan_runner(args: EngineArgs, model: torch.nn.Module, hf_config, draft_model: torch.nn.Module | None,
                eos_token_id: int | None) -> tuple[RunnerPlan, int]:
    """The KV cache's layout and the scheduler's limits for the loaded model (the same on
    every rank), and the most prompt tokens a request computes in a step."""
    speculative = args.speculative()
    dtype = next(model.parameters()).dtype
    groups = kv_cache_groups(args, model, dtype)
    draft_groups = [] if draft_model is None else check_draft_model(draft_model, groups, args.block_size, dtype)
    num_drafts = speculative.num_speculative_tokens if speculative else 0
    lookahead = num_drafts if draft_model is not None else 0  # slots for a draft model's guesses
    max_num_seqs = running_limit(args, groups, num_drafts, draft_groups)
    stages = [stage_layers(len(model.model.language_model.layers), PipelineStage(s, args.pipeline_parallel_size))
              for s in range(args.pipeline_parallel_size)]
    kv_config = kv_cache_config(args, groups, max_num_seqs, num_drafts, draft_groups, stages)
    kv_config.pool = pool_settings(args, hf_config, groups, draft_groups)
    if kv_config.pool is not None and kv_config.num_host_blocks:
        raise ConfigError("--kv-offloading-size and --kv-transfer-config: one KV connector at a time")
    # a decode step with drafts computes 1 + k tokens, and a draft model writes past them
    max_model_len = fit_max_model_len(args, hf_config, kv_config, 1 + num_drafts + lookahead)
    max_chunk_tokens = fit_chunk(args.max_num_batched_tokens, kv_config, max_model_len, lookahead)
    if not args.chunked_prefill:
        max_model_len = fit_unchunked(args, max_model_len, max_chunk_tokens)
    sched_config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=args.chunked_prefill,
        encoder_compute_budget=args.encoder_compute_budget,
        encoder_cache_size=args.encoder_cache_size,
        max_running_for_drafts=speculative.disable_by_batch_size if speculative else None,
        num_lookahead_tokens=lookahead,
        max_chunk_tokens=max_chunk_tokens,
        max_loras=args.max_loras if args.enable_lora else 0,
        sit_out_in_flight=args.pipeline_parallel_size > 1,
    )
    return RunnerPlan(kv_config, sched_config, eos_token_id), max_chunk_tokens


def kv_cache_groups(args: EngineArgs, model: torch.nn.Module, dtype: torch.dtype) -> list[KVCacheGroup]:
    """The model's KV cache groups, the attention layers' keys and values in --kv-cache-dtype
    (recurrent states keep theirs)."""
    kv_dtype = kv_cache_dtype(args.kv_cache_dtype, dtype)
    if kv_dtype != dtype:
        check_kv_scales(model)
        logger.info("KV cache in %s, %s", str(kv_dtype).removeprefix("torch."), describe_kv_scales(model))
    return group_layers(with_kv_cache_dtype(model.kv_cache_specs(args.block_size, dtype), kv_dtype))


def state_bytes_per_request(groups, num_drafts: int = 0, draft_groups=()) -> int:
    """Recurrent-state memory one running request holds: its state slot (and one per
    draft: checkpoints for speculative decoding) across the model's and a draft model's
    layers, plus the draft model's scratch slot. 0 without recurrent layers."""
    draft_slot_bytes = state_slot_bytes(list(draft_groups))
    return (state_slot_bytes(groups) + draft_slot_bytes) * (1 + num_drafts) + draft_slot_bytes


def running_limit(args: EngineArgs, groups, num_drafts: int = 0, draft_groups=()) -> int:
    """Requests running at once: max_num_seqs where given; else 64, or fewer where a
    hybrid model's recurrent states for 64 would take more than half the KV budget (a
    released Qwen3.5 holds ~49 MB a request: 64 need 3 GB), so that a default start never
    fails for want of state memory."""
    if args.max_num_seqs is not None:
        return args.max_num_seqs
    per_request = state_bytes_per_request(groups, num_drafts, draft_groups)
    half_budget = args.kv_cache_memory_gb * (1 << 30) / 2
    if per_request * DEFAULT_MAX_NUM_SEQS <= half_budget:
        return DEFAULT_MAX_NUM_SEQS
    fits = max(1, int(half_budget // per_request))
    logger.warning("running at most %d requests at once: each holds %.3g MB of recurrent state, and "
                   "kv_cache_memory_gb=%g gives states half of it; raise kv_cache_memory_gb (or set max_num_seqs) "
                   "for more", fits, per_request / (1 << 20), args.kv_cache_memory_gb)
    return fits


def kv_cache_config(args: EngineArgs, groups, max_num_seqs: int, num_drafts: int = 0,
                    draft_groups=(), stages: list[range] | None = None) -> KVCacheConfig:
    """Splits the KV memory budget: recurrent layers first get a state slot for every
    request that can run at once (max_num_seqs; and one per draft: checkpoints for
    speculative decoding), plus snapshot slots for prefix caching (a quarter of the budget
    at most); attention blocks get the rest. A draft model's layers take their share of
    each slot and block (and a scratch state slot per request). Split into pipeline
    stages (the layers of each), the budget is each rank's, and the fullest stage sizes
    the blocks every stage has."""
    stages = stages or [None]
    budget = int(args.kv_cache_memory_gb * (1 << 30))
    draft_slot_bytes = state_slot_bytes(list(draft_groups))
    budget -= max_num_seqs * draft_slot_bytes
    slot_bytes = max(state_slot_bytes(groups, layers) for layers in stages) + draft_slot_bytes
    num_slots = snapshots = 0
    if slot_bytes:
        snapshots = args.num_state_snapshots
        if snapshots is None:
            snapshots = min(8 * max_num_seqs, budget // 4 // slot_bytes) if args.prefix_caching else 0
        num_slots = max_num_seqs * (1 + num_drafts) + snapshots
        budget -= num_slots * slot_bytes
        if budget <= 0 and args.num_kv_blocks is None:
            needed = args.kv_cache_memory_gb - budget / (1 << 30)
            raise ValueError(f"the recurrent states of max_num_seqs={max_num_seqs} requests and {snapshots} "
                             f"prefix-caching snapshots ({slot_bytes / (1 << 20):.1f} MB each) need {needed:.2f} GB "
                             f"and leave no room for attention blocks in kv_cache_memory_gb={args.kv_cache_memory_gb}: "
                             f"lower max_num_seqs or raise kv_cache_memory_gb")
    draft_block_bytes = sum(len(g.layer_ids) * g.spec.page_size_bytes for g in draft_groups
                            if isinstance(g.spec, AttentionSpec))
    fits = [n for layers in stages if (n := blocks_for_memory(groups, budget, draft_block_bytes, layers)) is not None]
    num_blocks = args.num_kv_blocks or min(fits, default=2)
    return KVCacheConfig(num_blocks, groups, num_state_slots=num_slots, num_state_snapshots=snapshots,
                         num_host_blocks=host_blocks(args, groups, draft_groups))


def host_blocks(args: EngineArgs, groups, draft_groups=()) -> int:
    """The host tier's slots (--kv-offloading-size, shared by the ranks): a block of every
    attention layer each."""
    if not args.kv_offloading_size:
        return 0
    check_connector_fits("--kv-offloading-size", groups, draft_groups)
    block_bytes = max(g.spec.page_size_bytes for g in groups) * max(len(g.layer_ids) for g in groups)
    per_rank = args.kv_offloading_size * (1 << 30) / args.tensor_parallel_size
    num = max(1, int(per_rank // block_bytes))
    logger.info("host KV tier: %d blocks of %.2f MB (%.2f GiB a rank)", num, block_bytes / 1e6, per_rank / (1 << 30))
    return num


def pool_settings(args: EngineArgs, hf_config, groups, draft_groups=()) -> PoolSettings | None:
    """The Mooncake pool of --kv-transfer-config: its settings, and the namespace of this
    model's blocks in it (the model, its KV layout)."""
    transfer = args.kv_transfer()
    if transfer is None:
        return None
    check_connector_fits("--kv-transfer-config", groups, draft_groups)
    if args.tensor_parallel_size > 1:
        raise ConfigError("--kv-transfer-config: a Mooncake pool is not shared under tensor parallelism yet (each "
                          "rank would keep its own share); use --kv-offloading-size there")
    try:
        settings = transfer.mooncake_settings(envs.MOONCAKE_CONFIG_PATH)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--kv-transfer-config: {e}") from None
    layout = json.dumps([args.model, hf_config.to_json_string(), [(str(g.spec), g.layer_ids) for g in groups]])
    namespace = "vlmserve-" + hashlib.sha256(layout.encode()).hexdigest()[:16]
    logger.info("KV blocks shared in the Mooncake pool at %s (%s, %s)", settings["master_server_address"],
                transfer.kv_role, namespace)
    return PoolSettings(json.dumps(settings, sort_keys=True), namespace, transfer.kv_role)


def check_connector_fits(flag: str, groups, draft_groups) -> None:
    """A copy of a block's keys and values is all a KV connector keeps: full attention only."""
    kinds = {type(g.spec).__name__ for g in groups if not isinstance(g.spec, FullAttentionSpec)}
    if kinds:
        raise ConfigError(f"{flag}: this model has {' and '.join(sorted(kinds))} layers, whose state a copy of its "
                          f"attention blocks does not hold; KV offloading takes full-attention models (Qwen2-VL, "
                          f"Qwen2.5-VL, Qwen3-VL)")
    if draft_groups:
        raise ConfigError(f"{flag}: a draft model's KV blocks are not offloaded; use it without a draft model "
                          f"(n-gram speculation works)")


def fits_alone(kv_config: KVCacheConfig, num_tokens: int, query_len: int) -> bool:
    """Whether one request of num_tokens, computing query_len tokens a step, fits the
    empty cache (one block is the null block)."""
    return sum(g.spec.max_blocks_for(num_tokens, query_len) for g in kv_config.groups) <= kv_config.num_blocks - 1


def fit_max_model_len(args: EngineArgs, hf_config, kv_config: KVCacheConfig, max_query_len: int = 1) -> int:
    """The context length: the model's (or the one asked for), lowered until a single
    request fits the KV cache (decoding max_query_len tokens a step), or it could never
    finish."""
    text = getattr(hf_config, "text_config", hf_config)
    model_len = getattr(text, "max_position_embeddings", 4096)
    wanted = args.max_model_len or model_len
    if wanted > model_len:
        logger.warning("max_model_len %d exceeds the model's %d", wanted, model_len)
    fits = wanted
    while fits > 1 and not fits_alone(kv_config, fits, max_query_len):
        fits = fits * 3 // 4
    if fits < wanted:
        logger.warning("max_model_len lowered from %d to %d to fit the KV cache", wanted, fits)
    return fits


def fit_unchunked(args: EngineArgs, max_model_len: int, max_chunk_tokens: int) -> int:
    """Without chunked prefill a prompt goes into one step whole, and a preempted request
    comes back with its output as its prompt: the context can be no longer than one step
    computes for one request, or such a request would wait forever (vLLM's rule)."""
    if max_model_len <= max_chunk_tokens:
        return max_model_len
    if args.max_model_len is not None:
        raise ConfigError(f"--max-model-len {args.max_model_len} is over the {max_chunk_tokens} tokens one step computes "
                          f"for a request (--max-num-batched-tokens {args.max_num_batched_tokens}, the KV cache) "
                          f"with chunked prefill off: a longer prompt could never be scheduled; raise "
                          f"--max-num-batched-tokens, lower --max-model-len, or leave chunked prefill on")
    logger.warning("chunked prefill is off: max_model_len lowered from %d to %d, the most one step computes for a "
                   "request (--max-num-batched-tokens)", max_model_len, max_chunk_tokens)
    return max_chunk_tokens


def fit_chunk(max_num_batched_tokens: int, kv_config: KVCacheConfig, max_model_len: int, lookahead: int) -> int:
    """The most prompt tokens one request computes in a step: a chunk holds sliding-window
    blocks for its whole span and the window before it, and a lone request's chunk must
    fit the empty cache, or it would wait forever. The token budget where blocks allow."""
    chunk = max_num_batched_tokens
    while chunk > 1 and not fits_alone(kv_config, max_model_len, chunk + lookahead):
        chunk = chunk * 3 // 4
    if chunk < max_num_batched_tokens:
        logger.info("prompt chunks of at most %d tokens per request fit the KV cache", chunk)
    return chunk
