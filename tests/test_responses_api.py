"""/v1/responses (OpenAI's Responses API) on a thinking model behind `vlmserve serve`, through
the official client's `responses.create`, `.stream` and `.parse`: reasoning items, text
and pictures in, instructions, max_output_tokens, text.format schemas, function tools and
their results, the events in OpenAI's order, previous_response_id and store, and the
errors (OpenAI's format) for what it does not take."""

from __future__ import annotations

import httpx
import openai
import pytest
from pydantic import BaseModel

from conftest import data_url, make_image
from test_openai_server import KEY, Server
from vlmserve.testing.thinking import WEATHER_TOOL

TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat form


class Trip(BaseModel):
    city: str
    days: int


@pytest.fixture(scope="module")
def server(thinking_path):
    s = Server(thinking_path, "--reasoning-parser", "qwen3", "--max-model-len", "1024", "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_a_thinking_models_answer_is_a_reasoning_item_then_a_message(client):
    response = client.responses.create(model="tiny", input="What is two plus two?", temperature=0)
    assert response.status == "completed" and [item.type for item in response.output] == ["reasoning", "message"]
    reasoning = response.output[0].content[0].text
    assert reasoning.startswith("Two plus two means adding") and response.output_text.strip() == \
        "The answer is four."
    usage = response.usage
    assert usage.output_tokens_details.reasoning_tokens > 20 and usage.total_tokens == \
        usage.input_tokens + usage.output_tokens
    instructed = client.responses.create(model="tiny", input="What is two plus two?", instructions="Be brief.",
                                         max_output_tokens=5)
    assert instructed.usage.input_tokens > usage.input_tokens  # the instructions are in the prompt
    cut = client.responses.create(model="tiny", input="What is two plus two?", temperature=0, max_output_tokens=5)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5
    off = client.responses.create(model="tiny", input="What is two plus two?", temperature=0,
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [item.type for item in off.output] == ["message"] and off.output_text == "Four."


def test_streamed_events_come_in_openai_order_and_build_the_same_response(client):
    done = client.responses.create(model="tiny", input="What is two plus two?", temperature=0)
    with client.responses.stream(model="tiny", input="What is two plus two?", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    opened = [k for k in kinds if k in ("response.output_item.added", "response.output_item.done")]
    assert opened == ["response.output_item.added", "response.output_item.done"] * 2  # one item at a time
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == done.output[0].content[0].text and text == done.output_text == final.output_text
    assert final.id == events[0].response.id and final.usage.output_tokens == done.usage.output_tokens


def test_text_format_schemas_start_after_the_reasoning(client):
    parsed = client.responses.parse(model="tiny", input="Plan a trip to Paris as JSON.", temperature=0,
                                    text_format=Trip)
    assert parsed.output_parsed == Trip(city="Paris", days=3) and parsed.output[0].type == "reasoning"
    with client.responses.stream(model="tiny", input="Plan a trip to Paris as JSON.", temperature=0,
                                 text_format=Trip) as stream:
        assert stream.get_final_response().output_parsed == Trip(city="Paris", days=3)


def test_function_tools_then_their_result_by_previous_response_id(client):
    first = client.responses.create(model="tiny", input="What is the weather in Paris?", tools=[TOOL],
                                    temperature=0)
    call = first.output[-1]
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert call.name == "get_weather" and call.arguments == '{"city":"Paris"}' and call.call_id.startswith("call_")
    follow = client.responses.create(model="tiny", previous_response_id=first.id, tools=[TOOL], max_output_tokens=8,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
    assert follow.previous_response_id == first.id and follow.usage.input_tokens > first.usage.input_tokens
    with client.responses.stream(model="tiny", input="What is the weather in Paris?", tools=[TOOL], temperature=0,
                                 tool_choice="required") as stream:
        events = list(stream)
        final = stream.get_final_response()
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == final.output[-1].arguments == call.arguments
    named = client.responses.create(model="tiny", input="What is the weather in Paris?", tools=[TOOL],
                                    temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    assert named.output[-1].type == "function_call" and named.output[-1].arguments == call.arguments
    none = client.responses.create(model="tiny", input="What is the weather in Paris?", tools=[TOOL],
                                   tool_choice="none", max_output_tokens=10)
    assert all(item.type != "function_call" for item in none.output)


def test_pictures_in_by_url_and_a_stored_response_by_id(client, server):
    picture = {"role": "user", "content": [{"type": "input_text", "text": "What is in the picture?"},
                                           {"type": "input_image", "image_url": data_url(make_image(64, 48, 3))}]}
    seen = client.responses.create(model="tiny", input=[picture], max_output_tokens=4)
    text_only = client.responses.create(model="tiny", input="What is in the picture?", max_output_tokens=4)
    assert seen.usage.input_tokens > text_only.usage.input_tokens  # the picture's tokens
    assert client.responses.retrieve(seen.id).output_text == seen.output_text
    client.responses.delete(seen.id)
    unstored = client.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    for gone in (seen.id, unstored.id):
        with pytest.raises(openai.NotFoundError, match="not found"):
            client.responses.retrieve(gone)


def test_what_it_does_not_take_is_refused_in_openai_format(client, server):
    cases = [
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-abc"}]}]),
         openai.BadRequestError, "/v1/files"),
        (dict(input="hi", background=True), openai.BadRequestError, "background"),
        (dict(input="hi", previous_response_id="resp_unknown"), openai.NotFoundError, "resp_unknown"),
        (dict(input="hi", tools=[{"type": "web_search"}]), openai.BadRequestError, "not supported"),
        (dict(input="hi", extra_body={"thinking_token_budget": -1}), openai.BadRequestError,
         "thinking_token_budget"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match) as caught:
            client.responses.create(model="tiny", **kwargs)
        assert set(caught.value.body) >= {"message", "type", "param", "code"}
    keyless = httpx.post(server.base + "/v1/responses", json={"model": "tiny", "input": "hi"})
    assert keyless.status_code == 401
