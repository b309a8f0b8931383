"""A Responses API request's input as chat messages (what the chat template renders):
`instructions` as a system message first, its items in order — messages with text and
pictures (`input_image` by URL or data URL), the model's earlier function calls and their
outputs, earlier reasoning (left out: the templates drop it) — and its function tools
as chat tools. What vlmserve cannot take is refused with a 400 naming the item."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from vlmserve.entrypoints.openai.protocol import NamedToolChoice, OpenAIError, Tool
from vlmserve.entrypoints.openai.responses_protocol import FunctionChoice, ResponsesRequest

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input (not what previous_response_id brings) as chat messages."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(_call_output(item, where))
        elif kind == "reasoning":
            continue  # the model's earlier reasoning: chat templates leave it out of the prompt
        else:
            raise OpenAIError(400, f"{where}: input items of type {kind!r} are not supported (messages, "
                                   f"function_call, function_call_output and reasoning are)", param=where)
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise OpenAIError(400, f"{where}.role must be user, assistant, system or developer, got {item.get('role')!r}",
                          param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise OpenAIError(400, f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    return {"role": role, "content": [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]}


def _part(part: Any, where: str) -> dict[str, Any]:
    """A content part as a chat part."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "refusal":
        return {"type": "text", "text": str(part.get("refusal", ""))}
    if kind == "input_image":
        if part.get("file_id"):
            raise OpenAIError(400, f"{where}: file_id images are not supported (this server has no /v1/files): "
                                   f"send image_url, a URL or a data URL", param=f"{where}.file_id")
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise OpenAIError(400, f"{where}: an input_image needs image_url", param=f"{where}.image_url")
        detail = part.get("detail")
        return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
    if kind == "input_file":
        raise OpenAIError(400, f"{where}: input_file is not supported (pictures go in input_image)", param=where)
    raise OpenAIError(400, f"{where}: unsupported content part type {kind!r}", param=where)


def _add_call(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """An earlier function call, on the assistant message before it (calls in a row are
    one turn)."""
    name, arguments = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise OpenAIError(400, f"{where}: a function_call needs a name and arguments (a JSON string)", param=where)
    call = {"id": item.get("call_id") or item.get("id"), "type": "function",
            "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):  # content parts: their text
        output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
    if not isinstance(output, str):
        raise OpenAIError(400, f"{where}: a function_call_output needs output (a string)", param=f"{where}.output")
    return {"role": "tool", "tool_call_id": str(item.get("call_id") or ""), "content": output}


def chat_messages(instructions: str | None, history: list[dict[str, Any]],
                  messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the template renders: the instructions, the earlier turns, the new input."""
    return ([{"role": "system", "content": instructions}] if instructions else []) + history + messages


def chat_tools(req: ResponsesRequest) -> tuple[list[Tool] | None, str | NamedToolChoice | None]:
    """The request's function tools and tool_choice in chat completions' form."""
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            raise OpenAIError(400, f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (function "
                                   f"tools are)", param=f"tools[{i}].type")
    try:
        tools = [Tool(function={k: v for k, v in t.items() if k in ("name", "description", "parameters", "strict")})
                 for t in req.function_tools]
    except ValidationError as e:
        first = e.errors()[0]
        raise OpenAIError(400, f"tools: {'.'.join(str(x) for x in first['loc'])}: {first['msg']}",
                          param="tools") from None
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        if choice.name not in {t.function.name for t in tools}:
            raise OpenAIError(400, f"tool_choice names {choice.name!r}, which is not among the tools",
                              param="tool_choice")
        choice = NamedToolChoice(function={"name": choice.name})
    elif choice not in (None, "none", "auto") and not tools:
        raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
    return tools or None, choice


def assistant_turn(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the assistant message a later turn renders."""
    turn: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        turn["tool_calls"] = [{"id": c["call_id"], "type": "function",
                               "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return turn
