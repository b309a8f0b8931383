"""`vlmserve ui`: the chat UI against a running server (--api-base), or with the engine
in-process, the UI and the OpenAI API side by side on one port."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def shipped_samples() -> Path:
    """The sample pictures installed with the package (the repo's samples/ folder)."""
    import vlmserve.samples

    return Path(vlmserve.samples.__file__).resolve().parent


def run_ui(args) -> None:
    import gradio as gr
    import uvicorn
    from fastapi import FastAPI

    from vlmserve.ui.app import CSS, HEAD, ChatApp, sample_examples

    folder = Path(args.samples) if args.samples else shipped_samples()
    samples = sample_examples(folder)
    if args.api_base:
        app = FastAPI(title="vlmserve ui")
        app.get("/health")(lambda: {"status": "ok"})  # the UI itself is up (the server behind may not be)
        chat = ChatApp(args.api_base, args.api_key, samples=samples)
        logger.info("UI for %s on http://%s:%d", args.api_base, args.host, args.port)
    else:
        from vlmserve.engine.args import EngineArgs
        from vlmserve.engine.async_llm import AsyncLLM
        from vlmserve.engine.model_source import served_name
        from vlmserve.entrypoints.openai.api_server import OpenAIServer, serve_engine_app

        from vlmserve.entrypoints.openai.serving_models import adapters_from_args

        adapters = adapters_from_args(args)
        engine = AsyncLLM(EngineArgs.from_namespace(args), max_pending_requests=args.max_pending_requests,
                          served_model_name=args.served_model_name, metrics_names=args.metrics_names)
        name = args.served_model_name or served_name(args.model, engine.model_path)
        # the API side by side is open exactly as `vlmserve serve` would be: with --api-key
        # or without; the UI's own calls go through it like any client's
        server = OpenAIServer(engine, name, args.api_key, adapters, args.allow_runtime_lora_updating,
                              args.allowed_lora_path)
        app = server.build_app()
        own = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        chat = ChatApp(f"http://{own}:{args.port}/v1", args.api_key, model=name, samples=samples)
        logger.info("UI and OpenAI API (%s) on http://%s:%d (API under /v1)", name, args.host, args.port)
    # gradio serves the examples' files only when told to: those files, not their whole folder
    allowed = [path for path, _ in samples]
    app = gr.mount_gradio_app(app, chat.build(), path="/", head=HEAD, css=CSS, allowed_paths=allowed)
    if args.api_base:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=10)
    else:
        serve_engine_app(engine, app, args, server)
