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
from dataclasses import dataclass, field
from typing import Any

import xgrammar as xgr

from vlmserve.entrypoints.openai.protocol import NamedToolChoice, Tool
from vlmserve.sampling_params import ParamError, StructuredOutputsParams
from vlmserve.structured_output.grammar import json_schema_grammar

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"\s*(.*?)\s*" + re.escape(END), re.DOTALL)


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


def constraint(tools: list[Tool], choice: str | NamedToolChoice | None) -> StructuredOutputsParams | None:
    """The grammar of `required` (one call of any tool) or a named choice (one call of
    that tool); None for `auto` and `none`."""
    if isinstance(choice, NamedToolChoice):
        calls = [_call_schema(t) for t in tools if t.function.name == choice.function.name]
    elif choice == "required":
        calls = [_call_schema(t) for t in tools]
    else:
        return None
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        call = json_schema_grammar(schema)
    except Exception as e:
        raise ParamError("tools", f"a tool's parameters are not a valid JSON schema: {e}") from None
    grammar = xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(START + chr(10))}"), call,
                                 xgr.Grammar.from_ebnf(f"root ::= {json.dumps(chr(10) + END)}"))
    return StructuredOutputsParams(grammar=str(grammar))


def _call_schema(tool: Tool) -> dict[str, Any]:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"]}


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """The answer's text outside tool-call blocks, and the calls (a block that is not a
    JSON call with a name stays in the text)."""
    calls, kept, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _parse_call(m.group(1))
        if call is None:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return "".join(kept).strip() if calls else text, calls


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


class ToolCallStream:
    """Streams one choice of an answer with tools: text before a block goes out as content
    at once; a call goes out whole when its block closes; a possible start of a block is
    held back until it is known."""

    def __init__(self) -> None:
        self.sent = 0  # characters of the text consumed
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """The full text so far -> (new content, newly completed calls)."""
        content, calls = [], []
        while True:
            rest = text[self.sent :]
            start = rest.find(START)
            if start < 0:
                keep = 0 if final else _partial_start(rest)
                content.append(rest[: len(rest) - keep])
                self.sent += len(rest) - keep
                break
            content.append(rest[:start])
            m = _BLOCK.match(rest, start)
            if m is None:  # the block is still open
                self.sent += start
                if final:
                    content.append(rest[start:])
                    self.sent = len(text)
                break
            call = _parse_call(m.group(1))
            if call is None:
                content.append(m.group(0))
            else:
                calls.append(call)
            self.sent += m.end()
        self.num_calls += len(calls)
        return "".join(content), calls


def _partial_start(text: str) -> int:
    """How many characters at the end of text could begin a block."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
