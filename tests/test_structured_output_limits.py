"""Structured output under hostile or mistaken input: limits and deadlines on what a grammar
may cost, every JSON-schema keyword enforced or refused, unsatisfiable and conflicting
constraints, characters outside the Basic Multilingual Plane and surrogates, and tool
calls read by their structure. Each case of the reliability round is here as a test."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from vlmserve import LLM, SamplingParams
from vlmserve.errors import ConfigError
from vlmserve.entrypoints.openai import tool_calls
from vlmserve.sampling_params import ParamError, StructuredOutputsParams
from vlmserve.structured_output.compiler import GrammarCompiler
from vlmserve.structured_output.grammar import build_grammar
from vlmserve.structured_output.manager import tokenizer_info_of
from vlmserve.structured_output.schema import GrammarLimits, check_spec
from vlmserve.testing.schemas import nested, optional_properties


def spec(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


# -- limits: a 400 that names the flag, before anything compiles ------------------------------------
@pytest.mark.parametrize("asked, limits, flag", [
    (spec(json=optional_properties(10_000)), GrammarLimits(), "--max-grammar-bytes"),
    (spec(json=optional_properties(600)), GrammarLimits(), "--max-schema-properties"),
    (spec(json=nested(350)), GrammarLimits(), "--max-schema-depth"),
    (spec(regex="a" * 5000), GrammarLimits(), "--max-regex-chars"),
    (spec(json={"type": "string", "pattern": "b" * 5000}), GrammarLimits(), "--max-regex-chars"),
    (spec(choice=["x" * 100] * 1000), GrammarLimits(), "--max-grammar-bytes"),
    (spec(json=nested(5)), GrammarLimits(max_schema_depth=4), "--max-schema-depth"),
])
def test_specs_over_a_limit_are_refused_naming_it(asked, limits, flag):
    with pytest.raises(ParamError, match=re.escape(flag)):
        check_spec(asked, limits)


def test_limits_are_flags_of_the_engine():
    from vlmserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-schema-depth", "8", "--grammar-compile-timeout", "2.5",
                                      "--max-grammar-bytes", "1000", "--grammar-compile-workers", "3"])
    assert (args.max_schema_depth, args.grammar_compile_timeout, args.max_grammar_bytes,
            args.grammar_compile_workers) == (8, 2.5, 1000, 3)


# -- every keyword enforced or refused ---------------------------------------------------------------
@pytest.mark.parametrize("schema, message", [
    ({"not": {"type": "string"}}, "'not' is not supported"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems' is not supported"),
    ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "'if' is not supported"),
    ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "'contains' is not supported"),
    ({"type": "object", "unevaluatedProperties": False}, "'unevaluatedProperties'"),
    ({"type": "string", "format": "byte"}, "format 'byte' is not supported"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' is supported on integers"),
    ({"$ref": "https://example.com/schema.json"}, "only local references"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "no value matches"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' is supported where no value can match two"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "required property 'a' is not among the properties"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "refers back to itself"),
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}, "refers back to itself"),
    ({"$ref": "#"}, "refers back to itself"),
    ({"type": "object", "properties": {"a": {"type": "strings"}}}, "'type' must be one of"),
    ({"enum": ["\ud800"]}, "lone surrogate"),
])
def test_a_keyword_that_could_be_broken_is_refused(schema, message):
    with pytest.raises(ParamError, match=re.escape(message)):
        check_spec(spec(json=schema), GrammarLimits())


def grammar_of(schema: dict):
    return build_grammar(check_spec(spec(json=schema), GrammarLimits()))


@pytest.mark.parametrize("schema, good, bad", [
    # allOf of objects: one object with both parts' properties, both required
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
     ['{"a":1,"b":2}'], ['{"a":1}', '{"b":2}']),
    # allOf narrowing a number: both bounds hold
    ({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}, ["0", "5"], ["-1", "6"]),
    # a $ref with siblings: both constrain the value
    ({"$defs": {"n": {"type": "integer"}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/n", "minimum": 5}}, "required": ["a"]}, ['{"a":6}'], ['{"a":1}']),
    # oneOf of different types, and of a discriminated union: exact as anyOf
    ({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, ["7", '"ab"'], ["1.5", '"abc"']),
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}},
                 "required": ["k", "x"]},
                {"type": "object", "properties": {"k": {"const": "b"}, "y": {"type": "string"}},
                 "required": ["k", "y"]}]},
     ['{"k":"a","x":1}', '{"k":"b","y":"s"}'], ['{"k":"a","y":"s"}']),
    # recursion through a property is a finite value
    ({"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}}}, "required": ["c"]},
     ['{"c":[]}', '{"c":[{"c":[]}]}'], ['{"c":[{}]}']),
    ({"type": "integer", "multipleOf": 3}, ["6", "0"], ["4"]),
    ({"type": "string", "format": "date"}, ['"2024-01-02"'], ['"yesterday"']),
])
def test_rewritten_schemas_enforce_what_they_say(schema, good, bad):
    grammar = grammar_of(schema)
    for text in good:
        assert accepts(grammar, text), text
        jsonschema.validate(json.loads(text), schema)
    for text in bad:
        assert not accepts(grammar, text), text


def test_json_object_and_any_values_are_compact():
    grammar = build_grammar(spec(json_object=True))
    assert accepts(grammar, '{"a":[1,2],"b":{"c":null}}')
    assert not accepts(grammar, '{"a":[1, 2]}') and not accepts(grammar, '{"a":1, "b":2}')
    loose = grammar_of({"type": "object", "properties": {"x": {}}, "required": ["x"]})
    assert accepts(loose, '{"x":[1,{"y":2}]}') and not accepts(loose, '{"x":[1, 2]}')


def test_choices_keep_characters_outside_the_bmp_and_escape_the_rest():
    choices = ["\U0001F600", 'say "hi"', "back\\slash", "two\nlines", "tab\there"]
    grammar = build_grammar(spec(choice=choices))
    for c in choices:
        assert accepts(grammar, c), c
    assert not accepts(grammar, "\\ud83d\\ude00") and not accepts(grammar, "say \\\"hi\\\"")


def test_positive_classes_admit_no_surrogate():
    """`[\\u0000-\\uffff]` spans the surrogates; their UTF-8 encodings are not characters
    (a decoder makes each three U+FFFD, so `{2}` came out as 4 characters). The class
    keeps every character but those; a literal surrogate is refused."""
    pieces = {"a": b"a", "kana": "\u3042".encode(), "c1": b"\xc2\x80", "surrogate": b"\xed\xa0\x80",
              "high": "\uffef".encode(), "emoji": "\U0001F600".encode()}
    vocab = [b"<eos>"] + list(pieces.values())
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info)
    for regex, expected in ((r"[\u0000-\uffff]{2}", {"a", "kana", "c1", "high"}),
                            (r"[\ud000-\udfff\u3040-\u3050]", {"kana"}),
                            (r"[^b]", {"a", "kana", "c1", "high", "emoji"})):
        compiled = compiler.compile_grammar(build_grammar(spec(regex=regex)))
        admitted = set()
        for i, name in enumerate(pieces):
            matcher = xgr.GrammarMatcher(compiled)
            if matcher.accept_token(1 + i):
                admitted.add(name)
        assert admitted == expected, regex
    with pytest.raises(ParamError, match="surrogate code point"):
        build_grammar(spec(regex=r"\ud83d"))
    with pytest.raises(ParamError, match="surrogate code point"):
        build_grammar(spec(grammar='root ::= "\\ud800"'))


# -- the compiler: processes, a deadline, several at once, a cache --------------------------------------
@pytest.fixture(scope="module")
def tokenizer(qwen25_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen25_path)


def test_a_compile_past_its_deadline_is_abandoned_while_others_compile(tokenizer):
    compiler = GrammarCompiler(lambda: tokenizer_info_of(tokenizer, len(tokenizer)), num_workers=2, timeout=3.0)
    try:
        endless = compiler.compile(spec(json=optional_properties(10_000)))  # never finishes (n^4)
        while not compiler._workers:
            time.sleep(0.05)
        quick = [compiler.compile(spec(choice=[f"c{i}", "x"])) for i in range(4)]
        for f in quick:
            assert f.result(timeout=60).grammar is not None
        assert not endless.done()  # the others finished while it still compiles
        with pytest.raises(ParamError, match=r"did not compile within 3 s \(--grammar-compile-timeout\)"):
            endless.result(timeout=60)
        # its process is gone (its memory with it); the next compile gets a fresh one
        deadline = time.time() + 10
        while time.time() < deadline and len(compiler._workers) > 1:
            time.sleep(0.05)
        assert len(compiler._workers) <= 1
        assert compiler.compile(spec(regex="[a-z]{3}")).result(timeout=60).grammar is not None
        # cached: the same spec is the same future, failures included
        assert compiler.compile(spec(json=optional_properties(10_000))) is endless
        assert compiler.compile(spec(choice=["c0", "x"])) is quick[0]
    finally:
        compiler.shutdown()


def test_grammars_that_match_nothing_are_refused(tokenizer):
    compiler = GrammarCompiler(lambda: tokenizer_info_of(tokenizer, len(tokenizer)), num_workers=1)
    try:
        for nothing in (spec(regex=r"[^\x00-\U0010ffff]"), spec(grammar="root ::= [^\\0-\\U0010ffff]")):
            with pytest.raises(ParamError, match="matches no text"):
                compiler.compile(nothing).result(timeout=60)
        with pytest.raises(ParamError, match="regex is not valid"):
            compiler.compile(spec(regex="[a-")).result(timeout=60)
    finally:
        compiler.shutdown()


# -- through the engine -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(qwen25_path):
    return LLM(qwen25_path, num_kv_blocks=256, max_num_seqs=16)


def nothing_left(llm: LLM) -> bool:
    stats = llm.engine.stats()
    return stats.num_running == 0 and stats.num_waiting == 0 and sum(stats.blocks_in_use.values()) == 0


@pytest.mark.parametrize("constraint, valid", [
    (spec(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
    (spec(regex=r"[a-c]{2,4}"), lambda t: re.fullmatch(r"[a-c]{2,4}", t)),
    (tool_calls.constraint([tool_calls.Tool(function={"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}})],
        "required"), lambda t: tool_calls.parse(t)[1]),
])
def test_min_tokens_that_the_grammar_cannot_reach_ends_with_a_complete_answer(llm, constraint, valid):
    """The grammar wins: once its answer is complete it may end, min_tokens or not."""
    outs = llm.generate(["Q:"] * 4, SamplingParams(temperature=1.0, seed=3, min_tokens=50, max_tokens=60,
                                                   structured_outputs=constraint))
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and valid(o.outputs[0].text), o.outputs[0].text
    assert nothing_left(llm)


def test_stop_token_ids_that_the_answer_needs_end_it_there(llm):
    tok = llm.get_tokenizer()
    brace = tok.encode("{", add_special_tokens=False)
    assert len(brace) == 1
    out = llm.generate(["Q:"], SamplingParams(temperature=1.0, max_tokens=50, stop_token_ids=brace,
                                              structured_outputs=spec(json={"type": "object"})))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == brace and out.stop_reason == brace[0]
    assert nothing_left(llm)


def test_a_branch_that_cannot_be_completed_ends_the_answer_where_it_is(llm):
    """`root ::= "ab" [^\\0-\\U0010ffff]` admits a first token; after "ab" it admits
    nothing: the answer ends there, finish_reason stop, and its batch-mates carry on."""
    dead_end = spec(grammar='root ::= "ab" [^\\0-\\U0010ffff]')
    params = [SamplingParams(temperature=1.0, max_tokens=20, structured_outputs=dead_end),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    stuck, free = llm.generate(["Q:", "R:"], params)
    assert stuck.outputs[0].finish_reason == "stop" and "ab".startswith(stuck.outputs[0].text)
    assert len(free.outputs[0].token_ids) == 6
    assert nothing_left(llm)


def test_a_choice_outside_the_bmp_is_answered(llm):
    out = llm.generate(["Q:"], SamplingParams(temperature=1.0, max_tokens=10,
                                              structured_outputs=spec(choice=["\U0001F600", "\U0001F4A9 two"])))
    assert out[0].outputs[0].text in ("\U0001F600", "\U0001F4A9 two")


def test_a_grammar_that_matches_nothing_is_refused_at_the_door(llm):
    """A spec is refused at the door with the compile worker's reason, and leaves nothing."""
    with pytest.raises(ParamError, match="matches no text"):
        llm.generate(["Q:"], SamplingParams(structured_outputs=spec(regex=r"[^\x00-\U0010ffff]")))
    assert nothing_left(llm)


