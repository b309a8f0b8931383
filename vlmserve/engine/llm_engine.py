"""The engine every entry point drives: requests in, RequestOutputs out, one step at a time."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vlmserve.config import CacheConfig, SchedulerConfig
from vlmserve.core.encoder_cache_manager import EncoderCacheManager
from vlmserve.core.kv_cache_manager import KVCacheManager
from vlmserve.core.kv_cache_spec import KVCacheConfig, blocks_for_memory, group_layers, state_slot_bytes
from vlmserve.core.kv_cache_utils import make_block_hasher
from vlmserve.core.scheduler import Scheduler
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.engine_core import EngineCore
from vlmserve.engine.input_processor import InputProcessor, PromptInput
from vlmserve.engine.output_processor import OutputProcessor
from vlmserve.engine.stats import EngineStats
from vlmserve.multimodal.media import MediaLoader
from vlmserve.multimodal.processor import MultiModalProcessor
from vlmserve.outputs import RequestOutput
from vlmserve.request import Request
from vlmserve.sampling_params import SamplingParams
from vlmserve.worker.allocator import keep_freed_memory
from vlmserve.worker.model_loader import load_model
from vlmserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "assets" / "shapes-qwen3.5"


def resolve_model_path(model: str | None) -> str:
    """A checkpoint folder; None means the small shapes model shipped with vlmserve."""
    path = DEFAULT_MODEL if model is None else Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model!r} is not a checkpoint folder (no config.json); models are not downloaded")
    return str(path)


@dataclass
class ProcessedRequest:
    request_id: str
    prompt: str | None
    params: SamplingParams
    request: Request  # the first sample's; the others are cloned from it


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        start = time.perf_counter()
        keep_freed_memory()  # before the model's weights and the KV cache are allocated
        self.args = args
        self.model_path = resolve_model_path(args.model)
        torch.manual_seed(args.seed)

        model, hf_config = load_model(self.model_path, args.dtype, args.device, args.pack_weights)
        dtype = next(model.parameters()).dtype
        self.dtype = dtype
        self.hf_config = hf_config
        media_loader = MediaLoader(args.media_limits())
        self.mm_processor = MultiModalProcessor(
            self.model_path, hf_config, media_loader, int(args.processor_cache_gb * (1 << 30))
        )
        self.tokenizer = self.mm_processor.hf_processor.tokenizer
        self.vocab_size = getattr(hf_config, "text_config", hf_config).vocab_size

        groups = group_layers(model.kv_cache_specs(args.block_size, dtype))
        kv_config = self._kv_cache_config(groups)
        num_blocks = kv_config.num_blocks
        max_model_len = self._max_model_len(hf_config, kv_config)
        sched_config = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            encoder_compute_budget=args.encoder_compute_budget,
            encoder_cache_size=args.encoder_cache_size,
        )
        self.scheduler_config = sched_config
        self.cache_config = CacheConfig(args.block_size, num_kv_blocks=num_blocks,
                                        enable_prefix_caching=args.enable_prefix_caching)
        eos_ids = self._eos_token_ids(hf_config)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.extra_eos_ids = eos_ids[1:]

        runner = ModelRunner(model, hf_config, kv_config, sched_config, self.eos_token_id, args.device, args.seed)
        kv_manager = KVCacheManager(kv_config, max_model_len, args.enable_prefix_caching)
        encoder_manager = EncoderCacheManager(args.encoder_cache_size)
        self.engine_core = EngineCore(Scheduler(sched_config, kv_manager, encoder_manager), runner)

        self.input_processor = InputProcessor(
            tokenizer=self.tokenizer,
            mm_processor=self.mm_processor,
            model_cls=type(model),
            hf_config=hf_config,
            max_model_len=max_model_len,
            eos_token_id=self.eos_token_id,
            block_hasher=make_block_hasher(args.block_size),
            max_media_tokens=min(args.encoder_compute_budget, args.encoder_cache_size),
            block_size=args.block_size,
            limit_mm_per_prompt=dict(args.limit_mm_per_prompt),
            default_mm_kwargs=args.mm_processor_kwargs,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.startup_seconds = time.perf_counter() - start
        logger.info(
            "engine ready in %.2fs: %d KV blocks of %d tokens, %d KV cache group(s), max_model_len %d",
            self.startup_seconds, num_blocks, args.block_size, len(groups), max_model_len,
        )

    # -- setup helpers -------------------------------------------------------------------
    def _kv_cache_config(self, groups) -> KVCacheConfig:
        """Splits the KV memory budget: recurrent layers first get a state slot for every
        request that can run at once, plus snapshot slots for prefix caching (a quarter of
        the budget at most); attention blocks get the rest."""
        args = self.args
        budget = int(args.kv_cache_memory_gb * (1 << 30))
        slot_bytes = state_slot_bytes(groups)
        num_slots = 0
        if slot_bytes:
            snapshots = args.num_state_snapshots
            if snapshots is None:
                snapshots = min(8 * args.max_num_seqs, budget // 4 // slot_bytes) if args.enable_prefix_caching else 0
            num_slots = args.max_num_seqs + snapshots
            budget -= num_slots * slot_bytes
            if budget <= 0 and args.num_kv_blocks is None:
                raise ValueError("kv_cache_memory_gb is too small for the recurrent states of max_num_seqs requests")
        num_blocks = args.num_kv_blocks or blocks_for_memory(groups, budget)
        return KVCacheConfig(num_blocks, groups, num_state_slots=num_slots)

    def _max_model_len(self, hf_config, kv_config: KVCacheConfig) -> int:
        text = getattr(hf_config, "text_config", hf_config)
        model_len = getattr(text, "max_position_embeddings", 4096)
        wanted = self.args.max_model_len or model_len
        if wanted > model_len:
            logger.warning("max_model_len %d exceeds the model's %d", wanted, model_len)
        # a single request must always fit in the KV cache, or it could never finish
        usable = kv_config.num_blocks - 1
        fits = wanted
        while fits > 1 and sum(g.spec.max_blocks_for(fits) for g in kv_config.groups) > usable:
            fits = fits * 3 // 4
        if fits < wanted:
            logger.warning("max_model_len lowered from %d to %d to fit the KV cache", wanted, fits)
        return fits

    def _eos_token_ids(self, hf_config) -> list[int]:
        gen_path = Path(self.model_path) / "generation_config.json"
        eos = None
        if gen_path.is_file():
            import json

            eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is None:
            eos = getattr(getattr(hf_config, "text_config", hf_config), "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    # -- requests ------------------------------------------------------------------------
    def process_request(
        self,
        request_id: str,
        prompt: str | dict | PromptInput,
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> ProcessedRequest:
        """Validates and processes a request (media included); raises ValueError on bad
        input. Thread-safe and independent of the step loop: run it in a worker pool."""
        params = params or SamplingParams()
        self.check_params(params)
        arrival_time = arrival_time or time.time()
        if self.extra_eos_ids and not params.ignore_eos:
            params = params.with_stop_token_ids(self.extra_eos_ids)
        request = self.input_processor.process(request_id, prompt, params.for_child(0), arrival_time, priority, cache_salt)
        return ProcessedRequest(request_id, PromptInput.parse(prompt).prompt, params, request)

    def check_params(self, params: SamplingParams) -> None:
        """The model's checks of a request's sampling parameters (ParamError if bad)."""
        params.verify(self.vocab_size, self.args.max_n)

    def add_processed(self, processed: ProcessedRequest) -> None:
        """Queues a processed request (on the thread that steps the engine)."""
        rid = processed.request_id
        if rid in self.output_processor.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        first = processed.request
        child_ids = self.output_processor.add_request(
            rid, processed.prompt, first.prompt_token_ids, processed.params, first.arrival_time
        )
        for i, child_id in enumerate(child_ids):
            # the samples share the processed prompt; only their ids and seeds differ
            request = first if i == 0 else first.clone_as(child_id, processed.params.for_child(i))
            request.request_id = child_id
            self.engine_core.add_request(request)

    def add_request(self, request_id: str, prompt: str | dict | PromptInput, params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        self.add_processed(self.process_request(request_id, prompt, params, priority, cache_salt, arrival_time))

    def abort_request(self, request_ids: str | list[str], error: str | None = None) -> list[RequestOutput]:
        """Ends requests (finish reason "abort"; `error` says why, if not the caller's
        choice) and frees everything they hold."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            self.engine_core.abort_requests(self.output_processor.child_ids(rid))
            out = self.output_processor.abort_request(rid, error=error)
            if out is not None:
                outputs.append(out)
        return outputs

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        outputs, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:  # ended by a stop string, or failed in output processing
            self.engine_core.abort_requests(to_abort)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished() or self.engine_core.has_requests()

    # -- views ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        cache = self.mm_processor.cache.stats
        return EngineStats.of(self.engine_core.scheduler.make_stats(), cache.hits, cache.misses)

    @property
    def encoder_runs(self) -> int:
        return self.engine_core.runner.encoder_runs

    def reset_caches(self) -> bool:
        """Forgets the prefix, encoder and processor caches (only when no request is running)."""
        if self.has_unfinished_requests():
            return False
        self.engine_core.reset_caches()
        self.mm_processor.cache.clear()
        return True
