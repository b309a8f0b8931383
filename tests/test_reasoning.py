"""A thinking model through the real engine (the tiny Qwen3-VL trained to think, then
answer: vlmserve/testing/thinking.py), with `--reasoning-parser qwen3`: the thinking budget
closes the reasoning where it is spent; grammars (JSON schemas, regexes, choices) start
after the reasoning, with n > 1, after a preemption in the middle of the reasoning, with
the engine core in a process of its own; `--chat-template` replaces the checkpoint's."""

from __future__ import annotations

import json

import jsonschema
import pytest

from vlmserve import LLM, SamplingParams
from vlmserve.sampling_params import ParamError, StructuredOutputsParams
from vlmserve.testing.thinking import THINKING_TEMPLATE

TWO = "What is two plus two?"
PARIS = "Plan a trip to Paris as JSON."
SKY = "Is the sky blue? Say yes or no."
TRIP = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(thinking_path):
    return LLM(model=thinking_path, reasoning_parser="qwen3", max_model_len=512)


def ask(llm: LLM, question: str, kwargs: dict | None = None, **params):
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 80)
    return llm.chat([{"role": "user", "content": question}], SamplingParams(**params),
                    chat_template_kwargs=kwargs)[0]


def test_it_thinks_then_answers(llm):
    parser = llm.engine.reasoning
    out = ask(llm, TWO)
    reasoning, content = parser.split(out.outputs[0].text)
    assert reasoning.startswith("Two plus two means adding") and content.strip() == "The answer is four."
    assert parser.reasoning_tokens(out.prompt_token_ids, out.outputs[0].token_ids) > 20
    off = ask(llm, TWO, {"enable_thinking": False})  # the template closes the reasoning in the prompt
    assert parser.prompt_ends_reasoning(off.prompt_token_ids) and off.outputs[0].text == "Four."


@pytest.mark.parametrize("budget", [0, 3, 9])
def test_a_thinking_budget_closes_the_reasoning_where_it_is_spent(llm, budget):
    parser = llm.engine.reasoning
    out = ask(llm, TWO, n=2, thinking_token_budget=budget)
    for sample in out.outputs:
        assert sample.token_ids.index(parser.end_token_id) == budget  # forced by the engine, not chosen
        assert parser.reasoning_tokens(out.prompt_token_ids, sample.token_ids) == budget
        if budget:  # the answer follows the closing tag (the model learnt that after a cut)
            assert parser.split(sample.text)[1].strip() == "The answer is four."


@pytest.mark.parametrize("question, spec, check", [
    (PARIS, StructuredOutputsParams(json=TRIP), lambda text: json.loads(text) == {"city": "Paris", "days": 3}),
    (TWO, StructuredOutputsParams(json=ANSWER), lambda text: jsonschema.validate(json.loads(text), ANSWER) is None),
    (SKY, StructuredOutputsParams(regex="(yes|no)"), lambda text: text == "yes"),
    (TWO, StructuredOutputsParams(choice=("three", "five")), lambda text: text in ("three", "five")),
], ids=["schema", "schema-it-would-not-write", "regex", "choice"])
def test_grammars_start_after_the_reasoning(llm, question, spec, check):
    """The model thinks as freely as without a grammar; the answer after the closing tag
    is the grammar's."""
    parser = llm.engine.reasoning
    free_reasoning, _ = parser.split(ask(llm, question).outputs[0].text)
    out = ask(llm, question, n=2, structured_outputs=spec)
    for sample in out.outputs:
        reasoning, content = parser.split(sample.text)
        assert reasoning == free_reasoning and sample.finish_reason == "stop"
        assert check(content), content


def test_without_reasoning_the_grammar_starts_at_once(llm):
    out = ask(llm, TWO, {"enable_thinking": False}, structured_outputs=StructuredOutputsParams(choice=("three",
                                                                                                        "five")))
    assert out.outputs[0].text in ("three", "five")


def test_preempted_in_the_middle_of_the_reasoning(llm, thinking_path):
    """Four samples at once in a cache that holds two: preempted while they reason, their
    grammars and budgets resume where they were, and the answers are the unpreempted ones."""
    asks = [(PARIS, dict(structured_outputs=StructuredOutputsParams(json=TRIP))), (TWO, dict(thinking_token_budget=9))]
    expected = [ask(llm, q, n=2, **p) for q, p in asks]
    small = LLM(model=thinking_path, reasoning_parser="qwen3", max_model_len=96, num_kv_blocks=8, block_size=16)
    scheduler = small.engine.engine_core.scheduler
    end = small.engine.reasoning.end_token_id
    preempted_reasoning = []
    preempt = scheduler._preempt

    def spy(request):
        preempted_reasoning.append(bool(request.output_token_ids) and end not in request.output_token_ids)
        preempt(request)

    scheduler._preempt = spy
    params = [SamplingParams(temperature=0, max_tokens=60, n=2, **p) for _, p in asks]
    got = small.chat([[{"role": "user", "content": q}] for q, _ in asks], params)
    assert any(preempted_reasoning), "no request was preempted while it reasoned"
    for want, have in zip(expected, got):
        assert [s.text for s in have.outputs] == [s.text for s in want.outputs]
        assert [s.token_ids for s in have.outputs] == [s.token_ids for s in want.outputs]


def test_an_engine_core_in_its_own_process_follows_the_reasoning_too(thinking_path, llm):
    own = LLM(model=thinking_path, reasoning_parser="qwen3", max_model_len=512, engine_process=True)
    for params in (dict(thinking_token_budget=3), dict(structured_outputs=StructuredOutputsParams(json=TRIP))):
        question = TWO if "thinking_token_budget" in params else PARIS
        assert ask(own, question, **params).outputs[0].text == ask(llm, question, **params).outputs[0].text


def test_a_budget_needs_a_reasoning_parser_and_a_chat_template_replaces_the_checkpoints(thinking_path, tmp_path):
    template = tmp_path / "marked.jinja"
    template.write_text("{%- if mark is defined %}MARK {% endif %}" + THINKING_TEMPLATE)
    plain = LLM(model=thinking_path, max_model_len=512, chat_template=str(template))
    with pytest.raises(ParamError, match="--reasoning-parser"):
        plain.generate(["hi"], SamplingParams(thinking_token_budget=4))
    prompt = plain.engine.render_chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"mark": 1})
    assert prompt.prompt.startswith("MARK <|im_start|>user\nhi<|im_end|>")
    out = plain.chat([{"role": "user", "content": TWO}], SamplingParams(temperature=0, max_tokens=60))[0]
    assert "</think>" in out.outputs[0].text  # no parser: the reasoning stays in the text
