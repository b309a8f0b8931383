"""Offline inference: `LLM(model=...).generate(...)` / `.chat(...)`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence
from typing import Any

from vlmserve.allocator import GiveBackAfterWork
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.feeder import EngineFeeder
from vlmserve.engine.input_processor import PromptInput
from vlmserve.engine.llm_engine import LLMEngine
from vlmserve.engine.processing_pool import processing_pool
from vlmserve.entrypoints.scoring import ScoringPlan, score_pairs
from vlmserve.lora.request import LoRARequest
from vlmserve.outputs import EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput
from vlmserve.pooling_params import PoolingParams
from vlmserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Runs requests through the engine's continuous batching until all are done.

    `model` is a checkpoint folder; every other keyword is an `EngineArgs` field
    (max_num_seqs, max_num_batched_tokens, allowed_local_media_path, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()
        self._pool = processing_pool(self.engine.args.processing_threads, "vlmserve-media")
        self._memory = GiveBackAfterWork()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate/chat use when given no sampling params: vlmserve's defaults
        under the checkpoint's generation_config.json (unless generation_config="vlmserve")."""
        return self.engine.default_sampling_params()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | PromptInput | Sequence[str | dict | PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one per prompt (None: the base
        model); the engine needs enable_lora=True."""
        if isinstance(prompts, (str, dict, PromptInput)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, priority, lora_request)

    def embed(
        self,
        prompts: str | dict | PromptInput | Sequence[str | dict | PromptInput],
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (text, token ids, or with pictures as in `generate`), from
        a model that embeds (a sentence-transformers checkpoint, or runner="pooling")."""
        if isinstance(prompts, (str, dict, PromptInput)):
            prompts = [prompts]
        outputs = self._run(list(prompts), None, None, lora_request, pooling_params or PoolingParams())
        return [EmbeddingRequestOutput.of(out) for out in outputs]

    def score(
        self,
        data_1: str | dict | Sequence[str | dict],
        data_2: str | dict | Sequence[str | dict],
        instruction: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per (query, document) pair: one query against every document, or one
        query per document; each side a string or {"content": [parts]} with pictures. A
        reranker reads each pair in one prompt (`instruction` replaces its default task);
        an embedding model gives the cosine similarity of the two sides' vectors."""
        plan = ScoringPlan.of(self.engine.task, score_pairs(data_1, data_2), self.engine.render_chat, instruction)
        outputs = self._run(plan.prompts, None, None, lora_request, PoolingParams())
        return [ScoringRequestOutput("+".join(out.request_id for out in parts), ScoringOutput(score),
                                     [t for out in parts for t in out.prompt_token_ids],
                                     sum(out.num_cached_tokens for out in parts))
                for score, parts in plan.scored(outputs)]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several (a list of such lists)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            self.engine.render_chat(conv, add_generation_prompt, chat_template_kwargs)
            for conv in conversations
        ]
        return self._run(prompts, sampling_params, None, lora_request)

    def _run(self, prompts, sampling_params, priority, lora_request=None,
             pooling_params: PoolingParams | None = None) -> list[RequestOutput]:
        """Media processing runs in a thread pool while the engine steps: requests enter
        the batch as soon as their pictures are ready. A request that cannot be processed
        raises its error, and the others are aborted."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        # the calls return finished requests alone: no output is made for them step by step
        sampling_params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in sampling_params]
        loras = [lora_request] * len(prompts) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        for lora in set(loras) - {None}:
            self.engine.check_lora(lora)  # before any request starts
        engine = self.engine
        ids = [str(next(self._ids)) for _ in prompts]
        feeder = EngineFeeder(engine, self._pool)
        for i, (rid, prompt, params, lora) in enumerate(zip(ids, prompts, sampling_params, loras)):
            feeder.submit(rid, functools.partial(engine.process_request, rid, prompt, params,
                                                 priority[i] if priority else 0, lora_request=lora,
                                                 pooling_params=pooling_params))
        finished: dict[str, RequestOutput] = {}
        start = time.monotonic()
        try:
            while feeder.pending():
                outputs, failed = feeder.step()
                if failed:
                    raise failed[0][1]
                finished.update((out.request_id, out) for out in outputs)
        except BaseException:
            feeder.abort_all()  # a rejected prompt leaves nothing behind
            raise
        finally:
            self._memory.call_ended(time.monotonic() - start)
        return [finished[rid] for rid in ids]
