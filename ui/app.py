"""The Gradio chat UI: pictures and clips in, streamed answers out, and for every answer
what a VLM user wants to know — speed, time to first token, how much of the prompt came
from the prefix cache, whether the vision encoder ran.

It talks to an OpenAI-compatible server (vlmserve's own, in-process or remote, or any
other), so the UI never touches the engine directly.
"""

from __future__ import annotations

import base64
import json
import mimetypes
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import openai

from vlmserve.multimodal.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS

ERROR_MARK = "⚠️"  # starts an answer that is an error message


@dataclass
class Settings:
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    detail: str = "auto"
    max_pixels: int | None = None


def file_part(path: str, detail: str) -> dict[str, Any]:
    """An uploaded file as an OpenAI content part (a data URL: works with any server)."""
    ext = Path(path).suffix.lower()
    mime = mimetypes.guess_type(path)[0] or ("video/mp4" if ext in VIDEO_EXTENSIONS else "image/png")
    url = f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()
    if ext in VIDEO_EXTENSIONS:
        return {"type": "video_url", "video_url": {"url": url}}
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def to_openai_messages(history: list[dict], detail: str) -> list[dict]:
    """Gradio chat history (text and file parts) -> OpenAI chat messages. A turn that
    failed (its answer is an error shown in the chat) is left out, files and all: the
    next question must not send the broken file again."""
    messages: list[dict] = []
    for msg in history:
        if is_reasoning(msg):  # shown, not sent back: chat templates leave earlier reasoning out
            continue
        content = msg["content"] if isinstance(msg["content"], list) else [msg["content"]]
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
            elif isinstance(part, dict) and part.get("type") == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif isinstance(part, dict):
                path = part.get("path") or (part.get("file") or {}).get("path")
                if path:
                    parts.append(file_part(path, detail))
        if msg["role"] == "assistant":
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            if text.startswith(ERROR_MARK):
                if messages and messages[-1]["role"] == "user":
                    messages.pop()
            elif text:
                messages.append({"role": "assistant", "content": text})
            continue
        if messages and messages[-1]["role"] == "user":  # gradio splits a turn into several messages
            messages[-1]["content"].extend(parts)
        else:
            messages.append({"role": "user", "content": parts})
    return messages


REASONING_TITLE = "Reasoning"


def is_reasoning(msg: dict) -> bool:
    """A thinking model's reasoning, shown folded above its answer."""
    return bool((msg.get("metadata") or {}).get("title"))


def reasoning_delta(delta: Any) -> str:
    """The reasoning a streamed chunk adds (vLLM's `reasoning`, or its older name)."""
    extra = getattr(delta, "model_extra", None) or {}
    return extra.get("reasoning") or extra.get("reasoning_content") or ""


def stats_line(usage: dict | None, ttft: float | None, seconds: float, tokens: int) -> str:
    if usage is None:
        return ""
    rate = (tokens - 1) / (seconds - ttft) if ttft is not None and tokens > 1 and seconds > ttft else 0.0
    parts = [f"{rate:.1f} tokens/s", f"time to first token {ttft:.2f} s" if ttft is not None else None,
             f"prompt {usage.get('prompt_tokens', 0)} tokens, "
             f"{(usage.get('prompt_tokens_details') or {}).get('cached_tokens', 0)} from the prefix cache"]
    media = {k: n for k, n in (usage.get("media") or {}).items() if n}
    if media:
        words = {"encoded": "encoder ran", "encoder_cache": "from the encoder cache", "prefix_cache": "in the prefix cache"}
        parts.append("media: " + ", ".join(f"{n} {words[k]}" for k, n in media.items() if n))
    return " · ".join(p for p in parts if p)


# the growing answer goes to the browser at most this often: every token would resend the
# whole transcript (quadratic in the answer's length) and starve the page on a busy machine
REFRESH_SECONDS = 0.1


