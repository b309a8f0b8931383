"""OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models,
/health, /version, /metrics — FastAPI on uvicorn, over the AsyncLLM engine."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from vlmserve import __version__
from vlmserve.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from vlmserve.engine.input_processor import PromptInput
from vlmserve.entrypoints.chat_utils import render_chat
from vlmserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, SamplingRequest
from vlmserve.metrics import EngineMetrics
from vlmserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


class OpenAIServer:
    def __init__(self, engine: AsyncLLM, served_model_name: str, api_key: str | None = None,
                 max_request_bytes: int = 64 << 20, drain_timeout: float = 30.0) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.drain_timeout = drain_timeout
        self.tokenizer = engine.engine.tokenizer
        self.metrics = EngineMetrics()
        engine.step_listeners.append(self.metrics.on_step)
        self.created = int(time.time())

    # -- app -------------------------------------------------------------------------------------
    def build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            yield
            # shutting down (Ctrl-C / SIGTERM): let in-flight requests finish, then stop the engine
            await asyncio.get_running_loop().run_in_executor(None, self.engine.wait_idle, self.drain_timeout)
            self.engine.shutdown()

        app = FastAPI(title="vlmserve", version=__version__, lifespan=lifespan)

        @app.exception_handler(OpenAIError)
        async def openai_error(request: Request, exc: OpenAIError):
            return JSONResponse(exc.body(), status_code=exc.status)

        @app.exception_handler(Exception)
        async def internal_error(request: Request, exc: Exception):
            logger.exception("unhandled error on %s", request.url.path)
            return JSONResponse(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

        # a dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps the
        # connection so that the endpoint never sees a client hang up
        async def check_key(request: Request) -> None:
            if self.api_key and request.headers.get("authorization", "") != f"Bearer {self.api_key}":
                raise OpenAIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                  code="invalid_api_key")

        keyed = [Depends(check_key)]
        app.get("/health")(self.health)
        app.get("/version")(lambda: {"version": __version__})
        app.get("/metrics")(self.metrics_endpoint)
        app.get("/v1/models", dependencies=keyed)(self.models)
        app.post("/v1/chat/completions", dependencies=keyed)(self.chat_completions)
        app.post("/v1/completions", dependencies=keyed)(self.completions)
        return app

    async def health(self):
        if not self.engine.is_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    async def metrics_endpoint(self):
        engine = self.engine.engine
        kinds = [type(g.spec).__name__ for g in engine.engine_core.scheduler.kv_cache_manager.config.groups]
        cache = engine.mm_processor.cache.stats
        text = self.metrics.render(self.engine.stats, kinds, cache.hits, cache.misses)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def models(self):
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "vlmserve",
            "max_model_len": self.engine.engine.scheduler_config.max_model_len,
        }]}

    # -- shared request handling ---------------------------------------------------------------------
    async def _body(self, request: Request, model_cls):
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_request_bytes:
            raise OpenAIError(413, f"request body is {declared} bytes, over the {self.max_request_bytes}-byte limit")
        raw = await request.body()
        if len(raw) > self.max_request_bytes:
            raise OpenAIError(413, f"request body is over the {self.max_request_bytes}-byte limit")
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            raise OpenAIError(400, f"request body is not valid JSON: {e}") from None
        try:
            parsed = model_cls.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise OpenAIError(400, f"{where}: {first['msg']}", param=where) from None
        if parsed.model is not None and parsed.model != self.model_name:
            raise OpenAIError(404, f"the model {parsed.model!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")
        return parsed

    def _params(self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None):
        try:
            return req.sampling_params(max_tokens, logprobs, default_max=None)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None

    async def _start(self, request_id: str, prompt: PromptInput, params, req: SamplingRequest):
        """Starts generation and waits for its first output, so that bad input is answered
        with an HTTP error rather than inside a stream."""
        gen = self.engine.generate(request_id, prompt, params, req.priority, req.cache_salt)
        try:
            first = await gen.__anext__()
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        except QueueFullError as e:
            raise OpenAIError(429, str(e)) from None
        except EngineDeadError as e:
            raise OpenAIError(503, str(e)) from None
        return first, gen

    async def _final(self, first: RequestOutput, gen: AsyncIterator[RequestOutput], request: Request) -> RequestOutput:
        """Runs a non-streamed request to its end; a client that hangs up aborts it."""
        async def consume():
            last = first
            async for out in gen:
                last = out
            return last

        task = asyncio.ensure_future(consume()) if not first.finished else None
        if task is None:
            final = first
        else:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if not done and await request.is_disconnected():
                    task.cancel()
                    await gen.aclose()
                    raise OpenAIError(400, "client disconnected")
            final = task.result()
        if final.error or any(c.finish_reason == "error" for c in final.outputs):
            raise OpenAIError(500, final.error or "the request failed in the engine")
        return final

    @staticmethod
    def _usage(out: RequestOutput) -> dict[str, Any]:
        completion = sum(len(c.token_ids) for c in out.outputs)
        usage = {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": completion,
                 "total_tokens": out.num_prompt_tokens + completion,
                 "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
        if out.media_stats:  # vlmserve extension: where each picture's embeddings came from
            usage["media"] = out.media_stats
        return usage

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_logprobs(self, entries) -> dict[str, Any]:
        content = []
        for e in entries:
            tok = self._token_text(e.token_ids[0])
            top = [{"token": self._token_text(t), "logprob": lp, "bytes": list(self._token_text(t).encode())}
                   for t, lp in zip(e.token_ids[1:], e.logprobs[1:])]
            content.append({"token": tok, "logprob": e.logprobs[0], "bytes": list(tok.encode()), "top_logprobs": top})
        return {"content": content}

    def _completion_logprobs(self, entries, text_start: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets, pos = [], [], [], [], text_start
        for e in entries:
            tok = self._token_text(e.token_ids[0])
            tokens.append(tok)
            token_lps.append(e.logprobs[0])
            tops.append({self._token_text(t): lp for t, lp in zip(e.token_ids[1:], e.logprobs[1:])})
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    # -- /v1/chat/completions ---------------------------------------------------------------------------
    async def chat_completions(self, request: Request):
        req: ChatCompletionRequest = await self._body(request, ChatCompletionRequest)
        try:
            prompt = render_chat(self.engine.engine.mm_processor.hf_processor, req.messages,
                                 req.add_generation_prompt, req.chat_template_kwargs)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        prompt.mm_processor_kwargs = dict(req.mm_processor_kwargs or {})
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, req.max_completion_tokens or req.max_tokens, logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        first, gen = await self._start(request_id, prompt, params, req)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._chat_stream(request_id, first, gen, include_usage),
                                     media_type="text/event-stream")
        final = await self._final(first, gen, request)
        choices = []
        for c in final.outputs:
            choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                      "finish_reason": c.finish_reason, "logprobs": None}
            if c.logprobs is not None:
                choice["logprobs"] = self._chat_logprobs(c.logprobs)
            choices.append(choice)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage(final)}

    async def _chat_stream(self, request_id, first, gen, include_usage) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model_name}
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        for c in first.outputs:
            yield self._sse({**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                  "finish_reason": None, "logprobs": None}]})
        try:
            last = out = first
            while True:
                last = out
                for c in out.outputs:
                    if c.index in done:
                        continue
                    text_delta = c.text[sent_text.get(c.index, 0):]
                    new_from = sent_tokens.get(c.index, 0)
                    if not text_delta and len(c.token_ids) == new_from and c.finish_reason is None:
                        continue
                    choice = {"index": c.index, "delta": {"content": text_delta} if text_delta else {},
                              "finish_reason": c.finish_reason, "logprobs": None}
                    if c.logprobs is not None and len(c.token_ids) > new_from:
                        choice["logprobs"] = self._chat_logprobs(c.logprobs[new_from:])
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(c.index)
                    yield self._sse({**base, "choices": [choice]})
                if out.finished:
                    break
                out = await gen.__anext__()
            if any(c.finish_reason == "error" for c in last.outputs):
                err = OpenAIError(500, last.error or "the request failed in the engine")
                yield self._sse(err.body())
            if include_usage:
                yield self._sse({**base, "choices": [], "usage": self._usage(last)})
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()  # a client that hung up: aborts the request

    # -- /v1/completions ------------------------------------------------------------------------------------
    async def completions(self, request: Request):
        req: CompletionRequest = await self._body(request, CompletionRequest)
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
            prompt = PromptInput(prompt_token_ids=list(req.prompt))
        elif isinstance(req.prompt, list):
            if len(req.prompt) != 1:
                raise OpenAIError(400, "send one prompt per request (a list of several is not supported)", param="prompt")
            prompt = PromptInput(prompt=req.prompt[0])
        else:
            prompt = PromptInput(prompt=req.prompt)
        prompt.mm_processor_kwargs = dict(req.mm_processor_kwargs or {})
        params = self._params(req, req.max_tokens or 16, req.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        first, gen = await self._start(request_id, prompt, params, req)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._completion_stream(request_id, first, gen, include_usage),
                                     media_type="text/event-stream")
        final = await self._final(first, gen, request)
        choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": None if c.logprobs is None else self._completion_logprobs(c.logprobs, 0)}
                   for c in final.outputs]
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage(final)}

    async def _completion_stream(self, request_id, first, gen, include_usage) -> AsyncIterator[str]:
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        sent: dict[int, int] = {}
        done: set[int] = set()
        try:
            out = first
            while True:
                for c in out.outputs:
                    if c.index in done:
                        continue
                    delta = c.text[sent.get(c.index, 0):]
                    if delta or c.finish_reason:
                        yield self._sse({**base, "choices": [{"index": c.index, "text": delta,
                                                             "finish_reason": c.finish_reason, "logprobs": None}]})
                        sent[c.index] = len(c.text)
                        if c.finish_reason:
                            done.add(c.index)
                if out.finished:
                    break
                out = await gen.__anext__()
            if include_usage:
                yield self._sse({**base, "choices": [], "usage": self._usage(out)})
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()


def run_server(args) -> None:
    """`vlmserve serve`: builds the engine, then serves until Ctrl-C / SIGTERM."""
    import uvicorn

    from vlmserve.entrypoints.cli import engine_args_from

    engine = AsyncLLM(engine_args_from(args), max_pending_requests=args.max_pending_requests)
    name = args.served_model_name or _default_name(engine.engine.model_path)
    server = OpenAIServer(engine, name, api_key=args.api_key, max_request_bytes=args.max_request_mb << 20)
    logger.info("serving %s on http://%s:%d/v1", name, args.host, args.port)
    uvicorn.run(server.build_app(), host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=30)


def _default_name(path: str) -> str:
    from pathlib import Path

    return Path(path).name
