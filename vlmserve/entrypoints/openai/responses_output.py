"""A response of the Responses API as OpenAI writes it: its output items (a thinking
model's reasoning, the message, the function calls), its status and usage."""

from __future__ import annotations

import uuid
from typing import Any

from vlmserve.entrypoints.openai.answers import Answer
from vlmserve.entrypoints.openai.responses_protocol import ResponsesRequest
from vlmserve.outputs import RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [output_text(text)] if status != "in_progress" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(answer: Answer, incomplete: bool) -> list[dict[str, Any]]:
    """A finished answer's items: its reasoning, its message (unless it is only calls),
    its calls."""
    status = "incomplete" if incomplete else "completed"
    items = []
    if answer.reasoning is not None:
        items.append(reasoning_item(new_id("rs"), answer.reasoning))
    if answer.content or not answer.calls:
        items.append(message_item(new_id("msg"), answer.content, status))
    items += [call_item(new_id("fc"), c.id, c.name, c.arguments) for c in answer.calls]
    return items


def calls_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [item for item in items if item["type"] == "function_call"]


def text_of(items: list[dict[str, Any]]) -> str:
    """The messages' text (output_text in the SDK)."""
    return "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])


def usage_of(out: RequestOutput, reasoning_tokens: int) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"input_tokens": out.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": out.num_prompt_tokens + completion}


def skeleton(req: ResponsesRequest, response_id: str, created: float, model: str) -> dict[str, Any]:
    """The response's fields that its request decides (status, output and usage come later)."""
    choice = req.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": created, "status": "in_progress", "background": False,
        "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store, "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                            if req.text is not None and req.text.format is not None else {"type": "text"})},
        "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
        "tools": [{**t, "strict": t.get("strict")} for t in req.function_tools],
        "truncation": req.truncation or "disabled", "usage": None, "user": req.user, "metadata": req.metadata or {},
    }


def finished(body: dict[str, Any], items: list[dict[str, Any]], out: RequestOutput, reasoning_tokens: int
             ) -> dict[str, Any]:
    """The response once its answer is done: completed, or incomplete when max_output_tokens
    cut it short."""
    cut = any(c.finish_reason == "length" for c in out.outputs)
    return {**body, "status": "incomplete" if cut else "completed", "output": items,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": usage_of(out, reasoning_tokens)}
