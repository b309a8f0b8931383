"""OpenAI-style chat messages -> (prompt text via the checkpoint's chat template, media).

Content parts accepted: text; images as `image_url` ({"url": ..., "detail": ...}, as
OpenAI's schema has it), `image` (a PIL image, numpy array, path or URL) or `image_pil`;
videos as `video_url` ({"url": ...}) or `video` (a path, URL, frames or an array). The
template only sees `{"type": "image"}` / `{"type": "video"}` placeholders, so any
Qwen-style template renders them. A message may have any role: the template renders it
(vLLM's custom roles).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vlmserve.engine.chat_template import ChatTemplate, as_strings
from vlmserve.engine.input_processor import PromptInput

_PART_MODALITY = {"image_url": "image", "image": "image", "image_pil": "image", "video_url": "video", "video": "video"}


@dataclass
class ParsedChat:
    messages: list[dict[str, Any]]  # normalised for the template
    media: dict[str, list[Any]] = field(default_factory=dict)  # modality -> sources, in order
    settings: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per item, e.g. detail


def parse_chat_messages(messages: list[dict[str, Any]]) -> ParsedChat:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    parsed = ParsedChat(messages=[])
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        role = message["role"]
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        content = message.get("content")
        if content is None:
            content = ""
        if role == "tool" and isinstance(content, list):  # a tool's result: its text parts
            content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
        extra = _tool_fields(message, f"messages[{i}]")
        if isinstance(content, str):
            parsed.messages.append({"role": role, "content": content, **extra})
            continue
        if not isinstance(content, list):
            raise ValueError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            parts.append(_parse_part(part, parsed, f"messages[{i}].content[{j}]"))
        parsed.messages.append({"role": role, "content": parts, **extra})
    return parsed


def _tool_fields(message: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant's tool calls (arguments as objects, as templates take them) and a
    tool result's call id."""
    extra: dict[str, Any] = {}
    if message.get("tool_calls"):
        calls = []
        for j, call in enumerate(message["tool_calls"]):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"{where}.tool_calls[{j}] must have a function with a name")
            arguments = function.get("arguments") or "{}"
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    raise ValueError(f"{where}.tool_calls[{j}].function.arguments is not JSON") from None
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": function["name"], "arguments": arguments}})
        extra["tool_calls"] = calls
    if message.get("tool_call_id") is not None:
        extra["tool_call_id"] = str(message["tool_call_id"])
    return extra


def _parse_part(part: Any, parsed: ParsedChat, where: str) -> dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict) or "type" not in part:
        raise ValueError(f"{where} must be an object with a 'type'")
    kind = part["type"]
    if not isinstance(kind, str):
        raise ValueError(f"{where}.type must be a string, got {type(kind).__name__}")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"{where}.text must be a string")
        return {"type": "text", "text": text}
    if kind in _PART_MODALITY:
        modality = _PART_MODALITY[kind]
        value = part.get(kind)
        settings: dict[str, Any] = {}
        if kind in ("image_url", "video_url") and not isinstance(value, dict):
            raise ValueError(f"{where}.{kind} must be an object {{\"url\": ...}}, got {type(value).__name__}")
        if isinstance(value, dict):  # {"url": ..., "detail": ...}
            if value.get("detail") is not None:
                settings["detail"] = value["detail"]
            value = value.get("url")
        if value is None:
            raise ValueError(f"{where} has no {kind!r} value")
        parsed.media.setdefault(modality, []).append(value)
        parsed.settings.setdefault(modality, []).append(settings)
        return {"type": modality}
    raise ValueError(f"{where}: unsupported content part type {kind!r}")


def render_chat(
    hf_processor,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    template: ChatTemplate | None = None,
) -> PromptInput:
    """The prompt of chat messages; with continue_final_message, the last message is left
    open for the answer to continue it. `template`: --chat-template and its content format
    (default: the checkpoint's template, its format read from it)."""
    parsed = parse_chat_messages(messages)
    template = template or ChatTemplate()
    text = template.text or getattr(hf_processor, "chat_template", None)
    rendered = parsed.messages
    if template.format_for(text) == "string":
        image_mark = getattr(hf_processor, "boi_token", None) or getattr(hf_processor, "image_token", None)
        rendered = as_strings(rendered, image_mark, getattr(hf_processor, "video_token", None))
    try:
        prompt = hf_processor.apply_chat_template(
            rendered,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **({"chat_template": template.text} if template.text else {}),
            **({"tools": tools} if tools else {}),
            **(chat_template_kwargs or {}),
        )
    except Exception as e:  # a template error is the request's fault
        raise ValueError(f"the chat template could not render these messages: {e}") from None
    return PromptInput(prompt=prompt, media=parsed.media, media_settings=parsed.settings)
