"""OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models,
/health, /version, /metrics — FastAPI on uvicorn, over the AsyncLLM engine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmserve import __version__
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from vlmserve.engine.input_processor import PromptInput
from vlmserve.engine.model_source import served_name
from vlmserve.engine.protocol import EngineClient
from vlmserve.entrypoints.openai import tool_calls
from vlmserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, SamplingRequest
from vlmserve.metrics import CONTENT_TYPE
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.sampling_params import ParamError

logger = logging.getLogger(__name__)

SHUTDOWN_ERROR = "the server is shutting down; the request was cut off at the drain deadline"


class ClientGone(Exception):
    """The client hung up before its answer was ready."""


class OpenAIServer:
    def __init__(self, engine: EngineClient, served_model_name: str, api_key: str | None = None) -> None:
        """engine: an AsyncLLM, or replicas on Ray Serve (replicas.ReplicaPool)."""
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())

    # -- app -------------------------------------------------------------------------------------
    def build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app: FastAPI):
            yield
            self.engine.shutdown()  # uvicorn has drained the requests in flight

        app = FastAPI(title="vlmserve", version=__version__, lifespan=lifespan)
        app.exception_handler(OpenAIError)(self._openai_error)
        app.exception_handler(RequestValidationError)(self._validation_error)
        app.exception_handler(StarletteHTTPException)(self._http_error)
        app.exception_handler(ClientGone)(self._client_gone)
        app.exception_handler(Exception)(self._internal_error)

        keyed = [Depends(self._check_key)]
        app.get("/health")(self.health)
        app.get("/version")(lambda: {"version": __version__})
        app.get("/metrics")(self.metrics_endpoint)
        app.get("/v1/models", dependencies=keyed)(self.models)
        app.post("/v1/chat/completions", dependencies=keyed)(self.chat_completions)
        app.post("/v1/completions", dependencies=keyed)(self.completions)
        return app

    # -- errors, all in OpenAI's format ------------------------------------------------------------
    @staticmethod
    async def _openai_error(request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @staticmethod
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        loc = [str(x) for x in first["loc"] if x != "body"]
        where = ".".join(loc)
        if first["type"] == "json_invalid":
            message = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        elif not loc:
            message = f"the request body must be a JSON object ({first['msg']})"
        else:
            message = f"{where}: {first['msg']}"
        return JSONResponse(OpenAIError(400, message, param=where or None).body(), status_code=400)

    @staticmethod
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
            message[400] = f"request body is not valid JSON: {type(exc.__cause__).__name__}: {exc.__cause__}"
        body = OpenAIError(exc.status_code, message.get(exc.status_code, str(exc.detail))).body()
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @staticmethod
    async def _client_gone(request: Request, exc: ClientGone):
        logger.info("client hung up on %s; its request was aborted", request.url.path)
        return Response(status_code=499)  # nobody reads it

    @staticmethod
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

    # a dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware wraps the
    # connection so that the endpoint never sees a client hang up
    async def _check_key(self, request: Request) -> None:
        if not self.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise OpenAIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                              code="invalid_api_key")

    # -- small routes ----------------------------------------------------------------------------
    async def health(self):
        if not self.engine.is_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    async def metrics_endpoint(self):
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self):
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "vlmserve",
            "max_model_len": self.engine.max_model_len,
        }]}

    # -- shared request handling ---------------------------------------------------------------------
    def _check_model(self, req: SamplingRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise OpenAIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")

    def _params(self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None, default_max: int | None):
        try:
            return req.sampling_params(max_tokens, logprobs, default_max, self.engine.sampling_defaults)
        except ParamError as e:
            raise OpenAIError(400, str(e), param=e.param) from None

    async def _start(self, request_id: str, prompt: PromptInput, params, req: SamplingRequest, request: Request):
        """Starts generation and waits for its first output, so that bad input is answered
        with an HTTP error rather than inside a stream. A client that hangs up meanwhile
        (its grammar compiling, its pictures processed, the queue ahead of it) ends it."""
        gen = self.engine.generate(request_id, prompt, params, req.priority, req.cache_salt)
        try:
            first = await _unless_gone(gen.__anext__(), request, gen)
        except ParamError as e:
            raise OpenAIError(400, str(e), param=e.param) from None
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

        final = first
        if not first.finished:
            try:
                final = await _unless_gone(consume(), request, gen)
            except EngineDeadError as e:
                raise OpenAIError(503, str(e)) from None
        if final.error or any(c.finish_reason == "error" for c in final.outputs):
            raise _output_error(final)
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

    async def _stream(self, first: RequestOutput, gen: AsyncIterator[RequestOutput], base: dict[str, Any],
                      include_usage: bool, choice: Callable[[CompletionOutput, str, int], dict[str, Any]],
                      preamble: list[dict[str, Any]] = ()) -> AsyncIterator[str]:
        """Server-sent events of one request, chat or completion: a chunk per choice with
        new text or tokens (`choice(output, new_text, first_new_token)` shapes it), an error
        event if the request failed, the usage if asked, then [DONE]."""
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        try:
            for chunk in preamble:
                yield self._sse({**base, "choices": [chunk]})
            out = first
            while True:
                for c in out.outputs:
                    if c.index in done:
                        continue
                    text = c.text[sent_text.get(c.index, 0):]
                    new_from = sent_tokens.get(c.index, 0)
                    if not text and len(c.token_ids) == new_from and c.finish_reason is None:
                        continue
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    if c.finish_reason is not None:
                        done.add(c.index)
                    yield self._sse({**base, "choices": [choice(c, text, new_from)]})
                if out.finished:
                    break
                try:
                    out = await gen.__anext__()
                except EngineDeadError as e:
                    yield self._sse(OpenAIError(503, str(e)).body())
                    break
            if out.error or any(c.finish_reason == "error" for c in out.outputs):
                yield self._sse(_output_error(out).body())
            if include_usage:
                yield self._sse({**base, "choices": [], "usage": self._usage(out)})
            yield "data: [DONE]\n\n"
        finally:
            await gen.aclose()  # a client that hung up: aborts the request

    # -- /v1/chat/completions ---------------------------------------------------------------------------
    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        self._check_model(req)
        prompt, params = self._chat_request(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        first, gen = await self._start(request_id, prompt, params, req, request)
        if req.stream:
            base = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": self.model_name}
            roles = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                      "logprobs": None} for c in first.outputs]
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(first, gen, base, include_usage, self._chat_chunker(req), roles),
                                     media_type="text/event-stream")
        final = await self._final(first, gen, request)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": [self._chat_choice(req, c) for c in final.outputs], "usage": self._usage(final)}

    def _chat_request(self, req: ChatCompletionRequest) -> tuple[PromptInput, Any]:
        """The prompt (the chat template's rendering, tools included) and the sampling
        params (a forced tool call's grammar among them) of a chat request."""
        tools = tool_calls.template_tools(req.tools) if req.uses_tools else None
        try:
            tool_calls.check_tools(req.tools or [])
        except ParamError as e:
            raise OpenAIError(400, str(e), param=e.param) from None
        try:
            prompt = self.engine.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        prompt.mm_processor_kwargs = dict(req.mm_processor_kwargs or {})
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self._params(req, max_tokens, logprobs, default_max=None)
        if req.uses_tools:
            forced = tool_calls.constraint(req.tools, req.tool_choice)
            if forced is not None and params.structured_outputs is not None:
                raise OpenAIError(400, "a required or named tool_choice cannot be combined with response_format",
                                  param="tool_choice")
            params = dataclasses.replace(params, structured_outputs=forced or params.structured_outputs)
        return prompt, params

    def _chat_choice(self, req: ChatCompletionRequest, c: CompletionOutput) -> dict[str, Any]:
        """A finished choice as a chat message (its tool calls parsed out of the text)."""
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason
        if req.uses_tools:
            content, calls = tool_calls.parse(c.text)
            if calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": [call.message() for call in calls]}
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"index": c.index, "message": message, "finish_reason": finish_reason,
                "logprobs": None if c.logprobs is None else self._chat_logprobs(c.logprobs)}

    def _chat_chunker(self, req: ChatCompletionRequest) -> Callable[[CompletionOutput, str, int], dict[str, Any]]:
        """Shapes each streamed chat chunk: new content, or a tool call once its block closes."""
        tool_streams: dict[int, tool_calls.ToolCallStream] = {}

        def chunk(c: CompletionOutput, text: str, new_from: int) -> dict[str, Any]:
            logprobs = None
            if c.logprobs is not None and len(c.token_ids) > new_from:
                logprobs = self._chat_logprobs(c.logprobs[new_from:])
            delta: dict[str, Any] = {"content": text} if text else {}
            finish_reason = c.finish_reason
            if req.uses_tools:
                stream = tool_streams.setdefault(c.index, tool_calls.ToolCallStream())
                first_call = stream.num_calls
                content, calls = stream.feed(c.text, final=c.finish_reason is not None)
                delta = {"content": content} if content else {}
                if calls:
                    delta["tool_calls"] = [{"index": first_call + k, **call.message()} for k, call in enumerate(calls)]
                if finish_reason == "stop" and stream.num_calls:
                    finish_reason = "tool_calls"
            return {"index": c.index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}

        return chunk

    # -- /v1/completions ------------------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request):
        self._check_model(req)
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], int):
            prompt = PromptInput(prompt_token_ids=list(req.prompt))
        elif isinstance(req.prompt, list):
            if len(req.prompt) != 1:
                raise OpenAIError(400, "send one prompt per request (a list of several is not supported)", param="prompt")
            prompt = PromptInput(prompt=req.prompt[0])
        else:
            prompt = PromptInput(prompt=req.prompt)
        prompt.mm_processor_kwargs = dict(req.mm_processor_kwargs or {})
        params = self._params(req, req.max_tokens, req.logprobs, default_max=16)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        first, gen = await self._start(request_id, prompt, params, req, request)
        if req.stream:
            def chunk(c: CompletionOutput, text: str, new_from: int) -> dict[str, Any]:
                return {"index": c.index, "text": text, "finish_reason": c.finish_reason, "logprobs": None}

            base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._stream(first, gen, base, include_usage, chunk),
                                     media_type="text/event-stream")
        final = await self._final(first, gen, request)
        choices = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": None if c.logprobs is None else self._completion_logprobs(c.logprobs, 0)}
                   for c in final.outputs]
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage(final)}


