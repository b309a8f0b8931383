"""The chat UI as an ASGI app: the Gradio app of ui/app.py mounted at `/`, talking to an
OpenAI-compatible server by its URL (the one in this process, or any other). What serves
it — a plain uvicorn, or `vlmserve ui`'s server beside the engine's API — is the entry
point's business (entrypoints/chat_ui.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def shipped_samples() -> Path:
    """The sample pictures installed with the package (the repo's samples/ folder)."""
    import vlmserve.samples

    return Path(vlmserve.samples.__file__).resolve().parent


def mount_chat_ui(app: Any, api_base: str, api_key: str | None, model: str | None = None,
                  samples_folder: str | None = None) -> Any:
    """`app` (a FastAPI app) with the chat UI for the server at api_base mounted at `/`."""
    import gradio as gr

    from vlmserve.ui.app import CSS, HEAD, ChatApp, sample_examples

    samples = sample_examples(Path(samples_folder) if samples_folder else shipped_samples())
    chat = ChatApp(api_base, api_key, model=model, samples=samples)
    # gradio serves the examples' files only when told to: those files, not their whole folder
    allowed = [path for path, _ in samples]
    return gr.mount_gradio_app(app, chat.build(), path="/", head=HEAD, css=CSS, allowed_paths=allowed)