# -- tool calls read by their structure -------------------------------------------------------------------
def test_a_closing_tag_inside_an_argument_keeps_the_call():
    call = {"name": "echo", "arguments": {"text": "</tool_call> and <tool_call>"}}
    text = "Sure.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    content, calls = tool_calls.parse(text)
    assert content == "Sure." and len(calls) == 1 and json.loads(calls[0].arguments) == call["arguments"]
    stream, got_content, got_calls = tool_calls.ToolCallStream(), "", []
    for end in range(1, len(text) + 1):
        piece, new = stream.feed(text[:end], final=end == len(text))
        got_content += piece
        got_calls += new
    assert got_content.strip() == "Sure." and [json.loads(c.arguments) for c in got_calls] == [call["arguments"]]
    # a block that is not a call stays text, streamed or not
    odd = "a <tool_call>[1, 2]</tool_call> b"
    assert tool_calls.parse(odd) == (odd, [])
    stream = tool_calls.ToolCallStream()
    assert "".join(stream.feed(odd[:e], final=e == len(odd))[0] for e in range(1, len(odd) + 1)) == odd


def test_tool_parameters_must_describe_an_object():
    with pytest.raises(ParamError, match=r"tools\[0\]\.function\.parameters must be a JSON schema of type object"):
        tool_calls.check_tools([tool_calls.Tool(function={"name": "f", "parameters": {"type": "string"}})])
    tool_calls.check_tools([tool_calls.Tool(function={"name": "f"}),
                            tool_calls.Tool(function={"name": "g", "parameters": {"properties": {}}})])


