"""OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions, /v1/models,
/tokenize, /detokenize, /health, /version, /metrics — FastAPI on uvicorn, over an engine
(EngineClient: one in this process, or replicas on Ray Serve). The chat and completion
endpoints are serving_chat.py's and serving_completion.py's."""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlmserve import __version__
from vlmserve.engine.args import EngineArgs
from vlmserve.engine.async_llm import AsyncLLM
from vlmserve.engine.input_processor import check_prompt_text, max_chars_per_token
from vlmserve.engine.model_source import served_name
from vlmserve.engine.protocol import EngineClient
from vlmserve.entrypoints.openai.protocol import (DetokenizeRequest, LoadLoRAAdapterRequest, OpenAIError,
                                                  TokenizeRequest, UnloadLoRAAdapterRequest)
from vlmserve.entrypoints.openai.serving import SHUTDOWN_ERROR, ClientGone
from vlmserve.entrypoints.openai.serving_chat import ServingChat
from vlmserve.entrypoints.openai.serving_responses import ServingResponses
from vlmserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vlmserve.entrypoints.openai.serving_completion import ServingCompletion
from vlmserve.entrypoints.openai.serving_embedding import ServingEmbedding
from vlmserve.entrypoints.openai.serving_score import ServingScore
from vlmserve.entrypoints.openai.serving_models import ServedModels, adapters_from_args
from vlmserve.errors import ConfigError
from vlmserve.metrics import CONTENT_TYPE
from vlmserve.multimodal.decode_budget import MediaBusyError

logger = logging.getLogger(__name__)

# the routes that need the API key where one is set: the API's (the chat UI's pages, served
# beside it by `vlmserve ui`, and the probes' routes stay open)
KEYED_PREFIXES = ("/v1/", "/v2/")
KEYED_PATHS = {"/tokenize", "/detokenize", "/score", "/rerank"}


