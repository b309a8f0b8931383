"""Structured output and the sampling parameters beyond temperature/top-k/top-p.

The test checkpoints have random weights: left alone they write gibberish, so an answer
that parses and validates is the grammar's doing, not the model's."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from conftest import make_image
from vlmserve import LLM, SamplingParams
from vlmserve.entrypoints.openai import tool_calls
from vlmserve.sampling_params import ParamError, StructuredOutputsParams
from vlmserve.kernels import sampling
from vlmserve.worker.sampler import Penalties, SamplingBatch, apply_logit_rules, token_histories

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"type": "string", "enum": ["circle", "square", "triangle"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4},
        "box": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                                 "y": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["x", "y"], "additionalProperties": False},
    },
    "required": ["name", "count", "kind", "score", "ok", "tags", "box"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(qwen25_path):
    return LLM(qwen25_path, num_kv_blocks=256, max_num_seqs=32)


def constrained(**spec) -> StructuredOutputsParams:
    return StructuredOutputsParams(**spec)


def assert_nothing_left(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert sum(stats.blocks_in_use.values()) == 0


def test_fifty_sampled_answers_to_a_nested_schema_all_validate(llm):
    params = [SamplingParams(temperature=1.0, max_tokens=400, seed=i, structured_outputs=constrained(json=SCHEMA))
              for i in range(50)]
    prompts = [f"Record number {i}:" for i in range(50)]
    outs = llm.generate(prompts, params)
    texts = [o.outputs[0].text for o in outs]
    assert len(set(texts)) > 40  # sampled, not one answer repeated
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    free = llm.generate(prompts[:8], SamplingParams(temperature=1.0, max_tokens=60))
    assert not any(_parses(o.outputs[0].text) for o in free)  # the model alone writes no JSON
    assert_nothing_left(llm)


def test_grammars_admit_only_characters_a_decoder_keeps():
    """xgrammar's negated classes and a regex's `.` admit UTF-8-encoded surrogates, which
    decode to three U+FFFD each (a maxLength string or `.{1,3}` then comes out too long),
    and its bounded JSON strings raw control characters: the rewritten grammars admit
    neither, in bounded and unbounded strings and in regexes."""
    import xgrammar as xgr
    from vlmserve.structured_output.grammar import build_grammar, json_schema_grammar
    pieces = {"a": b"a", "kana": "\u3042".encode(), "emoji": "\U0001F600".encode(), "c1": b"\xc2\x80",
              "surrogate": b"\xed\xa0\x80", "tab": b"\t", "lone_continuation": b"\x80"}
    vocab = [b"<eos>", b'{"s":"', b'{"u":"', b'"}'] + list(pieces.values())
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info)
    for opening, schema in ((1, {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}},
                                 "required": ["s"], "additionalProperties": False}),
                            (2, {"type": "object", "properties": {"u": {"type": "string"}},
                                 "required": ["u"], "additionalProperties": False})):
        compiled = compiler.compile_grammar(json_schema_grammar(schema))
        admitted = set()
        for i, name in enumerate(pieces):
            matcher = xgr.GrammarMatcher(compiled)
            if all(matcher.accept_token(t) for t in (opening, 4 + i, 3, 0)):
                admitted.add(name)
        assert admitted == {"a", "kana", "emoji", "c1"}, schema
    for regex, expected in ((".{1,3}", set(pieces) - {"surrogate", "lone_continuation"}),
                            ("[^a]{1,3}", set(pieces) - {"a", "surrogate", "lone_continuation"})):
        compiled = compiler.compile_grammar(build_grammar(StructuredOutputsParams(regex=regex)))
        admitted = set()
        for i, name in enumerate(pieces):
            matcher = xgr.GrammarMatcher(compiled)
            if all(matcher.accept_token(t) for t in (4 + i, 0)):
                admitted.add(name)
        assert admitted == expected, regex


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_choices_regex_grammar_and_json_object(llm):
    choices = ["yes", "no", "a red circle"]
    outs = llm.generate(["Q:"] * 20, SamplingParams(temperature=1.0, max_tokens=30,
                                                    structured_outputs=constrained(choice=choices)))
    answers = [o.outputs[0].text for o in outs]
    assert set(answers) <= set(choices) and len(set(answers)) > 1
    pattern = r"[A-Z][a-z]{2,6}-\d{3}(\.[a-z]{2})?"
    outs = llm.generate(["Code:"] * 20, SamplingParams(temperature=1.0, max_tokens=30,
                                                       structured_outputs=constrained(regex=pattern)))
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in outs)
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num "+" num\nnum ::= [1-9] [0-9]?'
    outs = llm.generate(["Sum:"] * 10, SamplingParams(temperature=1.0, max_tokens=30,
                                                      structured_outputs=constrained(grammar=grammar)))
    assert all(re.fullmatch(r"\(\d{1,2}(\+\d{1,2})?\)", o.outputs[0].text) for o in outs)
    outs = llm.generate(["Obj:"] * 10, SamplingParams(temperature=0.0, max_tokens=200,
                                                      structured_outputs=constrained(json_object=True)))
    for o in outs:  # any object; a cut-off one is a prefix of an object
        c = o.outputs[0]
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_mixed_batch_pictures_n_stop_strings_cutoffs_prefix_hits_and_preemption(qwen25_path):
    """Constrained and free requests in one batch, with pictures, n=3, a stop string, a
    max_tokens cut-off, the same prompt twice (a prefix-cache hit) and a KV cache small
    enough that requests are preempted: every constrained answer still validates."""
    llm = LLM(qwen25_path, num_kv_blocks=40, block_size=16, max_num_seqs=16)
    img = make_image(64, 64, seed=3)
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe it as JSON.",
              "multi_modal_data": {"image": img}}
    json_params = SamplingParams(temperature=1.0, max_tokens=400, n=3, structured_outputs=constrained(json=SCHEMA))
    cut = SamplingParams(temperature=1.0, max_tokens=5, structured_outputs=constrained(json=SCHEMA))
    stop = SamplingParams(temperature=1.0, max_tokens=400, stop=['"kind"'], structured_outputs=constrained(json=SCHEMA))
    free = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    prompts = [prompt, prompt, "plain text", prompt, prompt, "plain"]
    params = [json_params, json_params, free, cut, stop, free]
    llm.generate(prompt, SamplingParams(max_tokens=1))  # the picture's blocks cached before the batch
    outs = llm.generate(prompts, params)
    for o in outs[0].outputs + outs[1].outputs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert outs[0].num_cached_tokens > 0 and outs[1].num_cached_tokens > 0
    assert outs[3].outputs[0].finish_reason == "length" and len(outs[3].outputs[0].token_ids) == 5
    assert outs[4].outputs[0].finish_reason == "stop" and '"kind"' not in outs[4].outputs[0].text
    assert outs[4].outputs[0].text.startswith('{"name":')
    assert llm.engine.stats().num_preemptions > 0  # the resumed requests replayed their tokens
    assert_nothing_left(llm)


def test_a_token_the_text_leaves_out_is_never_part_of_a_constrained_answer(llm):
    """`<|im_start|>` and the other special tokens are skipped when the answer is decoded;
    a grammar that read them as text would let a string of them satisfy `minLength` and
    leave `"name": ""` in the answer. Pushed up by a logit bias, they are still refused,
    and the answer validates."""
    tokenizer = llm.engine.tokenizer
    skipped = [i for i in range(len(tokenizer)) if tokenizer.decode([i], skip_special_tokens=True) == ""]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in skipped
    bias = {i: 100.0 for i in skipped if i != eos}
    outs = llm.generate(["Describe a shape as JSON:"] * 2, [
        SamplingParams(temperature=0, max_tokens=400, logit_bias=bias, structured_outputs=constrained(json=SCHEMA)),
        SamplingParams(temperature=1.0, seed=7, max_tokens=400, logit_bias=bias, structured_outputs=constrained(json=SCHEMA)),
    ])
    for out in outs:
        answer = out.outputs[0]
        assert answer.finish_reason == "stop"
        assert not set(answer.token_ids) & set(bias), answer.token_ids
        jsonschema.validate(json.loads(answer.text), SCHEMA)
    assert_nothing_left(llm)


def test_hybrid_model_answers_validate(qwen35_path):
    llm = LLM(qwen35_path, num_kv_blocks=128, max_num_seqs=8)
    outs = llm.generate(["a", "b", "c", "d"], SamplingParams(temperature=1.0, max_tokens=400,
                                                             structured_outputs=constrained(json=SCHEMA)))
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nosuchtype"}}}), "'type' must be one of"),
    (dict(json={"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 1}}}),
     "JSON schema is not valid: minLength 3 is greater than maxLength 1"),
    (dict(regex="[a-"), "regex is not valid"),
    (dict(grammar="root ::= missing_rule"), "grammar is not valid"),
])
def test_an_invalid_spec_is_refused_before_it_is_queued(llm, spec, message):
    with pytest.raises(ParamError, match=message):
        llm.generate(["x"], SamplingParams(structured_outputs=constrained(**spec)))
    assert_nothing_left(llm)


def test_exactly_one_constraint():
    with pytest.raises(ParamError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ParamError, match="exactly one"):
        StructuredOutputsParams()


# -- the sampling parameters against a straightforward computation -------------------------------
def reference_rules(logits, prompts, outputs, rep, freq, pres, bias, banned):
    """Per request and per token, the way the parameters are defined."""
    out = logits.clone()
    for r in range(out.shape[0]):
        for t in banned[r]:
            out[r, t] = float("-inf")
        for t, b in bias[r].items():
            out[r, t] += b
        for t in set(prompts[r]) | set(outputs[r]):
            out[r, t] = out[r, t] / rep[r] if out[r, t] > 0 else out[r, t] * rep[r]
        for t in set(outputs[r]):
            out[r, t] -= freq[r] * outputs[r].count(t) + pres[r]
    return out


def test_bans_bias_and_penalties_equal_the_reference():
    g = torch.Generator().manual_seed(0)
    vocab, rows = 50, 4
    logits = torch.randn(rows, vocab, generator=g) * 3
    prompts = [[1, 2, 3, 3], [4, 5], [6], [7, 8, 9]]
    outputs = [[10, 10, 11], [], [1, 6, 6, 6], [12]]
    rep, freq, pres = [1.3, 1.0, 0.7, 2.0], [0.5, 0.0, 1.5, -0.5], [0.2, 1.0, -1.0, 0.0]
    bias = [{0: 5.0}, {}, {3: -2.5, 4: 1.0}, {49: 100.0}]
    banned = [[], [2, 7], [], [0]]
    width = max(len(p) + len(o) for p, o in zip(prompts, outputs))
    history = torch.zeros(rows, width, dtype=torch.long)
    for r, (p, o) in enumerate(zip(prompts, outputs)):
        history[r, : len(p) + len(o)] = torch.tensor(p + o)
    seen, generated = token_histories(history, torch.tensor([len(p) for p in prompts]),
                                        torch.tensor([len(p) + len(o) for p, o in zip(prompts, outputs)]), vocab)
    b_rows = [r for r in range(rows) for _ in banned[r]]
    l_rows = [r for r in range(rows) for _ in bias[r]]
    batch = SamplingBatch(
        temperature=torch.zeros(rows), top_k=torch.zeros(rows, dtype=torch.long), top_p=torch.ones(rows),
        min_p=torch.zeros(rows), generators=[None] * rows, num_logprobs=[None] * rows,
        banned=(torch.tensor(b_rows), torch.tensor([t for r in range(rows) for t in banned[r]])),
        logit_bias=(torch.tensor(l_rows), torch.tensor([t for r in range(rows) for t in bias[r]]),
                    torch.tensor([v for r in range(rows) for v in bias[r].values()])),
        penalties=Penalties(torch.tensor(rep), torch.tensor(freq), torch.tensor(pres), seen, generated),
    )
    got = apply_logit_rules(logits.clone(), batch)
    want = reference_rules(logits, prompts, outputs, rep, freq, pres, bias, banned)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("vocab, words", [(70, 3), (96, 3), (100, 3)])  # a tail; exact; tokens past the mask
def test_bitmask_application_equals_a_bit_by_bit_reading(vocab, words):
    g = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[1, 0], bitmask[2, 1] = 0, -1  # the fast paths: nothing allowed, everything allowed
    want = torch.randn(5, vocab, generator=g)
    logits = want.clone()
    rows = torch.tensor([4, 0, 2])
    for i, r in enumerate(rows.tolist()):
        for t in range(vocab):
            if not (t // 32 < words and (int(bitmask[i, t // 32]) >> (t % 32)) & 1):
                want[r, t] = float("-inf")
    for apply in (sampling.apply_token_bitmask, sampling.apply_token_bitmask_cpu):
        got = logits.clone()
        apply(got, rows, bitmask)
        assert torch.equal(got, want), apply.__name__


def test_min_p_penalties_bias_and_bad_words_end_to_end(llm):
    """Through the engine: a +100 bias makes a token the answer, a bad word never
    appears, min_p=1 keeps only the most likely token (sampling = greedy), a strong
    repetition penalty changes a greedy answer, and a huge presence penalty forbids
    repeats."""
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = llm.generate(["The shapes"], greedy)[0].outputs[0]
    target = tok.encode("circle", add_special_tokens=False)[0]
    biased = llm.generate(["The shapes"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                         logit_bias={target: 100.0}))[0].outputs[0]
    assert biased.token_ids == [target] * 3
    sampled_min_p = llm.generate(["The shapes"], SamplingParams(temperature=1.5, min_p=1.0, max_tokens=12,
                                                                ignore_eos=True, seed=5))[0].outputs[0]
    assert sampled_min_p.token_ids == base.token_ids
    # a word the greedy answer writes (a token that is whole letters and encodes back to itself)
    word = next(w for t in base.token_ids if (w := tok.decode([t]).strip()).isalpha() and w.isascii()
                and tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    banned = llm.generate(["The shapes"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                         bad_words=[word]))[0].outputs[0]
    assert banned.token_ids != base.token_ids
    for ids in [tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)]:
        assert not any(banned.token_ids[i : i + len(ids)] == ids for i in range(len(banned.token_ids)))
    fresh = llm.generate(["The shapes"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                        presence_penalty=2.0, logit_bias={target: 0.0},
                                                        repetition_penalty=1.0))[0].outputs[0]
    assert fresh.token_ids != biased.token_ids
    no_repeats = llm.generate(["The shapes"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                             repetition_penalty=1e6))[0].outputs[0]
    assert len(set(no_repeats.token_ids)) == len(no_repeats.token_ids)
    assert_nothing_left(llm)


def test_a_grammar_that_admits_only_a_bad_word_wins(llm):
    """A regex whose only answer is a bad word: the answer matches the regex (the format
    asked for wins), where banning it too would leave no token (a fuzzed request's 500)."""
    tok = llm.get_tokenizer()
    out = llm.generate(["0"], SamplingParams(temperature=0.0, max_tokens=8, bad_words=["0"],
                                             structured_outputs=constrained(regex="0")))[0].outputs[0]
    assert out.finish_reason == "stop" and tok.decode(out.token_ids, skip_special_tokens=True) == "0"
    assert_nothing_left(llm)


# -- tool-call blocks -------------------------------------------------------------------------------
def test_tool_call_blocks_parse_and_stream():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    content, calls = tool_calls.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    assert tool_calls.parse("no calls <tool_call>not json</tool_call>") == (
        "no calls <tool_call>not json</tool_call>", [])
    stream, got_content, got_calls = tool_calls.ToolCallStream(), "", []
    for end in range(1, len(text) + 1):  # one character at a time
        piece, calls = stream.feed(text[:end], final=end == len(text))
        assert "<tool" not in piece
        got_content += piece
        got_calls += calls
    assert got_content.strip() == "Let me check." and [c.name for c in got_calls] == ["get_weather", "add"]


def test_a_matcher_that_cannot_follow_its_answer_fails_that_request_alone(qwen25_path):
    """A grammar that refuses the tokens a request already has (what a resumed request
    replays) is that request's error; the other constrained requests still get masks."""
    from transformers import AutoTokenizer

    from vlmserve.structured_output.compiler import GrammarCompiler
    from vlmserve.structured_output.manager import StructuredOutputManager, tokenizer_info_of

    tok = AutoTokenizer.from_pretrained(qwen25_path)
    compiler = GrammarCompiler(lambda: tokenizer_info_of(tok, len(tok)), num_workers=1)
    try:
        compiled = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).result()
    finally:
        compiler.shutdown()
    manager = StructuredOutputManager(qwen25_path, len(tok), max_num_seqs=4)
    good = manager.request_grammar(compiled, [], [tok.eos_token_id])
    bad = manager.request_grammar(compiled, tok.encode("zzz", add_special_tokens=False), [tok.eos_token_id])
    step = manager.step_grammars([("bad", bad), ("good", good)])
    assert list(step.broken) == ["bad"] and "could not follow" in step.broken["bad"]
    assert step.bitmask.req_ids == ["good"] and step.bitmask.bitmask.shape[0] == 1 and not step.finished
