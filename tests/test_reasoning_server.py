"""A thinking model behind `vlmserve serve --reasoning-parser qwen3`, driven by the official
`openai` client: reasoning apart from the content (whole and streamed), the thinking
budget, structured output after the reasoning, tool calls in both formats (`hermes`, and
`qwen3_xml` on a second server) for each tool_choice, streamed in OpenAI's shape, and a
`--chat-template` override."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import BaseModel

from test_openai_server import Server
from vlmserve.testing.thinking import THINKING_TEMPLATE, WEATHER_TOOL

TWO = [{"role": "user", "content": "What is two plus two?"}]
PARIS = [{"role": "user", "content": "Plan a trip to Paris as JSON."}]
WEATHER_PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_ROME = [{"role": "user", "content": "What is the weather in Rome?"}]
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "The time in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class Trip(BaseModel):
    city: str
    days: int


@pytest.fixture(scope="module")
def server(thinking_path):
    # fp32 on every CPU: "auto" runs bf16 where its matmuls are faster (AMX), and the tiny model's
    # near-tied logits would then pick other words
    s = Server(thinking_path, "--reasoning-parser", "qwen3", "--max-model-len", "1024", "--dtype", "float32")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def xml_server(thinking_path, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "marked.jinja"
    template.write_text("{%- if mark is defined %}MARK {% endif %}" + THINKING_TEMPLATE)
    s = Server(thinking_path, "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_xml", "--dtype", "float32",
               "--max-model-len", "1024", "--chat-template", str(template))
    yield s
    s.stop()


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning")


def streamed(client, **kwargs) -> tuple[str, str, list, list]:
    """(reasoning, content, tool-call deltas, chunks) of a streamed chat completion."""
    reasoning, content, calls, chunks = "", "", [], []
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        chunks.append(chunk)
        if chunk.choices:
            delta = chunk.choices[0].delta
            extra = delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")  # vLLM's field and its older name
            reasoning += extra.get("reasoning") or ""
            content += delta.content or ""
            calls += delta.tool_calls or []
    return reasoning, content, calls, chunks


def joined(deltas) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each streamed call, its deltas joined as the client joins them."""
    calls: dict[int, list] = {}
    for d in deltas:
        call = calls.setdefault(d.index, [None, None, ""])
        call[0] = call[0] or d.id
        call[1] = call[1] or (d.function.name if d.function else None)
        call[2] += (d.function.arguments or "") if d.function else ""
    return [tuple(calls[i]) for i in sorted(calls)]


def test_reasoning_apart_from_the_content_whole_and_streamed(server):
    client = server.client()
    done = client.chat.completions.create(model="tiny", messages=TWO, temperature=0)
    message = done.choices[0].message
    assert reasoning_of(message).startswith("Two plus two means adding") and message.content.strip() == \
        "The answer is four."
    assert (message.model_extra or {})["reasoning_content"] == reasoning_of(message)
    reasoning_tokens = done.usage.completion_tokens_details.reasoning_tokens
    assert 20 < reasoning_tokens < done.usage.completion_tokens
    reasoning, content, _, chunks = streamed(client, messages=TWO, temperature=0,
                                             stream_options={"include_usage": True})
    assert (reasoning, content) == (reasoning_of(message), message.content)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_tokens
    hidden = client.chat.completions.create(model="tiny", messages=TWO, temperature=0,
                                            extra_body={"include_reasoning": False})
    assert reasoning_of(hidden.choices[0].message) is None and hidden.choices[0].message.content == message.content
    off = client.chat.completions.create(model="tiny", messages=TWO, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning_of(off.choices[0].message) is None and off.choices[0].message.content == "Four."
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_thinking_budget_over_the_api(server):
    client = server.client()
    done = client.chat.completions.create(model="tiny", messages=TWO, temperature=0, n=2,
                                          extra_body={"thinking_token_budget": 3})
    assert done.usage.completion_tokens_details.reasoning_tokens == 6  # 3 for each of the two
    for choice in done.choices:
        assert choice.message.content.strip() == "The answer is four."
    reasoning, content, _, _ = streamed(client, messages=TWO, temperature=0, extra_body={"thinking_token_budget": 3})
    assert reasoning == reasoning_of(done.choices[0].message) and content == done.choices[0].message.content


def test_structured_output_starts_after_the_reasoning(server):
    client = server.client()
    parsed = client.chat.completions.parse(model="tiny", messages=PARIS, temperature=0, response_format=Trip, n=2)
    for choice in parsed.choices:
        assert choice.message.parsed == Trip(city="Paris", days=3)
        assert reasoning_of(choice.message).startswith("The city is Paris")
    schema = {"type": "json_schema", "json_schema": {"name": "trip", "schema": Trip.model_json_schema()}}
    reasoning, content, _, _ = streamed(client, messages=PARIS, temperature=0, response_format=schema)
    assert Trip.model_validate_json(content) == Trip(city="Paris", days=3) and reasoning
    choice = client.chat.completions.create(model="tiny", messages=TWO, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["three", "five"]}})
    assert choice.choices[0].message.content in ("three", "five") and reasoning_of(choice.choices[0].message)


