"""What the chat, completion and embedding endpoints share: starting requests on the engine (bad
input answered with an HTTP error before anything streams, a client that hangs up ending
its request), waiting for their end, and streaming their outputs as server-sent events —
one request, or several at once (a completion with several prompts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from vlmserve.engine.async_llm import EngineDeadError, QueueFullError
from vlmserve.engine.input_processor import PromptInput
from vlmserve.engine.protocol import EngineClient
from vlmserve.entrypoints.openai.protocol import OpenAIError, SamplingRequest
from vlmserve.multimodal.decode_budget import MediaBusyError
from vlmserve.entrypoints.openai.responses import choice_usage, usage
from vlmserve.entrypoints.openai.serving_models import ServedModels
from vlmserve.lora.request import LoRARequest
from vlmserve.pooling_params import PoolingParams
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.sampling_params import ParamError, RequestOutputKind

logger = logging.getLogger(__name__)

SHUTDOWN_ERROR = "the server is shutting down; the request was cut off at the drain deadline"


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


@dataclass
class Started:
    """A request on the engine: its first output and the rest to come; `offset` is added
    to its choices' indices (the choices of a completion's later prompts follow the
    earlier ones')."""

    first: RequestOutput
    gen: AsyncIterator[RequestOutput]
    offset: int = 0
    last: RequestOutput | None = field(default=None)

    def __post_init__(self) -> None:
        self.last = self.first


# the choice of a streamed chunk: (the choice so far, its request's output, its new text,
# the index of its first new token, its global index)
ChunkShaper = Callable[[CompletionOutput, RequestOutput, str, int, int], dict[str, Any]]


_WRONG_TASK = {
    "generate": "this model generates text; start the server with --runner pooling to serve /v1/embeddings "
                "and /v1/score",
    "embed": "this model embeds (it runs with --runner pooling): ask /v1/embeddings or /v1/score, it generates "
             "no text",
    "score": "this model is a reranker (it runs with --runner pooling): ask /v1/score or /v1/rerank, it neither "
             "generates text nor embeds",
}


