"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}: a
conversation turn over the same engine as chat completions — the input rendered by the
chat template (earlier turns from previous_response_id), answered as output items
(reasoning, message, function calls), streamed as OpenAI's events, kept in memory when
`store` is on."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from vlmserve.entrypoints.openai.answers import AnswerReader
from vlmserve.entrypoints.openai.protocol import OpenAIError
from vlmserve.entrypoints.openai.responses_events import EventWriter
from vlmserve.entrypoints.openai.responses_input import (assistant_turn, chat_messages, chat_tools,
                                                         input_messages)
from vlmserve.entrypoints.openai.responses_output import (calls_of, finished, new_id, output_items, skeleton,
                                                          text_of)
from vlmserve.entrypoints.openai.responses_protocol import ResponsesRequest
from vlmserve.entrypoints.openai.responses_store import ResponseStore
from vlmserve.engine.async_llm import EngineDeadError
from vlmserve.entrypoints.openai.serving import ServingBase, Started, output_error
from vlmserve.entrypoints.openai.tool_calls import check_tools, template_tools
from vlmserve.entrypoints.openai.tool_parsers import tool_parser
from vlmserve.outputs import RequestOutput
from vlmserve.sampling_params import ParamError

logger = logging.getLogger(__name__)


class ServingResponses(ServingBase):
    def __init__(self, engine, models, tool_call_parser: str = "hermes", store: ResponseStore | None = None) -> None:
        super().__init__(engine, models)
        self.tool_call_parser = tool_call_parser
        self.store = store or ResponseStore()

    async def create(self, req: ResponsesRequest, request: Request):
        lora = self.check(req)
        if req.background:
            raise OpenAIError(400, "background responses are not supported: send the request without background "
                                   "(stream it to see the answer as it comes)", param="background")
        if req.n != 1:
            raise OpenAIError(400, "the Responses API answers once (n must be 1)", param="n")
        history = self._history(req.previous_response_id)
        messages = input_messages(req)
        tools, choice = chat_tools(req)
        prompt, params = self._prompt_and_params(req, chat_messages(req.instructions, history, messages), tools, choice)
        response_id = new_id("resp")
        (started,) = await self.start_all(response_id, [prompt], params, req, request, lora)
        forced = tools is not None and choice not in (None, "auto")
        reader = AnswerReader.of(self.engine.reasoning, req.chat_template_kwargs, started.first.prompt_token_ids,
                                 tool_parser(self.tool_call_parser, tools) if tools and choice != "none" else None,
                                 forced)
        body = skeleton(req, response_id, time.time(), self.models.name_of(lora))
        conversation = history + messages
        if req.stream:
            return StreamingResponse(self._events(req, started, reader, body, conversation),
                                     media_type="text/event-stream")
        (out,) = await self.final([started], request)
        answer = reader.read(out.outputs[0].text)
        incomplete = out.outputs[0].finish_reason == "length"
        response = finished(body, output_items(answer, incomplete), out, self._reasoning_tokens(req, out))
        self._keep(req, response, conversation)
        return response

    async def retrieve(self, response_id: str):
        return self._stored(response_id).body

    async def delete(self, response_id: str):
        self._stored(response_id)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    # -- the request ----------------------------------------------------------------------------
    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        return list(self._stored(previous_response_id, "previous_response_id").conversation)

    def _stored(self, response_id: str, param: str | None = None):
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(404, f"Response with id '{response_id}' not found.", param=param)
        return stored

    def _prompt_and_params(self, req: ResponsesRequest, messages: list[dict[str, Any]], tools, choice):
        try:
            check_tools(tools or [])
        except ParamError as e:
            raise OpenAIError(400, str(e), param=e.param) from None
        uses_tools = tools is not None and choice != "none"
        try:
            prompt = self.engine.render_chat(messages, True, req.chat_template_kwargs,
                                             template_tools(tools) if uses_tools else None)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="input") from None
        prompt.mm_processor_kwargs = dict(req.mm_processor_kwargs or {})
        prompt.truncate_prompt_tokens = self.truncation(req)
        max_tokens = req.max_output_tokens if req.max_output_tokens is not None else req.max_tokens
        params = self.params(req, max_tokens, None, default_max=None, max_tokens_field="max_output_tokens")
        if uses_tools:
            forced = tool_parser(self.tool_call_parser, tools).constraint(choice)
            if forced is not None and params.structured_outputs is not None:
                raise OpenAIError(400, "a required or named tool_choice cannot be combined with text.format",
                                  param="tool_choice")
            if forced is not None:
                params = dataclasses.replace(params, structured_outputs=forced)
        return prompt, params

    # -- the answer ------------------------------------------------------------------------------
    def _reasoning_tokens(self, req: ResponsesRequest, out: RequestOutput) -> int:
        parser = self.engine.reasoning
        if parser is None:
            return 0
        thinking = parser.thinking(req.chat_template_kwargs)
        return parser.reasoning_tokens(out.prompt_token_ids, out.outputs[0].token_ids, thinking)

    def _keep(self, req: ResponsesRequest, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if req.store:
            items = response["output"]
            self.store.put(response["id"], response, conversation + [assistant_turn(text_of(items), calls_of(items))])

    async def _events(self, req: ResponsesRequest, started: Started, reader: AnswerReader, body: dict[str, Any],
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        writer = EventWriter(body)
        stream = reader.stream()
        out = started.first
        try:
            for event in writer.opening():
                yield event
            async for out in _outputs(started):
                c = out.outputs[0]
                for event in writer.feed(stream.feed(c.text, final=c.finish_reason is not None)):
                    yield event
            if out.error or out.outputs[0].finish_reason == "error":
                yield writer.event("error", code=None, message=output_error(out).message, param=None)
                return
            for event in writer.closing(finished(body, [], out, self._reasoning_tokens(req, out))):
                yield event
            self._keep(req, writer.body, conversation)
        except EngineDeadError as e:
            yield writer.event("error", code=None, message=str(e), param=None)
        finally:
            await started.gen.aclose()  # a client that hung up: aborts the request


async def _outputs(started: Started) -> AsyncIterator[RequestOutput]:
    """A request's outputs as they come, its first one first."""
    yield started.first
    if not started.first.finished:
        async for out in started.gen:
            yield out