class OpenAIServer:
    def __init__(self, engine: EngineClient, served_model_name: str, api_key: str | None = None,
                 lora_modules: dict[str, str] | None = None, runtime_lora_updates: bool = False,
                 allowed_lora_path: str | None = None, tool_call_parser: str = "hermes") -> None:
        """engine: an AsyncLLM, or replicas on Ray Serve (replicas.ReplicaPool);
        lora_modules: adapters served under names of their own (name -> folder);
        runtime_lora_updates: /v1/load_lora_adapter and /v1/unload_lora_adapter on, for
        adapters under allowed_lora_path (None: anywhere)."""
        self.engine = engine
        self.model_name = served_model_name
        self.api_key = api_key
        self.tokenizer = engine.tokenizer
        self.chars_per_token = max_chars_per_token(engine.tokenizer)
        self.models = ServedModels(engine, served_model_name, allowed_lora_path)
        if runtime_lora_updates and allowed_lora_path is None:
            logger.warning("adapters may be loaded at run time from any folder this server can read: "
                           "--allowed-lora-path limits them to one")
        for name, path in (lora_modules or {}).items():
            try:
                self.models.add(name, path)
            except ValueError as e:
                raise ConfigError(f"--lora-modules {name}={path}: {e}") from None
        self.runtime_lora_updates = runtime_lora_updates
        if tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(f"--tool-call-parser {tool_call_parser}: one of {', '.join(TOOL_PARSERS)}")
        self.chat = ServingChat(engine, self.models, tool_call_parser)
        self.responses = ServingResponses(engine, self.models, tool_call_parser)
        self.completion = ServingCompletion(engine, self.models)
        self.embedding = ServingEmbedding(engine, self.models)
        self.scoring = ServingScore(engine, self.models)

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

        # the key is checked by unauthorized(), before a request's body is read (http.py)
        app.get("/health")(self.health)
        app.get("/version")(lambda: {"version": __version__})
        app.get("/metrics")(self.metrics_endpoint)
        app.get("/v1/models")(self.list_models)
        app.post("/v1/chat/completions")(self.chat.create)
        app.post("/v1/responses")(self.responses.create)
        app.get("/v1/responses/{response_id}")(self.responses.retrieve)
        app.delete("/v1/responses/{response_id}")(self.responses.delete)
        app.post("/v1/completions")(self.completion.create)
        app.post("/v1/embeddings")(self.embedding.create)
        for path in ("/score", "/v1/score"):
            app.post(path)(self.scoring.score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.post(path)(self.scoring.rerank)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        if self.runtime_lora_updates:
            app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)(self.load_lora)
            app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)(self.unload_lora)
        return app

    def unauthorized(self, path: str, headers: dict[bytes, bytes]) -> str | None:
        """Why a request on this path with these headers is refused (401), or None: checked
        from the headers alone, before the body is read."""
        if not self.api_key or not (path.startswith(KEYED_PREFIXES) or path in KEYED_PATHS):
            return None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key.encode()):
            return "invalid or missing API key (send 'Authorization: Bearer <key>')"
        return None

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
        cause = exc.__cause__
        if exc.status_code == 400 and cause is not None:  # FastAPI could not parse the body
            message[400] = f"request body is not valid JSON: {'nested too deep' if isinstance(cause, RecursionError) else cause}"
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

    # -- small routes ----------------------------------------------------------------------------
    async def health(self):
        if not self.engine.is_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    async def metrics_endpoint(self):
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE)

    async def list_models(self):
        """The served model and its adapters, with vLLM's card fields."""
        return {"object": "list", "data": self.models.cards()}

    async def load_lora(self, req: LoadLoRAAdapterRequest):
        return await self.models.load(req.lora_name, req.lora_path)

    async def unload_lora(self, req: UnloadLoRAAdapterRequest):
        return await self.models.unload(req.lora_name)

    # -- tokenizer routes (vLLM's) ------------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest):
        """A prompt's tokens: plain text (special tokens added by default, as vLLM does), or
        chat messages as the template renders them (pictures and videos expanded into the
        tokens they become)."""
        self._check_model(req.model)
        loop = asyncio.get_running_loop()
        if req.messages is not None:
            try:
                prompt = self.engine.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                                 continue_final_message=req.continue_final_message)
                prompt.mm_processor_kwargs = dict(req.mm_processor_kwargs or {})
                tokens = await self.engine.prompt_token_ids(prompt)
            except ValueError as e:
                raise OpenAIError(400, str(e), param="messages") from None
            except MediaBusyError as e:
                raise OpenAIError(503, str(e)) from None
            if req.add_special_tokens:
                tokens = self.tokenizer.build_inputs_with_special_tokens(tokens)
        else:
            try:  # the cheap refusals of a completion's prompt, before tokenizing
                check_prompt_text(req.prompt, self.engine.max_model_len, self.chars_per_token)
            except ValueError as e:
                raise OpenAIError(400, str(e), param="prompt") from None
            tokens = await loop.run_in_executor(None, lambda: self.tokenizer.encode(
                req.prompt, add_special_tokens=req.add_special_tokens is not False))
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens, "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest):
        self._check_model(req.model)
        if len(req.tokens) > self.engine.max_model_len:
            raise OpenAIError(400, f"tokens holds {len(req.tokens)} ids, more than the model's context of "
                                   f"{self.engine.max_model_len}", param="tokens")
        vocab = len(self.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(400, f"tokens holds {bad[0]}, not a token id of this model (0 to {vocab - 1})",
                              param="tokens")
        loop = asyncio.get_running_loop()
        return {"prompt": await loop.run_in_executor(None, self.tokenizer.decode, req.tokens)}

    def _check_model(self, model: str | None) -> None:
        self.models.resolve(model)  # an adapter tokenizes as its base model


def serve_engine_app(engine: EngineClient, app: FastAPI, args, server: OpenAIServer) -> None:
    """Serves `app` (the API of `server`, or the UI with it) until Ctrl-C / SIGTERM; exits
    non-zero if the engine dies, so that a supervisor restarts the process."""
    from vlmserve.entrypoints.http import HTTPLimits, make_server

    limits = HTTPLimits(max_body_bytes=args.max_request_mb << 20, max_connections=args.max_connections,
                        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                        drain_timeout=args.drain_timeout)
    http_server = make_server(app, args.host, args.port, args.log_level, limits,
                              on_drain_deadline=lambda: engine.abort_all(SHUTDOWN_ERROR),
                              unauthorized=server.unauthorized)
    died: list[BaseException] = []

    def on_death(error: BaseException) -> None:
        died.append(error)
        http_server.stop_now()

    engine.death_listeners.append(on_death)
    try:
        http_server.run()
    except KeyboardInterrupt:
        # uvicorn re-raises the Ctrl-C it captured once it has drained and shut down;
        # asyncio turns it into KeyboardInterrupt: the shutdown is done, not interrupted
        pass
    if died:
        logger.error("the engine died (%r): exiting so that a supervisor can restart the server", died[0])
        sys.exit(1)


def run_server(args) -> None:
    """`vlmserve serve`: builds the engine (or, with --replicas, the replicas on Ray
    Serve), then serves until Ctrl-C / SIGTERM."""
    adapters = adapters_from_args(args)
    engine_args = EngineArgs.from_namespace(args)
    if args.prefill_replicas and not (args.replicas or args.max_replicas) or \
            args.prefill_replicas and not engine_args.kv_transfer_config:
        raise ConfigError("--prefill-replicas: with --replicas N (the decode replicas) and a --kv-transfer-config "
                          "pool (where the decode replicas read what the prefill replicas computed)")
    if args.replicas or args.max_replicas:
        from vlmserve.entrypoints.openai.replicas import start_replicas

        engine: EngineClient = start_replicas(args, engine_args)
    else:
        engine = AsyncLLM(engine_args, max_pending_requests=args.max_pending_requests,
                          served_model_name=args.served_model_name, metrics_names=args.metrics_names)
    name = args.served_model_name or served_name(args.model, engine.model_path)
    server = OpenAIServer(engine, name, args.api_key, adapters, args.allow_runtime_lora_updating,
                          args.allowed_lora_path, args.tool_call_parser)
    logger.info("serving %s on http://%s:%d/v1", name, args.host, args.port)
    serve_engine_app(engine, server.build_app(), args, server)
