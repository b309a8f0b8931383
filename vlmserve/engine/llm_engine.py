"""The engine every entry point drives: requests in, RequestOutputs out, one step at a time."""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from vlmserve.core.kv_cache_utils import BlockHasher
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.chat import render_chat
from vlmserve.engine.chat_template import ChatTemplate
from vlmserve.engine.core_client import InProcessCore, ProcessCore
from vlmserve.engine.engine_core import EngineCore
from vlmserve.engine.input_processor import InputProcessor, PromptInput
from vlmserve.engine.model_source import classifier_token_ids, resolve_model_path, resolve_pooler, sampling_defaults
from vlmserve.engine.output_processor import OutputProcessor
from vlmserve.errors import ConfigError
from vlmserve.phase_timer import PhaseTimer
from vlmserve.metrics import EngineStats
from vlmserve.lora.adapter import LoRAAdapter, LoRAError, read_adapter
from vlmserve.lora.request import LoRARequest
from vlmserve.models import get_model_class
from vlmserve.multimodal.media import MediaLoader
from vlmserve.multimodal.processor import MultiModalProcessor
from vlmserve.outputs import RequestOutput
from vlmserve.pooling_params import PoolingParams
from vlmserve.request import Request
from vlmserve.reasoning.parsers import ReasoningParser, reasoning_parser
from vlmserve.sampling_params import ParamError, SamplingParams
from vlmserve.structured_output.compiler import CompiledSpec, GrammarCompiler
from vlmserve.structured_output.manager import tokenizer_info_of
from vlmserve.structured_output.schema import check_spec

logger = logging.getLogger(__name__)

# an embedding request computes its prompt and samples nothing: these settings stand in
EMBEDDING_SAMPLING = SamplingParams(max_tokens=1)

@dataclass
class ProcessedRequest:
    request_id: str
    prompt: str | None
    params: SamplingParams
    request: Request  # the first sample's; the others are cloned from it
    grammar: CompiledSpec | None = None  # set once compiled, for a request with structured output


