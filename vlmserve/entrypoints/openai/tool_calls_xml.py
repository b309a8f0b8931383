"""Tool calls in Qwen's XML form (vLLM's `qwen3_xml` and `qwen3_coder` parsers: Qwen3-Coder,
Qwen3.5):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it is converted by the type the tool's schema gives it, as
vLLM converts it (a string stays text; integers, numbers and booleans are read; objects
and arrays as JSON), and the arguments sent as the JSON object of the values."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from vlmserve.entrypoints.openai.protocol import NamedToolChoice, Tool
from vlmserve.entrypoints.openai.tool_calls import END, START, ToolCall, split_calls
from vlmserve.sampling_params import StructuredOutputsParams
from vlmserve.structured_output.xml_calls import is_text_parameter

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?")
_FUNCTION_END = re.compile(r"\s*</function>\s*")


class XmlToolCalls:
    """Reads and constrains calls of the request's tools in the XML form."""

    def __init__(self, tools: list[Tool]) -> None:
        self.schemas = {t.function.name: (t.function.parameters or {}).get("properties") or {} for t in tools}

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The text outside complete call blocks, and the calls (a block that does not read
        as a call stays text)."""
        return split_calls(text, self.read_block)

    def read_block(self, text: str, start: int) -> tuple[ToolCall, int] | None:
        """The call whose block opens at `start`, and where the block ends; None if it is
        not a complete call."""
        read = self.read_call(text, start)
        if read is None or not read.closed:
            return None
        end = text.find(END, read.end)
        if end < 0 or text[read.end : end].strip():
            return None
        return ToolCall(read.name, read.arguments(closed=True)), end + len(END)

    def read_call(self, text: str, start: int) -> _Call | None:
        """As much of the call opening at `start` as is written: its name and the
        parameters whose values are complete."""
        function = _FUNCTION.match(text, start + len(START))
        if function is None:
            return None
        call = _Call(function.group(1).strip(), {}, function.end(), False)
        pos = function.end()
        while True:
            done = _FUNCTION_END.match(text, pos)
            if done is not None:
                call.closed, call.end = True, done.end()
                return call
            parameter = _PARAMETER.match(text, pos)
            if parameter is None:
                return call
            close = text.find("</parameter>", parameter.end())
            if close < 0:
                return call
            name, value = parameter.group(1).strip(), text[parameter.end() : close]
            call.values[name] = self.convert(call.name, name, value[:-1] if value.endswith("\n") else value)
            pos = call.end = close + len("</parameter>")

    def convert(self, function: str, name: str, value: str) -> Any:
        """A parameter's text as the type its schema gives it (vLLM's conversion)."""
        schema = self.schemas.get(function, {}).get(name)
        if not isinstance(schema, dict) or is_text_parameter(schema) or not schema:
            return value
        kind = str(schema.get("type", "")).lower()
        if kind in ("str", "text"):
            return value
        if value.lower() in ("null", "none"):
            return None
        try:
            if kind.startswith("int"):
                return int(value)
            if kind.startswith("num") or kind.startswith("float"):
                number = float(value)
                return int(number) if number.is_integer() else number
            if kind in ("boolean", "bool"):
                return value.strip().lower() == "true"
            return json.loads(value)
        except ValueError:
            try:
                return ast.literal_eval(value)
            except (ValueError, SyntaxError):
                return value

    def constraint(self, tools: list[Tool], choice: str | NamedToolChoice | None) -> StructuredOutputsParams | None:
        """One call in the XML form, of the named tool or (required) of any."""
        if isinstance(choice, NamedToolChoice):
            chosen = [t for t in tools if t.function.name == choice.function.name]
        elif choice == "required":
            chosen = tools
        else:
            return None
        calls = [{"type": "object", "properties": {
            "name": {"const": t.function.name},
            "arguments": t.function.parameters or {"type": "object", "properties": {}}},
            "required": ["name", "arguments"]} for t in chosen]
        return StructuredOutputsParams(json={"anyOf": calls}, tool_call_xml=True)


class _Call:
    """A call as far as it is written."""

    def __init__(self, name: str, values: dict[str, Any], end: int, closed: bool) -> None:
        self.name, self.values, self.end, self.closed = name, values, end, closed

    def arguments(self, closed: bool) -> str:
        """The arguments' JSON, or its beginning while the call is open (each complete
        parameter added as it is written: the stream sends what is new)."""
        body = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                               for k, v in self.values.items())
        return body + "}" if closed else body


class XmlToolCallStream:
    """Streams one choice's calls in the XML form: text before a block goes out at once; a
    block is held back while it may become a call, and reported as it grows (`pending`)."""

    def __init__(self, reader: XmlToolCalls, forced: bool = False) -> None:
        self.reader = reader
        self.forced = forced
        self.sent = 0
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        while True:
            start = text.find(START, self.sent)
            if start < 0:
                keep = 0 if final else _partial_start(text[self.sent :])
                content.append(text[self.sent : len(text) - keep])
                self.sent = len(text) - keep
                break
            content.append(text[self.sent : start])
            self.sent = start
            block = self.reader.read_block(text, start)
            if block is not None:
                calls.append(block[0])
                self.sent = block[1]
                continue
            if final or self._cannot_become_call(text, start):
                content.append(START)
                self.sent = start + len(START)
                continue
            break
        self.num_calls += len(calls)
        return ("" if self.forced else "".join(content)), calls

    def _cannot_become_call(self, text: str, start: int) -> bool:
        rest = text[start + len(START) :].lstrip()
        return bool(rest) and not ("<function=".startswith(rest[:10]) or rest.startswith("<function="))

    def pending(self, text: str) -> tuple[str, str] | None:
        if not text.startswith(START, self.sent):
            return None
        call = self.reader.read_call(text, self.sent)
        return None if call is None else (call.name, call.arguments(closed=False))


def _partial_start(text: str) -> int:
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
