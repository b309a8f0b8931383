"""Tool calls in the Qwen family's format (Hermes style): the chat template lists the
tools, the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice: auto` parses such blocks out of the answer; `required` and a named function
constrain the answer to one block whose JSON validates against the tool's parameters."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmserve.entrypoints.openai.protocol import NamedToolChoice, Tool
from vlmserve.sampling_params import StructuredOutputsParams
from vlmserve.structured_output.schema import check_tool_parameters

START, END = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def template_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as chat templates take them (transformers' convention)."""
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def check_tools(tools: list[Tool]) -> None:
    """Each tool's parameters describe a JSON object (OpenAI sends arguments as one)."""
    for i, tool in enumerate(tools):
        check_tool_parameters(tool.function.parameters, f"tools[{i}].function")


def constraint(tools: list[Tool], choice: str | NamedToolChoice | None) -> StructuredOutputsParams | None:
    """The constraint of `required` (one call of any tool) or a named choice (one call of
    that tool), in the model's format; None for `auto` and `none`. It is compiled like any
    JSON schema (checked, then built in a compile worker)."""
    if isinstance(choice, NamedToolChoice):
        calls = [_call_schema(t) for t in tools if t.function.name == choice.function.name]
    elif choice == "required":
        calls = [_call_schema(t) for t in tools]
    else:
        return None
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return StructuredOutputsParams(json=schema, tool_call_tags=(START + "\n", "\n" + END))


def _call_schema(tool: Tool) -> dict[str, Any]:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"]}


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """The answer's text outside tool-call blocks, and the calls (a block that is not a
    JSON call with a name stays in the text). A block is read by its structure: the JSON
    value after the opening tag, then the closing tag, so a closing tag inside a string
    argument does not end it."""
    return split_calls(text, _read_block)


def split_calls(text: str, read_block: Callable[[str, int], tuple[ToolCall, int] | None]
                ) -> tuple[str, list[ToolCall]]:
    """The text outside the call blocks that `read_block` reads, and the calls, in either
    format: a block it cannot read (None) stays in the text, and the search goes on after
    its opening tag."""
    calls, kept, pos = [], [], 0
    while (start := text.find(START, pos)) >= 0:
        block = read_block(text, start)
        if block is None:
            kept.append(text[pos : start + len(START)])
            pos = start + len(START)
            continue
        call, end = block
        kept.append(text[pos:start])
        calls.append(call)
        pos = end
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


def _read_block(text: str, start: int) -> tuple[ToolCall, int] | None:
    """The call whose block opens at `start` and where the block ends; None if what follows
    the opening tag is not a JSON call and a closing tag (or is not complete yet). The
    arguments are their text as the model wrote it where the call reads `{"name": ...,
    "arguments": ...}` (what a stream sends piece by piece), else their JSON."""
    i = _skip_space(text, start + len(START))
    try:
        obj, i = _DECODER.raw_decode(text, i)
    except ValueError:
        return None
    i = _skip_space(text, i)
    if not text.startswith(END, i):
        return None
    call = _as_call(obj)
    if call is not None:
        head = _head(text, start)
        if head is not None and head[0] == call.name:
            call.arguments = _arguments_text(text, head[1]) or call.arguments
    return None if call is None else (call, i + len(END))


# how a call begins when its arguments can be streamed as they come: the name, then the arguments
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _head(text: str, start: int) -> tuple[str, int] | None:
    """The name of the call whose block opens at `start` and where its arguments begin,
    once that much is written in the usual order; else None."""
    match = _HEAD.match(text, start + len(START))
    if match is None:
        return None
    try:
        return json.loads(f'"{match.group(1)}"'), match.end()
    except ValueError:
        return None


def _arguments_text(text: str, at: int) -> str | None:
    """The arguments' JSON text from `at`, if it is complete (an object)."""
    try:
        value, end = _DECODER.raw_decode(text, at)
    except ValueError:
        return None
    return text[at:end] if isinstance(value, dict) else None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _as_call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


_DECODER = json.JSONDecoder()


class ToolCallStream:
    """Streams one choice of an answer with tools: text before a block goes out as content
    at once; a call goes out whole when its block closes; a possible start of a block is
    held back until it is known."""

    def __init__(self, forced: bool = False) -> None:
        self.sent = 0  # characters of the text consumed
        self.num_calls = 0
        self.forced = forced  # the answer is one forced call: an unfinished block is dropped, not text

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """The full text so far -> (new content, newly completed calls)."""
        content, calls = [], []
        while True:
            rest_start = self.sent
            start = text.find(START, rest_start)
            if start < 0:
                keep = 0 if final else _partial_start(text[rest_start:])
                content.append(text[rest_start : len(text) - keep])
                self.sent = len(text) - keep
                break
            content.append(text[rest_start:start])
            self.sent = start
            block = _read_block(text, start)
            if block is not None:
                call, end = block
                calls.append(call)
                self.sent = end
                continue
            if final or _cannot_become_call(text, start):
                # never a call: out as text, up to the next possible block
                content.append(START)
                self.sent = start + len(START)
                continue
            break  # the block is still open
        self.num_calls += len(calls)
        if self.forced:  # the grammar makes the whole answer the call: anything else is its markup, cut short
            return "", calls
        return "".join(content), calls

    def pending(self, text: str) -> tuple[str, str] | None:
        """The call being written (after `feed` held its block back): its name and its
        arguments so far, once the block reads as a call with its name first."""
        if not text.startswith(START, self.sent):
            return None
        head = _head(text, self.sent)
        if head is None:
            return None
        name, at = head
        return name, _arguments_text(text, at) or text[at:]


def _cannot_become_call(text: str, start: int) -> bool:
    """Whether the block opening at `start` is already known not to be a call: its JSON
    value is complete and something other than the closing tag follows it."""
    i = _skip_space(text, start + len(START))
    try:
        _, i = _DECODER.raw_decode(text, i)
    except ValueError:
        return i < len(text) and text[i] not in "{"  # a value that is not an object cannot be a call
    i = _skip_space(text, i)
    return i < len(text) and not END.startswith(text[i : i + len(END)])


def _partial_start(text: str) -> int:
    """How many characters at the end of text could begin a block."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