class ChatApp:
    def __init__(self, api_base: str, api_key: str | None, model: str | None = None,
                 samples: list[tuple[str, str]] | None = None) -> None:
        self.client = openai.AsyncOpenAI(base_url=api_base, api_key=api_key or "none", max_retries=0, timeout=120)
        self.model = model
        self.samples = samples or []

    async def _model(self) -> str:
        if self.model is None:
            models = await self.client.models.list()
            self.model = models.data[0].id
        return self.model

    async def model_choices(self) -> gr.Dropdown:
        """The server's models: the base model and its LoRA adapters (/v1/models)."""
        try:
            names = [m.id for m in (await self.client.models.list()).data]
        except openai.APIError:  # not reachable yet: the first answer says so
            names = [self.model] if self.model else []
        return gr.Dropdown(choices=names, value=self.model or (names[0] if names else None))

    async def respond(self, history: list[dict], model, temperature, top_p, max_tokens, seed, detail, max_pixels):
        """Streams the answer to the conversation so far, by the chosen model (the base
        model or one of its adapters), into the last assistant message."""
        seed = str(seed or "").strip()
        settings = Settings(temperature, top_p, int(max_tokens), int(seed) if seed.lstrip("-").isdigit() else None,
                            detail, int(max_pixels) if max_pixels else None)
        history = history + [{"role": "assistant", "content": ""}]
        stream = None
        start = time.perf_counter()
        ttft, usage, text, tokens = None, None, "", 0
        shown = 0.0  # when the answer was last sent to the browser
        try:
            messages = to_openai_messages(history[:-1], settings.detail)
            extra = {"mm_processor_kwargs": {"max_pixels": settings.max_pixels}} if settings.max_pixels else {}
            stream = await self.client.chat.completions.create(
                model=model or await self._model(), messages=messages, stream=True, stream_options={"include_usage": True},
                temperature=settings.temperature, top_p=settings.top_p, max_tokens=settings.max_tokens,
                seed=settings.seed, extra_body=extra,
            )
            thought = None  # the reasoning's message, above the answer, once some comes
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.model_dump()
                if not chunk.choices:
                    continue
                delta, more = chunk.choices[0].delta.content or "", reasoning_delta(chunk.choices[0].delta)
                if more and thought is None:
                    thought = {"role": "assistant", "content": "",
                               "metadata": {"title": REASONING_TITLE, "status": "pending"}}
                    history.insert(len(history) - 1, thought)
                if delta or more:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    tokens += 1
                    text += delta
                    history[-1]["content"] = text
                    if more:
                        thought["content"] += more
                    if time.perf_counter() - shown >= REFRESH_SECONDS:
                        shown = time.perf_counter()
                        yield history, ""
            if thought is not None:
                thought["metadata"]["status"] = "done"
            yield history, stats_line(usage, ttft, time.perf_counter() - start, (usage or {}).get("completion_tokens", tokens))
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            history[-1]["content"] = f"{ERROR_MARK} the server is not reachable ({e.__class__.__name__}); is it running?"
            yield history, ""
        except openai.APIStatusError as e:
            history[-1]["content"] = f"{ERROR_MARK} {_error_message(e)}"
            yield history, ""
        except openai.APIError as e:  # an error event in the middle of a stream
            history[-1]["content"] = f"{ERROR_MARK} {e.message}"
            yield history, ""
        finally:
            if stream is not None:
                await stream.close()  # on Stop, this hangs up: the server aborts the request

    def build(self) -> gr.Blocks:
        with gr.Blocks(title="vlmserve") as demo:
            gr.Markdown("## vlmserve — chat about pictures and videos")
            model = gr.Dropdown(choices=[self.model] if self.model else [], value=self.model, elem_id="model",
                                label="model (the base model, or one of its LoRA adapters)")
            chatbot = gr.Chatbot(elem_id="chat", height=460)
            stats = gr.Markdown(elem_id="stats")
            box = gr.MultimodalTextbox(elem_id="input", file_count="multiple", file_types=["image", "video"],
                                       placeholder="Ask about a picture or a clip (drop files, or paste a picture)…",
                                       show_label=False, sources=["upload"])
            with gr.Row():
                # the primary action only while an answer streams: inactive until then
                stop = gr.Button("Stop", elem_id="stop", variant="secondary", interactive=False)
                again = gr.Button("Regenerate", elem_id="regenerate")
                clear = gr.Button("Clear", elem_id="clear")
            with gr.Accordion("Settings", open=False):
                temperature = gr.Slider(0, 2, value=0.0, step=0.05, label="temperature")
                top_p = gr.Slider(0.05, 1, value=1.0, step=0.05, label="top-p")
                max_tokens = gr.Slider(1, 8192, value=128, step=1, label="max tokens")  # the server caps it at the context
                seed = gr.Textbox(value="", label="seed (empty: random)", elem_id="seed")
                detail = gr.Radio(["auto", "high", "low"], value="auto", label="image detail")
                max_pixels = gr.Number(value=0, precision=0, label="max pixels per image (0: the model's)")
            knobs = [model, temperature, top_p, max_tokens, seed, detail, max_pixels]
            if self.samples:
                gr.Examples([[{"text": q, "files": [p]}] for p, q in self.samples], inputs=[box],
                            label="Sample pictures (click one)")

            def add_turn(history, message):
                history = list(history or [])
                for path in message.get("files", []):
                    history.append({"role": "user", "content": {"path": path if isinstance(path, str) else path["path"]}})
                if message.get("text"):
                    history.append({"role": "user", "content": message["text"]})
                return history, gr.MultimodalTextbox(value=None, interactive=False)

            def drop_last_answer(history):
                history = list(history or [])
                while history and history[-1]["role"] == "assistant":
                    history.pop()
                return history

            def answering():
                return gr.Button(variant="stop", interactive=True)

            def done():
                return gr.MultimodalTextbox(interactive=True), gr.Button(variant="secondary", interactive=False)

            submit = box.submit(add_turn, [chatbot, box], [chatbot, box], queue=False).then(
                answering, None, [stop], queue=False).then(self.respond, [chatbot, *knobs], [chatbot, stats])
            submit.then(done, None, [box, stop])
            regen = again.click(drop_last_answer, [chatbot], [chatbot], queue=False).then(
                answering, None, [stop], queue=False).then(self.respond, [chatbot, *knobs], [chatbot, stats])
            regen.then(done, None, [box, stop])
            stop.click(done, None, [box, stop], cancels=[submit, regen])
            clear.click(lambda: ([], "", *done()), None, [chatbot, stats, box, stop], queue=False, cancels=[submit, regen])
            demo.load(self.model_choices, None, [model])
        return demo


# Pictures and clips in the transcript as thumbnails, not at the chat's full width.
CSS = "#chat .image-frame img, #chat video { max-height: 9rem; width: auto; max-width: 100%; }"

# Browsers fire no change event when the file picked is the one picked last time, so the
# same picture could not be sent again (after Clear, say): empty the input after each pick.
HEAD = """<script>
document.addEventListener("change", (e) => {
  const input = e.target;
  if (input instanceof HTMLInputElement && input.type === "file") setTimeout(() => { input.value = ""; }, 0);
}, true);
</script>"""


def _error_message(e: openai.APIStatusError) -> str:
    try:
        body = e.response.json()
        return body["error"]["message"]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return str(e)


def sample_examples(folder: Path) -> list[tuple[str, str]]:
    """The pictures in samples/ with their questions (samples/answers.json)."""
    index = folder / "answers.json"
    if not index.is_file():
        return []
    items = json.loads(index.read_text())
    return [(str(folder / it["file"]), it["question"]) for it in items if Path(it["file"]).suffix.lower() in IMAGE_EXTENSIONS]
