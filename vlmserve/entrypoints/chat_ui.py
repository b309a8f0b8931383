"""`vlmserve ui`: the chat UI (ui/) against a running server (--api-base), or with the
engine in-process: the UI and the OpenAI API side by side on one port, the UI's own calls
going through the API like any client's."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def run_ui(args) -> None:
    import uvicorn
    from fastapi import FastAPI

    from vlmserve.ui.launch import mount_chat_ui

    if args.api_base:
        app = FastAPI(title="vlmserve ui")
        app.get("/health")(lambda: {"status": "ok"})  # the UI itself is up (the server behind may not be)
        logger.info("UI for %s on http://%s:%d", args.api_base, args.host, args.port)
        app = mount_chat_ui(app, args.api_base, args.api_key, samples_folder=args.samples)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=10)
        return
    from vlmserve.engine.args import EngineArgs
    from vlmserve.engine.async_llm import AsyncLLM
    from vlmserve.engine.model_source import served_name
    from vlmserve.entrypoints.openai.api_server import OpenAIServer, serve_engine_app
    from vlmserve.entrypoints.openai.serving_models import adapters_from_args

    adapters = adapters_from_args(args)
    engine = AsyncLLM(EngineArgs.from_namespace(args), max_pending_requests=args.max_pending_requests,
                      served_model_name=args.served_model_name, metrics_names=args.metrics_names)
    name = args.served_model_name or served_name(args.model, engine.model_path)
    # the API side by side is open exactly as `vlmserve serve` would be: with --api-key or without
    server = OpenAIServer(engine, name, args.api_key, adapters, args.allow_runtime_lora_updating,
                          args.allowed_lora_path, args.tool_call_parser)
    own = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    app = mount_chat_ui(server.build_app(), f"http://{own}:{args.port}/v1", args.api_key, model=name,
                        samples_folder=args.samples)
    logger.info("UI and OpenAI API (%s) on http://%s:%d (API under /v1)", name, args.host, args.port)
    serve_engine_app(engine, app, args, server)
