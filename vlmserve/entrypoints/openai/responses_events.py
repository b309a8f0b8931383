"""A streamed response's events, in OpenAI's order: response.created and
response.in_progress; then each output item in turn — output_item.added, its content part
added, its deltas (reasoning_text, output_text or function_call_arguments), their done
event, the part done, output_item.done; then response.completed (or .incomplete). Each
event carries a sequence_number."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vlmserve.entrypoints.openai.answers import Delta
from vlmserve.entrypoints.openai.responses_output import (call_item, message_item, new_id, output_text,
                                                          reasoning_item)


@dataclass
class _Item:
    """The item being streamed."""

    kind: str  # reasoning, message or call
    item: dict[str, Any]
    index: int  # its output_index
    text: str = ""  # its text so far (a call's arguments)
    call: int | None = None  # a call's index among the answer's calls


@dataclass
class EventWriter:
    body: dict[str, Any]  # the response as it stands (no output yet)
    seq: int = 0
    items: list[dict[str, Any]] = field(default_factory=list)  # the finished items
    current: _Item | None = None
    space: str = ""  # white space between items, held back: a message starts at its first word

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def opening(self) -> list[str]:
        return [self.event("response.created", response=self.body),
                self.event("response.in_progress", response=self.body)]

    def feed(self, delta: Delta) -> list[str]:
        events: list[str] = []
        if delta.reasoning:
            events += self._open("reasoning")
            events += self._append(delta.reasoning)
        content = self.space + delta.content
        if content.strip():
            self.space = ""
            events += self._open("message")
            events += self._append(content)
        else:
            self.space = content
        for call in delta.tool_calls:
            if "id" in call:
                events += self._open("call", call)
            events += self._append(call["function"].get("arguments", ""))
        return events

    def closing(self, finished: dict[str, Any]) -> list[str]:
        """The last item's end, and the response's (its output is the items streamed)."""
        status = "incomplete" if finished["status"] == "incomplete" else "completed"
        events: list[str] = []
        if not self.items and self.current is None:  # an empty answer is an empty message
            events += self._open("message") + self._append(self.space)
        events += self._close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        self.body = {**finished, "output": list(self.items)}
        return events + [self.event(kind, response=self.body)]

    def _open(self, kind: str, call: dict[str, Any] | None = None) -> list[str]:
        if self.current is not None and self.current.kind == kind and kind != "call":
            return []
        events = self._close()
        index = len(self.items)
        if kind == "reasoning":
            item, part = reasoning_item(new_id("rs"), "", "in_progress"), {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            item, part = message_item(new_id("msg"), "", "in_progress"), output_text("")
        else:
            item, part = call_item(new_id("fc"), call["id"], call["function"]["name"], "", "in_progress"), None
        self.current = _Item(kind, item, index, call=None if call is None else call["index"])
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        if part is not None:
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        return events

    def _append(self, text: str) -> list[str]:
        current = self.current
        if not text or current is None:
            return []
        current.text += text
        where = {"item_id": current.item["id"], "output_index": current.index}
        if current.kind == "reasoning":
            return [self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)]
        if current.kind == "message":
            return [self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])]
        return [self.event("response.function_call_arguments.delta", **where, delta=text)]

    def _close(self, status: str = "completed") -> list[str]:
        current, self.current = self.current, None
        if current is None:
            return []
        where = {"item_id": current.item["id"], "output_index": current.index}
        item_id, text = current.item["id"], current.text
        if current.kind == "reasoning":
            done = reasoning_item(item_id, text)
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=text),
                      self.event("response.content_part.done", **where, content_index=0, part=done["content"][0])]
        elif current.kind == "message":
            done = message_item(item_id, text, status)
            events = [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=done["content"][0])]
        else:
            item = current.item
            done = call_item(item_id, item["call_id"], item["name"], text)
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)]
        self.items.append(done)
        return events + [self.event("response.output_item.done", output_index=current.index, item=done)]