def test_tool_calls_after_the_reasoning_for_each_tool_choice(server):
    client = server.client()
    auto = client.chat.completions.create(model="tiny", messages=WEATHER_PARIS, tools=[WEATHER_TOOL], temperature=0)
    choice = auto.choices[0]
    call = choice.message.tool_calls[0]
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and reasoning_of(choice.message)
    reasoning, content, deltas, chunks = streamed(client, messages=WEATHER_PARIS, tools=[WEATHER_TOOL],
                                                  temperature=0)
    assert reasoning == reasoning_of(choice.message) and not content.strip()
    ((call_id, name, arguments),) = joined(deltas)
    assert call_id and name == "get_weather" and arguments == call.function.arguments and len(deltas) > 1
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # required: over the trained prompt (one tool); named: a tool the model would not call
    for tool_choice, tools in (("required", [WEATHER_TOOL]),
                               ({"type": "function", "function": {"name": "get_time"}}, [WEATHER_TOOL, TIME_TOOL])):
        forced = client.chat.completions.create(model="tiny", messages=WEATHER_PARIS, temperature=0, tools=tools,
                                                tool_choice=tool_choice)
        message = forced.choices[0].message
        assert reasoning_of(message).startswith("The user wants")  # the grammar waited for the reasoning's end
        assert json.loads(message.tool_calls[0].function.arguments)["city"]
        if isinstance(tool_choice, dict):
            assert message.tool_calls[0].function.name == "get_time"
    none = client.chat.completions.create(model="tiny", messages=WEATHER_PARIS, tools=[WEATHER_TOOL], temperature=0,
                                          tool_choice="none", max_tokens=40)
    assert not none.choices[0].message.tool_calls
    follow_up = WEATHER_PARIS + [choice.message.model_dump(exclude_none=True),
                                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = client.chat.completions.create(model="tiny", messages=follow_up, tools=[WEATHER_TOOL], max_tokens=8)
    assert answer.usage.prompt_tokens > auto.usage.prompt_tokens


def test_xml_tool_calls_for_each_tool_choice(xml_server):
    client = xml_server.client()
    auto = client.chat.completions.create(model="tiny", messages=WEATHER_ROME, tools=[WEATHER_TOOL], temperature=0)
    message = auto.choices[0].message
    assert auto.choices[0].finish_reason == "tool_calls" and reasoning_of(message) and not message.content
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Rome"}
    _, content, deltas, _ = streamed(client, messages=WEATHER_ROME, tools=[WEATHER_TOOL], temperature=0)
    ((_, name, arguments),) = joined(deltas)
    assert name == "get_weather" and arguments == message.tool_calls[0].function.arguments and not content.strip()
    # (one tool: the prompt the model learnt; with another listed it may never close its reasoning, and
    # then, rightly, no grammar starts)
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = client.chat.completions.create(model="tiny", messages=WEATHER_ROME, temperature=0,
                                                tools=[WEATHER_TOOL], tool_choice=tool_choice)
        calls = forced.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        assert json.loads(calls[0].function.arguments) == {"city": "Rome"}
        _, _, deltas, _ = streamed(client, messages=WEATHER_ROME, temperature=0, tools=[WEATHER_TOOL],
                                   tool_choice=tool_choice)
        assert [(n, json.loads(a)) for _, n, a in joined(deltas)] == [
            (calls[0].function.name, json.loads(calls[0].function.arguments))]
    none = client.chat.completions.create(model="tiny", messages=WEATHER_ROME, tools=[WEATHER_TOOL], temperature=0,
                                          tool_choice="none", max_tokens=40)
    assert not none.choices[0].message.tool_calls


def test_the_chat_template_flag_replaces_the_checkpoints(xml_server):
    body = {"model": "tiny", "messages": TWO, "chat_template_kwargs": {"mark": True}, "return_token_strs": True}
    tokens = httpx.post(xml_server.base + "/tokenize", json=body).json()["tokens"]
    text = httpx.post(xml_server.base + "/detokenize", json={"model": "tiny", "tokens": tokens}).json()["prompt"]
    assert text.startswith("MARK <|im_start|>user\nWhat is two plus two?")
