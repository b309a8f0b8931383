"""POST /v1/chat/completions: messages (pictures, videos, tools) rendered by the
checkpoint's chat template, answered as OpenAI's and vLLM's clients expect — tool calls
parsed out of the answer, vLLM's extensions (echo, continue_final_message,
prompt_logprobs, return_token_ids, continuous usage) honoured."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from vlmserve.engine.input_processor import PromptInput
from vlmserve.entrypoints.openai import tool_calls
from vlmserve.entrypoints.openai.answers import AnswerReader, AnswerStream, usage_with_reasoning
from vlmserve.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError
from vlmserve.entrypoints.openai.responses import ResponseShaper
from vlmserve.entrypoints.openai.serving import ServingBase, Started
from vlmserve.entrypoints.openai.tool_parsers import ToolParser, tool_parser
from vlmserve.outputs import CompletionOutput, RequestOutput
from vlmserve.sampling_params import ParamError


class ServingChat(ServingBase):
    def __init__(self, engine, models, tool_call_parser: str = "hermes") -> None:
        super().__init__(engine, models)
        self.tool_call_parser = tool_call_parser  # --tool-call-parser: the format of the model's calls

    async def create(self, req: ChatCompletionRequest, request: Request):
        lora = self.check(req)
        prompt, params = self._prompt_and_params(req)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        (started,) = await self.start_all(request_id, [prompt], params, req, request, lora)
        shaper = ResponseShaper(self.engine.tokenizer, req.return_tokens_as_token_ids)
        echo = self._echoed(req)
        base = {"id": request_id, "created": int(time.time()), "model": self.models.name_of(lora)}
        reader = AnswerReader.of(self.engine.reasoning, req.chat_template_kwargs, started.first.prompt_token_ids,
                                 self._tools(req), req.forces_tool_call)
        if req.stream:
            return StreamingResponse(self._stream(req, started, shaper, echo, base, reader),
                                     media_type="text/event-stream")
        (final,) = await self.final([started], request)
        body = {**base, "object": "chat.completion",
                "choices": [self._choice(req, c, shaper, echo, reader) for c in final.outputs],
                "usage": self._usage(req)([final])}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = shaper.prompt_logprobs(final.prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = final.prompt_token_ids
        return body

    # -- the request ----------------------------------------------------------------------------
    def _prompt_and_params(self, req: ChatCompletionRequest) -> tuple[PromptInput, Any]:
        """The prompt (the chat template's rendering, tools included) and the sampling
        params (a forced tool call's grammar among them) of a chat request."""
        tools = tool_calls.template_tools(req.tools) if req.uses_tools else None
        try:
            tool_calls.check_tools(req.tools or [])
        except ParamError as e:
            raise OpenAIError(400, str(e), param=e.param) from None
        try:
            prompt = self.engine.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools,
                                             continue_final_message=req.continue_final_message)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        prompt.mm_processor_kwargs = dict(req.mm_processor_kwargs or {})
        prompt.truncate_prompt_tokens = self.truncation(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.params(req, max_tokens, logprobs, default_max=None, max_tokens_field=field)
        if req.uses_tools:
            forced = self._tools(req).constraint(req.tool_choice)
            if forced is not None and params.structured_outputs is not None:
                raise OpenAIError(400, "a required or named tool_choice cannot be combined with response_format",
                                  param="tool_choice")
            params = dataclasses.replace(params, structured_outputs=forced or params.structured_outputs)
        return prompt, params

    def _tools(self, req: ChatCompletionRequest) -> ToolParser | None:
        """The reading of the request's tool calls (None: it uses no tools)."""
        return tool_parser(self.tool_call_parser, req.tools) if req.uses_tools else None

    def _usage(self, req: ChatCompletionRequest):
        return lambda outs: usage_with_reasoning(outs, self.engine.reasoning, req.chat_template_kwargs)

    @staticmethod
    def _echoed(req: ChatCompletionRequest) -> str:
        """With echo: the last message's text, when it is in the answer's role (the answer
        continues it); else nothing."""
        last = req.messages[-1]
        if not req.echo or last.get("role") != req.response_role:
            return ""
        content = last.get("content") or ""
        if isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        return content if isinstance(content, str) else ""

    # -- the answer ------------------------------------------------------------------------------
    def _choice(self, req: ChatCompletionRequest, c: CompletionOutput, shaper: ResponseShaper,
                echo: str, reader: AnswerReader) -> dict[str, Any]:
        """A finished choice as a chat message (a thinking model's reasoning apart; its tool
        calls parsed out of the content; a forced call cut short by max_tokens is no call,
        and no text either)."""
        answer = reader.read(c.text)
        message: dict[str, Any] = {"role": req.response_role, "content": echo + answer.content}
        if self.engine.reasoning is not None:  # vLLM's field, and its older name
            reasoning = answer.reasoning if req.include_reasoning else None
            message["reasoning"] = message["reasoning_content"] = reasoning
        finish_reason = c.finish_reason
        if answer.calls:
            message["content"] = (echo + answer.content) or None
            message["tool_calls"] = [call.message() for call in answer.calls]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choice = {"index": c.index, "message": message, "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                  "logprobs": None if c.logprobs is None else shaper.chat_logprobs(c.logprobs)}
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids
        return choice

    def _stream(self, req: ChatCompletionRequest, started: Started, shaper: ResponseShaper, echo: str,
                base: dict[str, Any], reader: AnswerReader):
        base = {**base, "object": "chat.completion.chunk"}
        first = started.first
        final_usage, continuous = req.include_usage()
        preamble = []
        for c in first.outputs:  # the role of each choice, then what it echoes
            opening: dict[str, Any] = {"choices": [{"index": c.index, "delta": {"role": req.response_role,
                                                                                 "content": ""},
                                                    "finish_reason": None, "logprobs": None}]}
            if continuous:
                opening["usage"] = {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": 0,
                                    "total_tokens": first.num_prompt_tokens}
            if req.return_token_ids and c.index == 0:
                opening["prompt_token_ids"] = first.prompt_token_ids
            preamble.append(opening)
            if echo:
                preamble.append({"choices": [{"index": c.index, "delta": {"content": echo}, "finish_reason": None,
                                              "logprobs": None}]})
        return self.stream([started], base, self._chunker(req, shaper, reader), (final_usage, continuous), preamble,
                           self._usage(req))

    @staticmethod
    def _chunker(req: ChatCompletionRequest, shaper: ResponseShaper, reader: AnswerReader):
        """Shapes each streamed choice: new reasoning, new content, and tool calls as they
        are written (a call's name, then its arguments piece by piece)."""
        streams: dict[int, AnswerStream] = {}

        def chunk(c: CompletionOutput, out: RequestOutput, text: str, new_from: int, index: int) -> dict[str, Any]:
            logprobs = None
            if c.logprobs is not None and len(c.token_ids) > new_from:
                logprobs = shaper.chat_logprobs(c.logprobs[new_from:])
            stream = streams.setdefault(c.index, reader.stream())
            new = stream.feed(c.text, final=c.finish_reason is not None)
            delta: dict[str, Any] = {"content": new.content} if new.content else {}
            if new.reasoning and req.include_reasoning:
                delta["reasoning"] = delta["reasoning_content"] = new.reasoning
            if new.tool_calls:
                delta["tool_calls"] = new.tool_calls
            finish_reason = c.finish_reason
            if finish_reason == "stop" and stream.num_calls:
                finish_reason = "tool_calls"
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
            if finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids[new_from:]
            return choice

        return chunk
