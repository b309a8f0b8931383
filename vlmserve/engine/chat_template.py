"""`--chat-template` and `--chat-template-content-format`, as vLLM takes them: a template
replacing the checkpoint's (a file, or the Jinja text itself), and how a message's content
reaches the template — `openai` (a list of parts: text, and `{"type": "image"}` where a
picture goes), `string` (its text parts joined, each picture's placeholder markup before
them), or `auto` (read from the template: one that loops over a message's content takes
parts)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmserve.errors import ConfigError

logger = logging.getLogger(__name__)

CONTENT_FORMATS = ("auto", "string", "openai")

# a picture's and a video's markup in a prompt, by the processor's placeholder token, for
# templates that take text only (what the family's own template writes for a part)
_MEDIA_MARKUP = {
    "<|image_pad|>": "<|vision_start|><|image_pad|><|vision_end|>",
    "<|video_pad|>": "<|vision_start|><|video_pad|><|vision_end|>",
}


@dataclass(frozen=True)
class ChatTemplate:
    """The template chats are rendered with (None: the checkpoint's own) and the content
    format it takes."""

    text: str | None = None
    content_format: str = "auto"

    @classmethod
    def of(cls, template: str | None, content_format: str = "auto") -> ChatTemplate:
        """From the settings: a path is read; anything else is the template itself."""
        if content_format not in CONTENT_FORMATS:
            raise ConfigError(f"--chat-template-content-format {content_format}: one of {', '.join(CONTENT_FORMATS)}")
        if template is None:
            return cls(None, content_format)
        text = _read_template(template)
        try:
            from jinja2 import Environment

            Environment().parse(text)
        except Exception as e:  # a broken template is the setting's fault, said at start
            raise ConfigError(f"--chat-template is not a valid Jinja template: {e}") from None
        return cls(text, content_format)

    def format_for(self, template_text: str | None) -> str:
        """The content format to render with: the setting, or the template's own."""
        if self.content_format != "auto":
            return self.content_format
        return detect_content_format(template_text) if template_text else "openai"


def _read_template(value: str) -> str:
    """A file's text (a .json file: its "chat_template"), or the value itself when it names
    no file (a template inline has Jinja's braces; a missing path has none)."""
    looks_inline = any(mark in value for mark in ("{{", "{%"))
    path = Path(value).expanduser()
    if not looks_inline and path.is_file():
        text = path.read_text()
        if path.suffix == ".json":
            import json

            text = json.loads(text).get("chat_template", "")
        return text
    if not looks_inline:
        raise ConfigError(f"--chat-template {value}: no such file, and not a Jinja template either")
    return value


def detect_content_format(template: str) -> str:
    """`openai` when the template loops over a message's content (it takes a list of
    parts), else `string` — vLLM's detection."""
    from jinja2 import Environment, nodes

    try:
        tree = Environment().parse(template)
    except Exception:
        return "openai"
    content_names = {"content"}
    for node in tree.find_all(nodes.Assign):  # {% set content = message['content'] %}
        if isinstance(node.target, nodes.Name) and _is_content(node.node, set()):
            content_names.add(node.target.name)
    for loop in tree.find_all(nodes.For):
        if _is_content(loop.iter, content_names):
            return "openai"
    return "string"


def _is_content(node: Any, names: set[str]) -> bool:
    from jinja2 import nodes

    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Filter):  # message['content'] | selectattr(...)
        return _is_content(node.node, names)
    return isinstance(node, nodes.Name) and node.name in names


def as_strings(messages: list[dict[str, Any]], image_token: str | None, video_token: str | None
               ) -> list[dict[str, Any]]:
    """Messages whose content is one string (a template that takes text only): the text
    parts joined by newlines, after a placeholder for each picture and video (vLLM puts
    them first)."""
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        marks = [_markup(image_token if p.get("type") == "image" else video_token) for p in content
                 if p.get("type") in ("image", "video")]
        texts = [p["text"] for p in content if p.get("type") == "text"]
        out.append({**message, "content": "\n".join(marks + texts)})
    return out


def _markup(token: str | None) -> str:
    if token is None:
        raise ValueError("this model's processor takes no such media")
    return _MEDIA_MARKUP.get(token, token)
