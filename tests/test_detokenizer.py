"""Incremental detokenization: text released token by token equals the tokenizer's own
decode of the whole answer, for the streaming decoder of fast tokenizers (the tokenizers
library's DecodeStream) and the general one (two decodes a token)."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from vlmserve.engine.model_source import SHIPPED_MODEL
from vlmserve.engine.output_processor import IncrementalDetokenizer, StreamDetokenizer, make_detokenizer
from vlmserve.testing.checkpoints import gemma_tokenizer

ANSWERS = ["a small green square moving up.", "Héllo wörld 🟢 — ünïcode ✓, 数字 42!"]


def tokenizers():
    yield "shipped", AutoTokenizer.from_pretrained(SHIPPED_MODEL), "<|im_end|>"
    yield "gemma test", gemma_tokenizer(None, 512), "<eos>"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizers_release_the_text_the_tokenizer_decodes(skip_special_tokens):
    for name, tokenizer, end in tokenizers():
        prompt = tokenizer.encode("Describe the picture:")
        for answer in ANSWERS:
            ids = tokenizer.encode(answer + end, add_special_tokens=False)
            want = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            stream = make_detokenizer(tokenizer, prompt, skip_special_tokens)
            assert isinstance(stream, StreamDetokenizer), name
            general = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
            one_by_one = "".join(stream.append([i]) for i in ids)
            in_pairs = make_detokenizer(tokenizer, prompt, skip_special_tokens)
            paired = "".join(in_pairs.append(ids[i : i + 2]) for i in range(0, len(ids), 2))
            assert one_by_one == paired == want, (name, answer)
            assert "".join(general.append([i]) for i in ids) == want, (name, answer)
            # nothing is released in the middle of a character split across tokens
            partial = make_detokenizer(tokenizer, prompt, skip_special_tokens)
            assert all("\ufffd" not in partial.append([i]) for i in ids)


def test_tokenizers_that_clean_up_spaces_take_the_general_detokenizer():
    tokenizer = copy.deepcopy(AutoTokenizer.from_pretrained(SHIPPED_MODEL))
    tokenizer.clean_up_tokenization_spaces = True  # transformers' clean-up is not in the Rust decoder
    assert isinstance(make_detokenizer(tokenizer, [], True), IncrementalDetokenizer)


def test_an_id_outside_the_vocabulary_decodes_to_nothing_and_the_answer_goes_on():
    """A sampled id past the tokenizer (a model's vocabulary may be larger) is no fault."""
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    ids = tokenizer.encode("a small circle.", add_special_tokens=False)
    for detok in (make_detokenizer(tokenizer, [], True), IncrementalDetokenizer(tokenizer, [], True)):
        assert detok.append([len(tokenizer) + 5, 10**6]) == ""
        assert "".join(detok.append([i]) for i in ids) == "a small circle."