class ServingBase:
    tasks = ("generate",)  # what the model must do for this endpoint (the engine's task)

    def __init__(self, engine: EngineClient, models: ServedModels) -> None:
        self.engine = engine
        self.models = models
        self._ignored_fields_logged: set[str] = set()

    def check(self, req: SamplingRequest) -> LoRARequest | None:
        """The model it names (the adapter, None for the base model), and the fields it sent
        that are ignored (logged once per name)."""
        lora = self.models.resolve(req.model)
        task = self.engine.task
        if task not in self.tasks:
            raise OpenAIError(400, _WRONG_TASK[task], param="model")
        new = req.ignored_fields - self._ignored_fields_logged
        if new:
            self._ignored_fields_logged |= new
            logger.warning("The following fields were present in the request but ignored: %s", new)
        return lora

    def params(self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None, default_max: int | None,
               max_tokens_field: str = "max_tokens"):
        if max_tokens is not None and max_tokens > self.engine.max_model_len:
            raise OpenAIError(400, f"{max_tokens_field}={max_tokens} cannot be greater than max_model_len="
                              f"{self.engine.max_model_len}. Please request fewer output tokens.", param=max_tokens_field)
        try:
            params = req.sampling_params(max_tokens, logprobs, default_max, self.engine.sampling_defaults)
        except ParamError as e:
            raise OpenAIError(400, str(e), param=e.param) from None
        # a streamed answer takes every step's output; another only its last
        params.output_kind = RequestOutputKind.CUMULATIVE if req.stream else RequestOutputKind.FINAL_ONLY
        return params

    def truncation(self, req: SamplingRequest) -> int | None:
        """How many of the prompt's last tokens to keep (truncate_prompt_tokens), checked."""
        n = req.truncate_prompt_tokens
        if n is None:
            return None
        limit = self.engine.max_model_len
        if n > limit:
            raise OpenAIError(400, f"truncate_prompt_tokens={n} cannot be greater than max_model_len = {limit}. "
                              f"Please request a smaller truncation size.", param="truncate_prompt_tokens")
        return limit - 1 if n == -1 else n

    async def start(self, request_id: str, prompt: PromptInput, params, req: SamplingRequest,
                    request: Request, lora: LoRARequest | None = None,
                    pooling: PoolingParams | None = None) -> Started:
        """Starts generation and waits for its first output, so that bad input is answered
        with an HTTP error rather than inside a stream. A client that hangs up meanwhile
        (its grammar compiling, its pictures processed, the queue ahead of it) ends it."""
        gen = self.engine.generate(request_id, prompt, params, req.priority, req.cache_salt, lora, pooling)
        try:
            first = await _unless_gone(gen.__anext__(), request, gen)
        except ParamError as e:
            raise OpenAIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        except QueueFullError as e:
            raise OpenAIError(429, str(e)) from None
        except (EngineDeadError, MediaBusyError) as e:
            raise OpenAIError(503, str(e)) from None
        return Started(first, gen)

    async def start_all(self, request_id: str, prompts: list[PromptInput], params, req: SamplingRequest,
                        request: Request, lora: LoRARequest | None = None,
                        pooling: PoolingParams | None = None) -> list[Started]:
        """Several prompts at once (their choices numbered prompt by prompt); one refused
        refuses them all and ends the others."""
        asked, cap = len(prompts) * (params.n if params is not None else 1), self.engine.max_pending_requests
        if cap is not None and len(prompts) > 1 and asked > cap:  # could never be taken: said before any work
            raise OpenAIError(400, f"the request asks for {asked} completions (prompts x n), more than this server "
                                   f"runs at once ({cap}, --max-pending-requests); send it in parts")
        tasks = [asyncio.ensure_future(self.start(f"{request_id}-{i}" if len(prompts) > 1 else request_id, p,
                                                  params, req, request, lora, pooling))
                 for i, p in enumerate(prompts)]
        await asyncio.wait(tasks)
        failed = next((t.exception() for t in tasks if t.exception() is not None), None)
        if failed is not None:
            for t in tasks:
                if t.exception() is None:
                    await t.result().gen.aclose()
            raise failed
        started = [t.result() for t in tasks]
        for i, s in enumerate(started):
            s.offset = i * (params.n if params is not None else 1)
        return started

    async def final(self, started: list[Started], request: Request) -> list[RequestOutput]:
        """Runs requests to their end; a client that hangs up aborts them."""
        async def consume(s: Started) -> RequestOutput:
            async for out in s.gen:
                s.last = out
            return s.last

        pending = [s for s in started if not s.first.finished]
        if pending:
            try:
                await _unless_gone(asyncio.gather(*[consume(s) for s in pending]), request,
                                   *[s.gen for s in pending])
            except EngineDeadError as e:
                raise OpenAIError(503, str(e)) from None
        outs = [s.last for s in started]
        for out in outs:
            if out.error or any(c.finish_reason == "error" for c in out.outputs):
                raise output_error(out)
        return outs

    async def stream(self, started: list[Started], base: dict[str, Any], chunk: ChunkShaper,
                     include_usage: tuple[bool, bool], preamble: list[dict[str, Any]] = (),
                     usage_of: Callable[[list[RequestOutput]], dict[str, Any]] = usage) -> AsyncIterator[str]:
        """Server-sent events: the preamble's chunks (fields beside `base`), then a chunk
        per choice with new text or tokens (`chunk` shapes it; with continuous usage each
        carries its choice's usage), an error event if a request failed, the usage if
        asked, then [DONE]."""
        final_usage, continuous = include_usage
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        try:
            for fields in preamble:
                yield sse({**base, **fields})
            async for s, out in _merged(started):
                for c in out.outputs:
                    index = s.offset + c.index
                    if index in done:
                        continue
                    text = c.text[sent_text.get(index, 0):]
                    new_from = sent_tokens.get(index, 0)
                    if not text and len(c.token_ids) == new_from and c.finish_reason is None:
                        continue
                    sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(index)
                    body = {**base, "choices": [chunk(c, out, text, new_from, index)]}
                    if continuous:
                        body["usage"] = choice_usage(out, c)
                    yield sse(body)
            outs = [s.last for s in started]
            for out in outs:
                if out.error or any(c.finish_reason == "error" for c in out.outputs):
                    yield sse(output_error(out).body())
            if final_usage:
                yield sse({**base, "choices": [], "usage": usage_of(outs)})
            yield "data: [DONE]\n\n"
        except EngineDeadError as e:
            yield sse(OpenAIError(503, str(e)).body())
            yield "data: [DONE]\n\n"
        finally:
            for s in started:
                await s.gen.aclose()  # a client that hung up: aborts the requests


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def output_error(out: RequestOutput) -> OpenAIError:
    """A request the engine ended with an error: a fault (500) or the shutdown (503)."""
    message = out.error or "the request failed in the engine"
    return OpenAIError(503 if message == SHUTDOWN_ERROR else 500, message)


async def _merged(started: list[Started]) -> AsyncIterator[tuple[Started, RequestOutput]]:
    """Every request's outputs as they come, its first output first."""
    for s in started:
        yield s, s.first
    running = {asyncio.ensure_future(s.gen.__anext__()): s for s in started if not s.first.finished}
    try:
        while running:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                s = running.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                s.last = out
                yield s, out
                if not out.finished:
                    running[asyncio.ensure_future(s.gen.__anext__())] = s
    finally:
        for task in running:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _unless_gone(awaitable, request: Request, *gens: AsyncIterator[RequestOutput]):
    """Awaits while the client is connected; if it hangs up, the requests are aborted (their
    generators' own clean-up) and ClientGone raised."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            for gen in gens:
                with contextlib.suppress(BaseException):
                    await gen.aclose()
            raise ClientGone