# -- chunked prefill off: a context a step can hold -------------------------------------------------------
def test_without_chunked_prefill_the_context_is_what_a_step_computes(qwen25_path):
    llm = LLM(qwen25_path, chunked_prefill=False, max_num_batched_tokens=64, num_kv_blocks=64)
    assert llm.engine.max_model_len == 64
    with pytest.raises(ValueError, match="context is 64 tokens"):
        llm.generate(["word " * 200], SamplingParams(max_tokens=4))
    outs = llm.generate(["word " * 20] * 6, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert all(o.num_prompt_tokens + len(o.outputs[0].token_ids) == 64 for o in outs)
    with pytest.raises(ConfigError, match="chunked prefill off"):
        LLM(qwen25_path, chunked_prefill=False, max_num_batched_tokens=64, max_model_len=4096, num_kv_blocks=64)


# -- answers always satisfy their constraint: random schemas and regexes -----------------------------------
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

def _mixed_enum(values: list, kind: str) -> dict:
    return {"type": kind, "enum": values}


_scalars = st.one_of(
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "integer"}),
    st.builds(lambda lo: {"type": "number", "minimum": lo}, st.integers(-5, 5)),
    st.builds(lambda lo, hi: {"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": lo + hi},
              st.sampled_from([-1.5, 0, 0.25]), st.sampled_from([0.5, 2, 10])),
    st.builds(lambda m: {"type": "integer", "multipleOf": m}, st.integers(2, 7)),
    st.builds(lambda m, lo: {"type": "integer", "multipleOf": m, "minimum": lo, "maximum": lo + 60},
              st.integers(2, 7), st.integers(-30, 30)),
    st.builds(lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
              st.integers(0, 3), st.integers(0, 6)),
    st.builds(lambda values: {"enum": values}, st.lists(st.text("abc", min_size=1, max_size=3), min_size=1,
                                                        max_size=4, unique=True)),
    # enum and const beside other keywords: only the values that hold with them
    st.builds(lambda kind: {"type": kind, "enum": ["a", "bbbb", 3, 4.5, None, True]},
              st.sampled_from(["string", "integer", "number"])),
    st.just({"type": "string", "enum": ["a", "bb", "ccccc"], "maxLength": 2}),
    st.just({"type": "integer", "enum": [1, 5, 9], "minimum": 4}),
    st.builds(lambda v: {"const": v}, st.text("xyz", min_size=1, max_size=3)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(["^[a-c]{1,3}$", "^x[0-9]?$"])),
    st.builds(lambda f: {"type": "string", "format": f},
              st.sampled_from(["date", "time", "date-time", "ipv4", "ipv6", "uuid", "hostname", "email"])),
    # anyOf with keywords beside it: each branch holds them too
    st.just({"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 5, "maxLength": 6}]}),
    st.just({"oneOf": [{"type": "integer", "maximum": 3}, {"type": "string", "maxLength": 1}]}),
    st.just({"allOf": [{"type": "integer", "minimum": 2}, {"type": "number", "maximum": 8}]}),
)


def _object(props: dict, required_mask: list[bool]) -> dict:
    names = list(props)
    return {"type": "object", "properties": props,
            "required": [n for n, r in zip(names, required_mask) if r], "additionalProperties": False}


schemas = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.builds(lambda items, lo, span: {"type": "array", "items": items, "minItems": lo, "maxItems": lo + span},
                  inner, st.integers(0, 2), st.integers(0, 2)),
        st.builds(lambda first, rest: {"type": "array", "prefixItems": [first], "items": rest, "minItems": 1,
                                       "maxItems": 3}, inner, inner),
        st.dictionaries(st.text("pqrs", min_size=1, max_size=2), inner, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
                lambda mask: _object(props, mask))),
        st.builds(lambda props, extra: {"type": "object", "properties": props, "additionalProperties": extra,
                                        "maxProperties": 3},
                  st.dictionaries(st.text("pq", min_size=1, max_size=1), inner, max_size=2), inner),
        st.lists(inner, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
        st.tuples(inner, inner).map(lambda ab: {"allOf": [
            {"type": "object", "properties": {"a": ab[0]}, "required": ["a"]},
            {"type": "object", "properties": {"b": ab[1]}, "required": ["b"], "additionalProperties": False}]}),
    ),
    max_leaves=6,
)
# at the root: a definition used through $ref, and one narrowed by a sibling keyword
schemas = st.one_of(schemas, st.tuples(schemas, schemas).map(lambda ab: {
    "$defs": {"d": ab[0], "n": {"type": "integer", "minimum": -5, "maximum": 50}}, "type": "object",
    "properties": {"v": {"$ref": "#/$defs/d"}, "w": ab[1], "n": {"$ref": "#/$defs/n", "maximum": 9}},
    "required": ["v", "n"], "additionalProperties": False}))