async def _unless_gone(awaitable, request: Request, gen: AsyncIterator[RequestOutput]):
    """Awaits while the client is connected; if it hangs up, the request is aborted (the
    generator's own clean-up) and ClientGone raised."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            with contextlib.suppress(BaseException):
                await gen.aclose()
            raise ClientGone


def _output_error(out: RequestOutput) -> OpenAIError:
    """A request the engine ended with an error: a fault (500) or the shutdown (503)."""
    message = out.error or "the request failed in the engine"
    return OpenAIError(503 if message == SHUTDOWN_ERROR else 500, message)


def serve_engine_app(engine: EngineClient, app: FastAPI, args) -> None:
    """Serves `app` (the API, or the UI with the API) until Ctrl-C / SIGTERM; exits
    non-zero if the engine dies, so that a supervisor restarts the process."""
    from vlmserve.entrypoints.http import HTTPLimits, make_server

    limits = HTTPLimits(max_body_bytes=args.max_request_mb << 20, max_connections=args.max_connections,
                        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                        drain_timeout=args.drain_timeout)
    server = make_server(app, args.host, args.port, args.log_level, limits,
                         on_drain_deadline=lambda: engine.abort_all(SHUTDOWN_ERROR))
    died: list[BaseException] = []

    def on_death(error: BaseException) -> None:
        died.append(error)
        server.stop_now()

    engine.death_listeners.append(on_death)
    server.run()
    if died:
        logger.error("the engine died (%r): exiting so that a supervisor can restart the server", died[0])
        sys.exit(1)


def run_server(args) -> None:
    """`vlmserve serve`: builds the engine (or, with --replicas, the replicas on Ray
    Serve), then serves until Ctrl-C / SIGTERM."""
    engine_args = EngineArgs.from_namespace(args)
    if args.replicas or args.max_replicas:
        from vlmserve.entrypoints.openai.replicas import start_replicas

        engine: EngineClient = start_replicas(args, engine_args)
    else:
        engine = AsyncLLM(engine_args, max_pending_requests=args.max_pending_requests)
    name = args.served_model_name or served_name(args.model, engine.model_path)
    server = OpenAIServer(engine, name, api_key=args.api_key)
    logger.info("serving %s on http://%s:%d/v1", name, args.host, args.port)
    serve_engine_app(engine, server.build_app(), args)
