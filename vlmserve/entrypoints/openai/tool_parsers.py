"""The tool-call formats `--tool-call-parser` chooses among (vLLM's names): `hermes`, the
JSON calls of Qwen2.5-VL and Qwen3-VL (tool_calls.py), and `qwen3_xml` / `qwen3_coder`,
the XML calls of Qwen3-Coder and Qwen3.5 (tool_calls_xml.py). Each reads an answer's calls,
streams them, and constrains a forced call (`tool_choice` required or named); the calls
stream in OpenAI's shape: a call's id, type and name first, then its arguments piece by
piece."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from vlmserve.entrypoints.openai import tool_calls
from vlmserve.entrypoints.openai.protocol import NamedToolChoice, Tool
from vlmserve.entrypoints.openai.tool_calls import ToolCall
from vlmserve.entrypoints.openai.tool_calls_xml import XmlToolCalls, XmlToolCallStream
from vlmserve.sampling_params import StructuredOutputsParams

TOOL_PARSERS = ("hermes", "qwen3_xml", "qwen3_coder")


class CallStream(Protocol):
    num_calls: int

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """The whole text so far -> (new content, newly completed calls)."""

    def pending(self, text: str) -> tuple[str, str] | None:
        """The call being written: its name and its arguments so far."""


@dataclass
class ToolParser:
    """One request's reading of tool calls: its tools, in the server's format."""

    name: str
    tools: list[Tool]

    def __post_init__(self) -> None:
        self._xml = XmlToolCalls(self.tools) if self.name != "hermes" else None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return tool_calls.parse(text) if self._xml is None else self._xml.parse(text)

    def stream(self, forced: bool) -> CallStream:
        if self._xml is None:
            return tool_calls.ToolCallStream(forced=forced)
        return XmlToolCallStream(self._xml, forced=forced)

    def constraint(self, choice: str | NamedToolChoice | None) -> StructuredOutputsParams | None:
        if self._xml is None:
            return tool_calls.constraint(self.tools, choice)
        return self._xml.constraint(self.tools, choice)


def tool_parser(name: str, tools: list[Tool]) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name}: vlmserve has {', '.join(TOOL_PARSERS)}")
    return ToolParser(name, tools)


@dataclass
class _Open:
    """A call whose header went out: its id and how much of its arguments."""

    id: str
    sent: int = 0


@dataclass
class ToolDeltaStream:
    """A choice's calls as OpenAI streams them, over a parser's stream: the id, type and
    name of a call as soon as its name is written, then what is new of its arguments."""

    calls: CallStream
    open: dict[int, _Open] = field(default_factory=dict)
    done: int = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]], list[ToolCall]]:
        """(new content, the tool_calls deltas of this chunk, the calls completed)."""
        content, completed = self.calls.feed(text, final)
        deltas: dict[int, dict[str, Any]] = {}
        for call in completed:
            self._send(deltas, self.done, call.name, call.arguments, call)
            self.open.pop(self.done, None)
            self.done += 1
        pending = None if final else self.calls.pending(text)
        if pending is not None:
            self._send(deltas, self.done, *pending)
        return content, [deltas[i] for i in sorted(deltas)], completed

    def _send(self, deltas: dict[int, dict[str, Any]], index: int, name: str, arguments: str,
              call: ToolCall | None = None) -> None:
        entry = self.open.get(index)
        if entry is None:
            entry = self.open[index] = _Open(call.id if call is not None else ToolCall(name, "").id)
            deltas[index] = {"index": index, "id": entry.id, "type": "function",
                             "function": {"name": name, "arguments": ""}}
        if call is not None:
            call.id = entry.id  # the id the stream announced
        new = arguments[entry.sent :]
        if new:
            delta = deltas.setdefault(index, {"index": index, "function": {}})
            delta["function"]["arguments"] = delta["function"].get("arguments", "") + new
            entry.sent = len(arguments)
