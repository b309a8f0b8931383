"""How an answer's text reads in a response: a thinking model's reasoning apart from its
content (`--reasoning-parser`), the tool calls out of the content (`--tool-call-parser`),
whole or streamed. Shared by chat completions and the Responses API."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmserve.entrypoints.openai.responses import usage
from vlmserve.entrypoints.openai.tool_calls import ToolCall
from vlmserve.entrypoints.openai.tool_parsers import ToolDeltaStream, ToolParser
from vlmserve.outputs import RequestOutput
from vlmserve.reasoning.parsers import ReasoningParser, ReasoningStream


@dataclass
class Answer:
    reasoning: str | None
    content: str
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Delta:
    """What a streamed answer adds in one chunk."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's tool_calls deltas
    completed: list[ToolCall] = field(default_factory=list)  # the calls whose block closed


@dataclass
class AnswerReader:
    """One request's reading: its reasoning (None: the whole answer is content) and its
    tools (None: no calls are read; `forced`: the answer is one call, by its grammar)."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    forced: bool = False

    @classmethod
    def of(cls, parser: ReasoningParser | None, chat_template_kwargs: dict[str, Any] | None,
           prompt_token_ids: list[int], tools: ToolParser | None = None, forced: bool = False) -> AnswerReader:
        """A request's reader: reasoning only where the parser is on and the request
        reasons (not turned off, not closed by its prompt)."""
        reasons = parser is not None and parser.reasons(chat_template_kwargs, prompt_token_ids)
        return cls(parser if reasons else None, tools, forced)

    def read(self, text: str) -> Answer:
        """A finished answer (a forced call cut short is no call, and no text either)."""
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text)
        content = content or ""
        if self.tools is None:
            return Answer(reasoning, content)
        rest, calls = self.tools.parse(content)
        if not calls and self.forced:
            rest = ""
        return Answer(reasoning, rest if calls else content, calls)

    def stream(self) -> AnswerStream:
        return AnswerStream(self)


class AnswerStream:
    """One streamed choice: each call takes the whole text so far."""

    def __init__(self, reader: AnswerReader) -> None:
        self.reasoning = None if reader.reasoning is None else ReasoningStream(reader.reasoning, True)
        self.tools = None if reader.tools is None else ToolDeltaStream(reader.tools.stream(reader.forced))
        self.content = ""  # the content so far (the tool parser reads it whole)

    @property
    def num_calls(self) -> int:
        return 0 if self.tools is None else self.tools.done

    def feed(self, text: str, final: bool) -> Delta:
        delta = Delta()
        new_content = text[len(self.content) :] if self.reasoning is None else ""
        if self.reasoning is not None:
            delta.reasoning, new_content = self.reasoning.feed(text, final)
        self.content += new_content
        if self.tools is None:
            delta.content = new_content
            return delta
        delta.content, delta.tool_calls, delta.completed = self.tools.feed(self.content, final)
        return delta


def usage_with_reasoning(outs: list[RequestOutput], parser: ReasoningParser | None,
                         chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The usage of a request, with its reasoning tokens (OpenAI's completion_tokens_details)
    where the server reads reasoning."""
    body = usage(outs)
    if parser is not None:
        thinking = parser.thinking(chat_template_kwargs)
        body["completion_tokens_details"] = {"reasoning_tokens": sum(
            parser.reasoning_tokens(out.prompt_token_ids, c.token_ids, thinking) for out in outs for c in out.outputs)}
    return body