class LLMEngine:
    """The front end of an engine: input processing (tokens, media), the samples of a
    request, output processing (detokenizing, stop strings), over an engine core that
    runs in this process or, with `args.engine_process`, in a process of its own."""

    def __init__(self, args: EngineArgs) -> None:
        start = time.perf_counter()
        args.check_device()
        args.check_settings()  # before anything is loaded
        self.args = args
        self.chat_template = ChatTemplate.of(args.chat_template, args.chat_template_content_format)
        self.model_path = resolve_model_path(args.model, args.revision, args.download_dir)
        self.sampling_defaults = sampling_defaults(self.model_path) if args.generation_config == "auto" else {}
        if self.sampling_defaults:
            logger.info("sampling defaults from the checkpoint's generation_config.json: %s "
                        "(--generation-config vlmserve ignores them)", self.sampling_defaults)
        hf_config = AutoConfig.from_pretrained(self.model_path)
        args.check_quantization(hf_config)
        self.hf_config = hf_config
        self.model_cls = get_model_class(getattr(hf_config, "architectures", None) or [])
        self.pooler = resolve_pooler(args.runner, args.pooler_config, self.model_path)  # None: it generates
        self.hidden_size = getattr(hf_config, "text_config", hf_config).hidden_size
        media_loader = MediaLoader(args.media_limits())
        self.vocab_size = getattr(hf_config, "text_config", hf_config).vocab_size
        eos_ids = self._eos_token_ids(hf_config)
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.extra_eos_ids = eos_ids[1:]

        self.timer = PhaseTimer(args.time_steps)
        if args.engine_process:
            # the front end's own tensor work (media processing) is small: one thread, so
            # that no pool of OpenMP threads spins beside the core's on the same cores
            torch.set_num_threads(1)
        core_cls = ProcessCore if args.engine_process else InProcessCore
        self.core = core_cls(args, self.model_path, self.eos_token_id, self.timer)
        info = self.core.info
        # pictures kept in the model's dtype: its vision tower casts them first, and in bf16
        # 32 waiting requests' pictures take half the memory (69,900 patches: 329 -> 165 MB)
        self.mm_processor = MultiModalProcessor(self.model_path, hf_config, media_loader,
                                                int(args.processor_cache_gb * (1 << 30)), getattr(torch, info.dtype))
        self.tokenizer = self.mm_processor.hf_processor.tokenizer
        self.reasoning: ReasoningParser | None = None  # --reasoning-parser's, for this tokenizer
        if args.reasoning_parser:
            try:
                self.reasoning = reasoning_parser(args.reasoning_parser, self.tokenizer)
            except ValueError as e:
                self.core.shutdown()
                raise ConfigError(str(e)) from None
        self.score_token_ids = classifier_token_ids(self.tokenizer, self.pooler.classifier_from_token) \
            if self.pooler and self.pooler.classifier_from_token else None
        self.max_model_len = info.max_model_len
        self.lora_targets = info.lora_targets
        self._checked_loras: dict[LoRARequest, LoRAAdapter] = {}
        self.input_processor = self._input_processor(hf_config, info)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.grammar_limits = args.grammar_limits()
        self.grammars = GrammarCompiler(lambda: tokenizer_info_of(self.tokenizer, self.vocab_size),
                                        args.grammar_compile_workers, args.grammar_compile_timeout)
        self.startup_seconds = time.perf_counter() - start
        logger.info(
            "engine ready in %.2fs (%s, %s): %d KV blocks of %d tokens, %d KV cache group(s), max_model_len %d",
            self.startup_seconds, info.dtype, "engine core in a process of its own" if args.engine_process
            else "engine core in this process", info.num_kv_blocks, args.block_size, info.num_kv_cache_groups,
            info.max_model_len,
        )

    @property
    def engine_core(self) -> EngineCore:
        """The engine core itself, when it runs in this process."""
        if not isinstance(self.core, InProcessCore):
            raise AttributeError("the engine core runs in a process of its own")
        return self.core.core

    def shutdown(self) -> None:
        self.grammars.shutdown()
        self.core.shutdown()

    # -- setup helpers -------------------------------------------------------------------
    def _input_processor(self, hf_config, info) -> InputProcessor:
        args = self.args
        model_cls = self.model_cls
        max_media_tokens = min(args.encoder_compute_budget, args.encoder_cache_size)
        if getattr(model_cls, "bidirectional_media", False):  # a picture's tokens go in one step
            max_media_tokens = min(max_media_tokens, info.max_chunk_tokens)
        return InputProcessor(
            tokenizer=self.tokenizer,
            mm_processor=self.mm_processor,
            model_cls=model_cls,
            hf_config=hf_config,
            max_model_len=info.max_model_len,
            eos_token_id=self.eos_token_id,
            block_hasher=BlockHasher(args.block_size),
            max_media_tokens=max_media_tokens,
            block_size=args.block_size,
            limit_mm_per_prompt=dict(args.limit_mm_per_prompt),
            default_mm_kwargs=args.mm_processor_kwargs,
        )

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
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> ProcessedRequest:
        """Validates and processes a request (media included, its grammar compiled); raises
        ValueError on bad input. Thread-safe and independent of the step loop: run it in a
        worker pool. With pooling_params it is an embedding request (sampling params unused)."""
        if pooling_params is not None:
            params = EMBEDDING_SAMPLING
        params = self.check_params(params or self.default_sampling_params())
        grammar = self.compile_grammar(params)
        processed = self.process_inputs(request_id, prompt, params, priority, cache_salt, arrival_time, lora_request,
                                        pooling_params)
        if grammar is not None:
            processed.grammar = grammar.result()
        return processed

    def process_inputs(self, request_id: str, prompt: str | dict | PromptInput, params: SamplingParams,
                       priority: int = 0, cache_salt: str | None = None,
                       arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                       pooling_params: PoolingParams | None = None) -> ProcessedRequest:
        """The prompt's tokens and media (params already checked); the grammar is left to
        `compile_grammar`. Thread-safe."""
        arrival_time = arrival_time or time.time()
        pooling_params = self.check_pooling(pooling_params)
        adapts_vision = lora_request is not None and self.check_lora(lora_request).touches_vision
        if self.extra_eos_ids and not params.ignore_eos:
            params = params.with_stop_token_ids(self.extra_eos_ids)
        request = self.input_processor.process(request_id, prompt, params.for_child(0), arrival_time, priority,
                                               cache_salt, lora_request, adapts_vision, pooling_params)
        if self.reasoning is not None and (params.structured_outputs is not None
                                           or params.thinking_token_budget is not None):
            # the core starts the grammar after the reasoning, and closes it when the budget is spent
            request.reasoning = self.reasoning.bounds(request.prompt_token_ids, params.thinking_token_budget)
        return ProcessedRequest(request_id, PromptInput.parse(prompt).prompt, params, request)

    @property
    def task(self) -> str:
        """What its requests give: "generate" (text), "embed" (a vector) or "score" (a
        reranker's relevance score)."""
        return "generate" if self.pooler is None else self.pooler.task

    def check_pooling(self, pooling_params: PoolingParams | None) -> PoolingParams | None:
        """A pooling request on a model that pools, a generation request on one that
        generates (ValueError otherwise); the request's pooling settings filled in."""
        if self.pooler is None:
            if pooling_params is not None:
                raise ValueError("this model generates text; it embeds when started with --runner pooling")
            return None
        if pooling_params is None:
            ask = "/v1/embeddings (LLM.embed)" if self.task == "embed" else "/v1/score or /v1/rerank (LLM.score)"
            raise ValueError(f"this model {self.task}s (it runs with --runner pooling): ask {ask}, "
                             f"not for generated text")
        pooling_params.verify(self.hidden_size)
        return pooling_params.resolved(self.pooler, self.score_token_ids)

    def check_lora(self, lora: LoRARequest) -> LoRAAdapter:
        """An adapter this engine can serve (its shapes; read once per adapter), or
        LoRAError saying why not."""
        checked = self._checked_loras.get(lora)
        if checked is None:
            if self.lora_targets is None:
                raise LoRAError(f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is off: start the engine with "
                                f"--enable-lora (LLM(enable_lora=True))")
            checked = read_adapter(lora.lora_path, self.lora_targets, self.args.max_lora_rank,
                                   self.model_cls.canonical_name, weights=False)
            self._checked_loras[lora] = checked
        return checked

    def compile_grammar(self, params: SamplingParams) -> Future | None:
        """A future of the compiled grammar of a request with structured output (compiled in
        worker processes, cached by spec); ParamError from it if the grammar is refused."""
        if params.structured_outputs is None:
            return None
        return self.grammars.compile(params.structured_outputs)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False) -> PromptInput:
        """OpenAI-style chat messages (and tools) as a prompt, by the checkpoint's chat
        template (ValueError for messages it cannot take)."""
        return render_chat(self.mm_processor.hf_processor, messages, add_generation_prompt, chat_template_kwargs,
                           tools, continue_final_message, self.chat_template)

    def default_sampling_params(self) -> SamplingParams:
        """vlmserve's defaults under the checkpoint's own (generation_config.json)."""
        return SamplingParams(**self.sampling_defaults)

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """The model's checks of a request's sampling parameters (ParamError if bad): ids in
        the vocabulary, a structured-output spec within the limits and made only of what the
        grammar engine enforces; returns them with the spec normalised and bad words
        tokenized. Cheap (linear in the request's size): safe on an event loop."""
        params.verify(self.vocab_size, self.args.max_n)
        if params.thinking_token_budget is not None and self.reasoning is None:
            raise ParamError("thinking_token_budget", "thinking_token_budget needs a server started with "
                             "--reasoning-parser (the token that closes the reasoning is the parser's)")
        if params.structured_outputs is not None:
            params = replace(params, structured_outputs=check_spec(params.structured_outputs, self.grammar_limits))
        if params.bad_words:
            params = replace(params, bad_words_token_ids=self._bad_word_ids(params.bad_words))
        return params

    def _bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as the tokenizer writes it alone and after a space, as vLLM does."""
        found: list[list[int]] = []
        for word in words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    def add_processed(self, processed: ProcessedRequest) -> None:
        """Queues a processed request (on the thread that steps the engine)."""
        rid = processed.request_id
        if rid in self.output_processor.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        first = processed.request
        if processed.params.structured_outputs is not None and processed.grammar is None:
            raise ValueError(f"request {rid!r} asks for structured output, but its grammar was not compiled")
        first.compiled_grammar = processed.grammar
        child_ids = self.output_processor.add_request(
            rid, processed.prompt, first.prompt_token_ids, processed.params, first.arrival_time
        )
        try:
            for i, child_id in enumerate(child_ids):
                # the samples share the processed prompt; only their ids and seeds differ
                request = first if i == 0 else first.clone_as(child_id, processed.params.for_child(i))
                request.request_id = child_id
                self.core.add_request(request)
        except Exception:  # refused by the core (an adapter that cannot be read): nothing of it stays
            self.abort_request(rid)
            raise

    def add_request(self, request_id: str, prompt: str | dict | PromptInput, params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None, pooling_params: PoolingParams | None = None) -> None:
        self.add_processed(self.process_request(request_id, prompt, params, priority, cache_salt, arrival_time,
                                                lora_request, pooling_params))

    def abort_request(self, request_ids: str | list[str], error: str | None = None) -> list[RequestOutput]:
        """Ends requests (finish reason "abort"; `error` says why, if not the caller's
        choice) and frees everything they hold."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            self.core.abort_requests(self.output_processor.child_ids(rid))
            out = self.output_processor.abort_request(rid, error=error)
            if out is not None:
                outputs.append(out)
        return outputs

    def step(self, wake: socket.socket | None = None) -> list[RequestOutput]:
        """One step of an engine core in this process; with a core in a process of its
        own, its next outputs (or none, if `wake` became readable first)."""
        start = time.perf_counter()
        core_outputs = self.core.step(wake)
        with self.timer.phase("output processing"):
            outputs, to_abort = self.output_processor.process_outputs(core_outputs)
            if to_abort:  # ended by a stop string, or failed in output processing
                self.core.abort_requests(to_abort)
        if self.timer.enabled:
            self.timer.seconds["step (all)"] += time.perf_counter() - start
            self.timer.steps += 1
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished() or self.core.has_requests()

    # -- views ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        cache = self.mm_processor.cache.stats
        return EngineStats.of(self.core.stats(), cache.hits, cache.misses)

    def reset_caches(self) -> bool:
        """Forgets the prefix, encoder and processor caches (only when no request is running)."""
        if self.has_unfinished_requests() or not self.core.reset_caches():
            return False
        self.mm_processor.cache.clear()
        return True
