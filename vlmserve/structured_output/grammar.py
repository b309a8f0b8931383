"""A request's structured-output spec as an xgrammar grammar. Building the grammar needs
no tokenizer and takes well under a millisecond, so the front end does it to refuse a bad
schema, regex or grammar before the request is queued; the engine core compiles the same
grammar for its tokenizer."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from vlmserve.sampling_params import ParamError, StructuredOutputsParams

# JSON is generated compact (no free whitespace): what parsers expect, and a model cannot
# wander off into spaces and newlines
SEPARATORS = (",", ":")


def build_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The spec's grammar; ParamError saying what is wrong when it has none."""
    kind = spec.key[0]
    try:
        if spec.json is not None:
            # the schema as written: no property or item it does not declare (OpenAI's strict)
            return json_schema_grammar(spec.json)
        if spec.json_object:
            return json_schema_grammar({"type": "object"}, strict=False)
        if spec.regex is not None:
            return _characters_only(str(xgr.Grammar.from_regex(spec.regex)))
        if spec.choice is not None:
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return _grammar_from_text(spec.grammar)
    except ParamError:
        raise
    except Exception as e:  # xgrammar's parse errors name the fault: keep it, without its source line
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = _SOURCE.sub("", lines[0])
        raise ParamError("structured_outputs", f"the {_NAMES[kind]} is not valid: {reason}") from None


def json_schema_grammar(schema: dict | str, strict: bool = True) -> xgr.Grammar:
    """A JSON schema's grammar, compact. xgrammar 0.2.8 writes the characters of a string
    with a length bound as [^"\\\r\n], which lets raw control characters through (JSON
    forbids them; parsers refuse the answer): they are excluded, as in its unbounded
    strings."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=SEPARATORS, strict_mode=strict)
    return _characters_only(str(grammar).replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS))


def _characters_only(ebnf: str) -> xgr.Grammar:
    """xgrammar's EBNF as a grammar with no character class admitting a surrogate
    (U+D800-U+DFFF). xgrammar matches code points by their UTF-8 form, and its negated
    classes and `.` admit the surrogates' encodings, which are not characters: a decoder
    makes each three U+FFFD, so a `maxLength` string or a regex's `.{1,3}` came out longer
    than allowed."""
    text, out, i = ebnf, [], 0
    while i < len(text):
        c = text[i]
        if c == '"':  # a literal: copied as is
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif c == "[":
            j = i + 1
            while text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            chars = text[i + 1 : j]
            if chars == _ANY_CHAR:
                chars = "^" + _SURROGATES
            elif chars.startswith("^") and _SURROGATES not in chars:
                chars += _SURROGATES
            out.append("[" + chars + "]")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return xgr.Grammar.from_ebnf("".join(out))


_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'
_SURROGATES = r"\ud800-\udfff"
_ANY_CHAR = r"\0-\U0010ffff"  # how xgrammar writes a regex's `.`
_SOURCE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice list",
          "grammar": "grammar"}


def _grammar_from_text(text: str) -> xgr.Grammar:
    """EBNF as xgrammar (and llama.cpp's GBNF) write it, or else Lark."""
    try:
        return xgr.Grammar.from_ebnf(text)
    except Exception as ebnf_error:
        try:
            return xgr.Grammar.from_lark(text)
        except Exception:
            raise ebnf_error from None
