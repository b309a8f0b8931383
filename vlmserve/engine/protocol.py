"""What the entry points (the OpenAI server, the chat UI) need of an engine: one small
interface that an engine in this process (`AsyncLLM`) and replicas on Ray Serve
(`replicas.ReplicaPool`) both implement, so a server never reaches inside either."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from vlmserve.engine.input_processor import PromptInput
from vlmserve.lora.request import LoRARequest
from vlmserve.outputs import RequestOutput
from vlmserve.pooling_params import PoolingParams
from vlmserve.reasoning.parsers import ReasoningParser
from vlmserve.sampling_params import SamplingParams


class MetricsSource(Protocol):
    def render(self) -> bytes:
        """The Prometheus text of /metrics."""


class EngineClient(Protocol):
    model_path: str  # the checkpoint folder
    max_model_len: int  # the context length
    task: str  # "generate", or a pooling runner's "embed" (vectors) or "score" (a reranker's scores)
    sampling_defaults: dict[str, Any]  # the checkpoint's generation_config.json settings (unless turned off)
    metrics: MetricsSource
    max_pending_requests: int | None  # completions in flight at most (None: no one cap, as for replicas)
    death_listeners: list[Callable[[BaseException], None]]  # called if the engine stops for good
    reasoning: ReasoningParser | None  # --reasoning-parser's (None: an answer is all content)

    @property
    def tokenizer(self) -> Any: ...

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False) -> PromptInput:
        """Chat messages (and tools) as a prompt, by the checkpoint's template."""

    async def prompt_token_ids(self, prompt: PromptInput) -> list[int]:
        """The tokens a prompt becomes, its pictures and videos expanded (/tokenize)."""

    def generate(self, request_id: str, prompt: PromptInput, params: SamplingParams, priority: int = 0,
                 cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                 pooling_params: PoolingParams | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they improve (the last one finished; an embedding
        request's carries its vector); ValueError (or ParamError) for bad input before the
        first; closing the iterator aborts it."""

    def check_lora(self, lora: LoRARequest) -> None:
        """LoRAError (a ValueError) if the engine cannot serve the adapter (LoRA off, a
        layer the model lacks, a rank over the limit, ...)."""

    def abort(self, request_id: str) -> None: ...

    def abort_all(self, error: str) -> None:
        """Ends every request in flight with this error (a shutdown's drain deadline)."""

    def is_alive(self) -> bool: ...

    def shutdown(self) -> None: ...
