"""The pieces of thinking models and today's OpenAI API, without a model: the reasoning
parsers (whole and streamed), the engine core's reasoning gate (a grammar that starts
after the reasoning, a budget that closes it), the tool-call formats (hermes and Qwen's
XML, streamed in OpenAI's shape), the XML call grammar, --chat-template, and the
Responses API's input, store and events."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from vlmserve.engine.chat_template import ChatTemplate, as_strings, detect_content_format
from vlmserve.entrypoints.openai.answers import AnswerReader
from vlmserve.entrypoints.openai.protocol import Tool
from vlmserve.entrypoints.openai.responses_events import EventWriter
from vlmserve.entrypoints.openai.responses_input import chat_messages, chat_tools, input_messages
from vlmserve.entrypoints.openai.responses_protocol import ResponsesRequest
from vlmserve.entrypoints.openai.responses_store import ResponseStore
from vlmserve.entrypoints.openai.protocol import OpenAIError
from vlmserve.entrypoints.openai.tool_parsers import ToolDeltaStream, tool_parser
from vlmserve.errors import ConfigError
from vlmserve.reasoning.bounds import ReasoningBounds
from vlmserve.reasoning.parsers import ReasoningStream, reasoning_parser
from vlmserve.sampling_params import StructuredOutputsParams
from vlmserve.structured_output.grammar import build_grammar
from vlmserve.structured_output.manager import RequestGrammar, StructuredOutputManager
from vlmserve.testing.thinking import THINKING_TEMPLATE, WEATHER_TOOL, thinking_tokenizer

THOUGHT, ANSWER = "Two and two make four.\n", "\n\nThe answer is four."


@pytest.fixture(scope="module")
def tokenizer():
    return thinking_tokenizer()


@pytest.fixture(scope="module")
def qwen3(tokenizer):
    return reasoning_parser("qwen3", tokenizer)


def stream_split(parser, text: str, thinking: bool = True) -> tuple[str, str]:
    stream, reasoning, content = ReasoningStream(parser, thinking), "", ""
    for end in range(1, len(text) + 1):  # one character at a time
        r, c = stream.feed(text[:end], final=end == len(text))
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def test_reasoning_is_split_whole_and_streamed_as_vllm_splits_it(qwen3, tokenizer):
    deepseek = reasoning_parser("deepseek_r1", tokenizer)
    cases = [
        (f"{THOUGHT}</think>{ANSWER}", True, (THOUGHT, ANSWER)),  # the template opened the reasoning
        (f"<think>{THOUGHT}</think>{ANSWER}", True, (THOUGHT, ANSWER)),  # the model opened it
        (THOUGHT, True, (THOUGHT, None)),  # cut short: all reasoning
        (ANSWER, False, (None, ANSWER)),  # enable_thinking false and no closing tag: all content
        (f"{THOUGHT}<tool_call>\n<function=f>\n</function>\n</tool_call>", True,
         (THOUGHT, "<tool_call>\n<function=f>\n</function>\n</tool_call>")),  # Qwen3.5 calls before closing
    ]
    for text, thinking, expected in cases:
        assert qwen3.split(text, thinking) == expected
        assert stream_split(qwen3, text, thinking) == tuple(x or "" for x in expected)
    assert deepseek.split(f"{THOUGHT}</think>{ANSWER}") == (THOUGHT, ANSWER)
    assert deepseek.split(f"{THOUGHT}<tool_call>\n<function=f>") == (f"{THOUGHT}<tool_call>\n<function=f>", None)
    assert not qwen3.thinking({"enable_thinking": False}) and deepseek.thinking({"enable_thinking": False})
    with pytest.raises(ValueError, match="qwen3, deepseek_r1"):
        reasoning_parser("granite", tokenizer)


def test_the_prompt_and_the_tokens_tell_where_the_reasoning_ends(qwen3, tokenizer):
    start, end = qwen3.start_token_id, qwen3.end_token_id
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n")
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = tokenizer.encode("<think>\nold\n</think>\n\nold answer<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert not qwen3.prompt_ends_reasoning(opened) and qwen3.prompt_ends_reasoning(closed)
    assert not qwen3.prompt_ends_reasoning(history)  # the last tag decides
    assert qwen3.reasons(None, opened) and not qwen3.reasons(None, closed)
    assert not qwen3.reasons({"enable_thinking": False}, opened)
    output = [5, 6, 7, end, 8, 9]
    assert qwen3.reasoning_tokens(opened, output) == 3 and qwen3.reasoning_tokens(closed, output) == 0
    assert qwen3.reasoning_tokens(opened, [5, 6]) == 2
    bounds = ReasoningBounds(end, start, ended_in_prompt=False, budget=2)
    assert bounds.answer_start(output) == 4 and bounds.answer_start([5]) is None
    assert bounds.reasoning_tokens([start, 5, 6]) == 2 and bounds.budget_spent([start, 5, 6])


def test_a_grammar_starts_after_the_reasoning_and_replays_only_the_answer(qwen3, tokenizer):
    """Tokens before the closing tag are accepted without a matcher; the matcher follows
    the answer; a preempted request's fresh matcher replays the answer alone."""
    vocab = len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_grammar(build_grammar(StructuredOutputsParams(choice=("yes", "no"))))
    output: list[int] = []
    bounds = qwen3.bounds(tokenizer.encode("<|im_start|>assistant\n<think>\n"), None)
    grammar = RequestGrammar(compiled, output, [], bounds)
    for token in tokenizer.encode("I think, so: ") + [qwen3.end_token_id]:
        assert not grammar.masks_next()
        output.append(token)
        assert grammar.accept(token)
    assert grammar.masks_next()
    for token in tokenizer.encode("yes"):
        output.append(token)
        assert grammar.accept(token)
    grammar.release()  # preempted: the next use rebuilds the matcher
    assert grammar.matcher is not None and not grammar.is_terminated()
    manager = StructuredOutputManager("unused", vocab, 4)
    mask = manager.step_grammars([("r", grammar)]).bitmask.bitmask[0]
    allowed = [t for t in range(vocab) if (int(mask[t // 32]) >> (t % 32)) & 1]
    assert allowed == [tokenizer.convert_tokens_to_ids("<|im_end|>")] or all(
        t in tokenizer.all_special_ids for t in allowed)


def test_a_spent_budget_masks_all_but_the_closing_tag(qwen3):
    output: list[int] = []
    bounds = ReasoningBounds(qwen3.end_token_id, qwen3.start_token_id, ended_in_prompt=False, budget=2)
    grammar = RequestGrammar(None, output, [], bounds)  # a budget and no grammar
    manager = StructuredOutputManager("unused", 640, 4)
    for token in (qwen3.start_token_id, 11, 12):  # the model opened its reasoning itself: counted after it
        assert grammar.forced_token is None and manager.step_grammars([("r", grammar)]).bitmask is None
        output.append(token)
        grammar.accept(token)
    assert grammar.forced_token == qwen3.end_token_id
    step = manager.step_grammars([("r", grammar)])
    row = step.bitmask.bitmask[0]
    assert step.bitmask.req_ids == ["r"] and int(torch.count_nonzero(row)) == 1
    assert (int(row[qwen3.end_token_id // 32]) >> (qwen3.end_token_id % 32)) & 1
    output.append(qwen3.end_token_id)
    grammar.accept(qwen3.end_token_id)
    assert grammar.forced_token is None and not grammar.masks_next()  # answering: no grammar, nothing masked


def tools(*names: str) -> list[Tool]:
    return [Tool(**{**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "name": n}}) for n in names]


def stream_calls(parser, text: str, forced: bool = False):
    stream = ToolDeltaStream(parser.stream(forced))
    content, deltas = "", []
    for end in range(1, len(text) + 1):
        piece, new, _ = stream.feed(text[:end], final=end == len(text))
        content += piece
        deltas += new
    return content, deltas


def assemble(deltas: list[dict]) -> list[dict]:
    """Deltas joined as OpenAI's clients join them."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        assert d.get("id") is None or call["id"] is None  # the header once
        call["id"] = call["id"] or d.get("id")
        call["name"] = call["name"] or d["function"].get("name")
        call["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def test_calls_stream_their_arguments_in_openai_shape_in_both_formats():
    hermes, xml = tool_parser("hermes", tools("get_weather")), tool_parser("qwen3_xml", tools("get_weather"))
    texts = [
        (hermes, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris}"}}\n</tool_call>'),
        (xml, "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis}\n</parameter>\n</function>\n"
              "</tool_call>"),
    ]
    for parser, text in texts:
        content, calls = parser.parse(text)
        assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris}"})]
        streamed_content, deltas = stream_calls(parser, text)
        joined = assemble(deltas)
        assert streamed_content.strip() == "Sure." and len(joined) == 1
        assert joined[0]["name"] == "get_weather" and joined[0]["arguments"] == calls[0].arguments
        assert len(deltas) > 2  # the arguments came piece by piece
    with pytest.raises(ValueError, match="hermes, qwen3_xml, qwen3_coder"):
        tool_parser("mistral", [])


def test_xml_values_take_their_schema_types_and_odd_blocks_stay_text():
    typed = Tool(type="function", function={"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"},
        "tags": {"type": "array"}, "s": {"type": "string"}}}})
    parser = tool_parser("qwen3_coder", [typed])
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n"
            "<parameter=ok>\ntrue\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n"
            "<parameter=s>\n12\n</parameter>\n</function>\n</tool_call>")
    _, calls = parser.parse(text)
    assert json.loads(calls[0].arguments) == {"n": 3, "x": 2.5, "ok": True, "tags": ["a"], "s": "12"}
    # an optional string (pydantic's anyOf [string, null]) is written as JSON, as the forced
    # call's grammar writes it, and read back as JSON
    optional = Tool(type="function", function={"name": "g", "parameters": {"type": "object", "properties": {
        "city": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}})
    call = "<tool_call>\n<function=g>\n<parameter=city>\n{}\n</parameter>\n</function>\n</tool_call>"
    for written, read in (('"Paris"', "Paris"), ("null", None)):
        _, calls = tool_parser("qwen3_xml", [optional]).parse(call.format(written))
        assert json.loads(calls[0].arguments) == {"city": read}
    odd = "a <tool_call>not a call</tool_call> b"
    assert parser.parse(odd) == (odd, [])
    assert stream_calls(parser, odd)[0] == odd


def test_the_xml_call_grammar_takes_a_call_of_the_named_tool_only(tokenizer):
    weather = tool_parser("qwen3_xml", tools("get_weather", "get_time"))
    spec = weather.constraint("required")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiled = xgr.GrammarCompiler(info).compile_grammar(build_grammar(spec))

    def takes(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    call = "<tool_call>\n<function={}>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    assert takes(call.format("get_weather")) and takes(call.format("get_time"))
    assert not takes(call.format("get_moon")) and not takes(call.format("get_weather").replace("city", "town"))
    from vlmserve.entrypoints.openai.protocol import NamedToolChoice

    named = weather.constraint(NamedToolChoice(function={"name": "get_time"}))
    assert named.tool_call_xml and len(named.json["anyOf"]) == 1 and weather.constraint("auto") is None


def test_an_answer_reads_reasoning_then_calls(qwen3, tokenizer):
    prompt = tokenizer.encode("<|im_start|>assistant\n<think>\n")
    reader = AnswerReader.of(qwen3, None, prompt, tool_parser("hermes", tools("get_weather")))
    text = f'{THOUGHT}</think>\n\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}\n</tool_call>'
    answer = reader.read(text)
    assert answer.reasoning == THOUGHT and answer.content == "" and answer.calls[0].name == "get_weather"
    stream, reasoning, deltas = reader.stream(), "", []
    for end in range(1, len(text) + 1):
        delta = stream.feed(text[:end], final=end == len(text))
        reasoning += delta.reasoning
        deltas += delta.tool_calls
        assert "<tool_call>" not in delta.content
    assert reasoning == THOUGHT and assemble(deltas)[0]["arguments"] == answer.calls[0].arguments
    off = AnswerReader.of(qwen3, {"enable_thinking": False}, prompt)
    assert off.read(text).reasoning is None and off.read(text).content == text


def test_chat_template_settings(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(THINKING_TEMPLATE)
    assert ChatTemplate.of(str(path)).text == THINKING_TEMPLATE
    assert ChatTemplate.of("{{ messages[0]['content'] }}").text == "{{ messages[0]['content'] }}"
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": "{{ 'x' }}"}))
    assert ChatTemplate.of(str(tmp_path / "t.json")).text == "{{ 'x' }}"
    for bad, match in [(str(tmp_path / "missing.jinja"), "no such file"), ("{% for %}", "not a valid Jinja"),
                       (None, "content-format")]:
        with pytest.raises(ConfigError, match=match):
            ChatTemplate.of(bad, "strings" if bad is None else "auto")
    assert detect_content_format(THINKING_TEMPLATE) == "openai"
    assert detect_content_format("{% for m in messages %}{{ m['content'] }}{% endfor %}") == "string"
    assert detect_content_format("{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p }}"
                                 "{% endfor %}{% endfor %}") == "openai"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"},
                                             {"type": "text", "text": "b"}]}]
    assert as_strings(messages, "<|image_pad|>", None) == [
        {"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>\na\nb"}]


def test_responses_input_becomes_chat_messages():
    req = ResponsesRequest(input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA",
                                      "detail": "low"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ], instructions="You are a tester.", tools=[{"type": "function", **WEATHER_TOOL["function"]}],
        tool_choice={"type": "function", "name": "get_weather"})
    messages = chat_messages(req.instructions, [], input_messages(req))
    assert [m["role"] for m in messages] == ["system", "system", "user", "assistant", "tool"]
    assert messages[2]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                                                            "detail": "low"}}
    assert messages[3]["tool_calls"][0]["function"]["name"] == "get_weather"
    tool_list, choice = chat_tools(req)
    assert tool_list[0].function.name == "get_weather" and choice.function.name == "get_weather"
    for item, match in [({"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}, "no /v1/files"),
                        ({"type": "web_search_call"}, "not supported"),
                        ({"role": "robot", "content": "hi"}, "role")]:
        with pytest.raises(OpenAIError, match=match):
            input_messages(ResponsesRequest(input=[item]))
    with pytest.raises(OpenAIError, match="not supported"):
        chat_tools(ResponsesRequest(input="x", tools=[{"type": "web_search"}]))


def test_the_store_is_bounded_and_evicts_the_oldest():
    store = ResponseStore(max_entries=3, max_bytes=10_000)
    for i in range(5):
        store.put(f"resp_{i}", {"id": f"resp_{i}"}, [{"role": "user", "content": "x"}])
    assert len(store) == 3 and store.get("resp_0") is None and store.get("resp_4") is not None
    store.put("resp_big", {"id": "big"}, [{"role": "user", "content": "y" * 6_000}])
    store.put("resp_big2", {"id": "big2"}, [{"role": "user", "content": "y" * 6_000}])
    assert store.get("resp_big") is None and store.get("resp_big2") is not None  # evicted by size
    store.put("resp_huge", {}, [{"role": "user", "content": "z" * 20_000}])  # over the bound alone: not kept
    assert store.get("resp_huge") is None and store.delete("resp_big2") and not store.delete("resp_big2")


def test_events_come_in_openai_order():
    from vlmserve.entrypoints.openai.answers import Delta

    writer = EventWriter({"id": "resp_1", "status": "in_progress", "output": []})
    events = writer.opening()
    events += writer.feed(Delta(reasoning="Hmm."))
    events += writer.feed(Delta(content="\n\n"))  # white space alone opens no message
    events += writer.feed(Delta(content="Hi", tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                                          "function": {"name": "f", "arguments": "{"}}]))
    events += writer.feed(Delta(tool_calls=[{"index": 0, "function": {"arguments": "}"}}]))
    events += writer.closing({"id": "resp_1", "status": "completed", "output": []})
    payloads = [json.loads(e.split("data: ", 1)[1]) for e in events]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert [p["type"] for p in payloads] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = payloads[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["reasoning", "message", "function_call"]
    assert final[1]["content"][0]["text"] == "\n\nHi" and final[2]["arguments"] == "{}"


def test_vllms_command_line_flags_for_thinking_models():
    """--enable-auto-tool-choice is taken as vLLM's command lines give it; an unknown
    --reasoning-parser is refused before anything loads."""
    from vlmserve.engine.args import EngineArgs
    from vlmserve.entrypoints.cli import build_parser
    from vlmserve.errors import ConfigError

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml",
                                      "--reasoning-parser", "qwen3"])
    assert args.enable_auto_tool_choice and args.reasoning_parser == "qwen3"
    EngineArgs(reasoning_parser="qwen3").check_settings()
    with pytest.raises(ConfigError, match="--reasoning-parser granite: vlmserve has qwen3, deepseek_r1"):
        EngineArgs(reasoning_parser="granite").check_settings()