def _strict_formats() -> jsonschema.FormatChecker:
    """jsonschema's checks, plus what it leaves to packages that are not installed here."""
    import datetime

    checker = jsonschema.FormatChecker()

    @checker.checks("time", raises=ValueError)
    def _time(text: str) -> bool:
        if not isinstance(text, str):
            return True
        return bool(re.fullmatch(r"\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", text)) and \
            datetime.time.fromisoformat(text.replace("Z", "+00:00")) is not None

    @checker.checks("date-time", raises=ValueError)
    def _date_time(text: str) -> bool:
        if not isinstance(text, str):
            return True
        date, _, time_ = text.partition("T")
        return _time(time_) and datetime.date.fromisoformat(date) is not None

    @checker.checks("hostname")
    def _hostname(text: str) -> bool:
        if not isinstance(text, str):
            return True
        labels = text.split(".")
        return len(text) <= 253 and all(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", x) for x in labels)

    return checker


FORMATS = _strict_formats()


def check_answer(text: str, schema: dict) -> None:
    jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(json.loads(text))


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(schema=schemas)
def test_random_schemas_every_sampled_answer_validates(llm, schema):
    try:
        constraint = check_spec(spec(json=schema), GrammarLimits())
    except ParamError as e:  # a combination refused at the door is fine; what passes must hold
        assert any(w in str(e) for w in ("no value matches", "not supported", "is supported where")), e
        return
    outs = llm.generate(["Answer:"] * 4, SamplingParams(temperature=1.0, max_tokens=120,
                                                        structured_outputs=constraint))
    for o in outs:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            check_answer(c.text, schema)


_regex_atoms = st.sampled_from(["a", "b", "[0-9]", "[a-f]", "\\.", "[^a-z]", ".", "\\d", "[\\u00e0-\\u00ff]",
                                "\U0001F600", "(x|yz)"])
regexes = st.lists(st.tuples(_regex_atoms, st.sampled_from(["", "?", "{1,3}", "{2}", "+"])), min_size=1,
                   max_size=5).map(lambda parts: "".join(a + q for a, q in parts))


@hypothesis.settings(max_examples=30, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(regex=regexes)
def test_random_regexes_every_sampled_answer_fullmatches(llm, regex):
    outs = llm.generate(["Code:"] * 4, SamplingParams(temperature=1.0, max_tokens=40,
                                                      structured_outputs=spec(regex=regex)))
    for o in outs:
        if o.outputs[0].finish_reason == "stop":
            assert re.fullmatch(regex, o.outputs[0].text), (regex, o.outputs[0].text)
