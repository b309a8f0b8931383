"""A structured-output spec as an xgrammar grammar, with xgrammar's output rewritten where
it would let an answer break its constraint. Built in a compile worker (compile_worker.py)
and by the compiler's threads, never on the event loop or the engine's step loop: a
schema nested a few hundred levels deep takes seconds to build."""

from __future__ import annotations

import json
import re
import uuid

import xgrammar as xgr

from vlmserve.sampling_params import ParamError, StructuredOutputsParams
from vlmserve.structured_output import ebnf
from vlmserve.structured_output.xml_calls import xml_call_grammar

# JSON is generated compact (no free whitespace): what parsers expect, and a model cannot
# wander off into spaces and newlines
SEPARATORS = (",", ":")


def build_grammar(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The spec's grammar; ParamError saying what is wrong when it has none."""
    try:
        if spec.tool_call_xml:  # a forced call in Qwen's XML form
            return xml_call_grammar(spec.json, json_schema_grammar, _characters_only)
        if spec.json is not None:
            # the schema as written: no property or item it does not declare (OpenAI's strict)
            grammar = json_schema_grammar(spec.json)
            if spec.tool_call_tags is not None:  # a call in the model's tool-call format
                begin, end = spec.tool_call_tags
                grammar = xgr.Grammar.concat(_literal_grammar(begin), grammar, _literal_grammar(end))
            return grammar
        if spec.json_object:
            return json_schema_grammar({"type": "object"}, strict=False)
        if spec.regex is not None:
            return _characters_only(str(xgr.Grammar.from_regex(spec.regex)), "regex", regex_dots=True)
        if spec.choice is not None:
            return _characters_only("root ::= " + " | ".join(ebnf.make_literal(c) for c in spec.choice),
                                    "choice list")
        return _characters_only(str(_grammar_from_text(spec.grammar)), "grammar")
    except ParamError:
        raise
    except Exception as e:  # xgrammar's parse errors name the fault: keep it, without its source line
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = _SOURCE.sub("", lines[0])
        raise ParamError("structured_outputs", f"the {spec.name} is not valid: {reason}") from None


def json_schema_grammar(schema: dict | str, strict: bool = True) -> xgr.Grammar:
    """A JSON schema's grammar, corrected where xgrammar 0.2.8 gets it wrong:
    - the characters of a string with a length bound are [^"\\\r\n], which lets raw
      control characters through (JSON forbids them): excluded, as in unbounded strings;
    - its rules for values of any type put a space after commas: removed (compact);
    - a `pattern` is matched by a regex mode of its own that skips parts of some patterns
      (an optional group holding a bounded repetition, `(x[0-9]{1,9})?`, let "0" through)
      and writes a quote or a backslash unescaped: each pattern is compiled as regex specs
      are, and written as JSON string content (quotes, backslashes and control characters
      escaped);
    - the class it writes for a regex's `.` spans line terminators and surrogates."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    patterns: list[str] = []
    marker = f"vlmserve_pattern_{uuid.uuid4().hex}_"
    schema = _patterns_as_markers(schema, marker, patterns)
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=SEPARATORS, strict_mode=strict)
    rules = [_pattern_rules(f"json_pattern_{i}", p) for i, p in enumerate(patterns)]

    def literal(token: str) -> str:
        if token.startswith('"\\"' + marker):
            return f'("\\"" json_pattern_{token[len(marker) + 3 : -3]} "\\"")'
        return _COMPACT.get(token, token)

    text = ebnf.rewrite(str(grammar), literal=literal,
                        char_class=lambda c: _JSON_STRING_CHARS if c == _BOUNDED_STRING_CHARS else c)
    if "Regex(" in text:
        raise ParamError("structured_outputs", "the JSON schema has a pattern the grammar engine matches inexactly")
    return _characters_only("\n".join([text, *rules]), "JSON schema", regex_dots=True)


def _patterns_as_markers(schema, marker: str, patterns: list[str]):
    """The schema with each string `pattern` replaced by a const marker (its grammar is
    put in its place afterwards); the patterns in marker order."""
    if isinstance(schema, list):
        return [_patterns_as_markers(s, marker, patterns) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _patterns_as_markers(v, marker, patterns) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}
    if isinstance(out.get("pattern"), str) and not {"const", "enum"} & set(out):
        kinds = out.get("type", "string")
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        patterns.append(out.pop("pattern"))
        string = {"const": f"{marker}{len(patterns) - 1}"}
        others = [k for k in kinds if k != "string"]
        if not others:
            return string
        out["type"] = others
        return {"anyOf": [string, out]}
    return out


def _pattern_rules(rule: str, regex: str) -> str:
    """The rules of a pattern's regex, the first named `rule`, as JSON string content."""
    try:
        rules = str(xgr.Grammar.from_regex(regex))
    except Exception as e:
        raise ParamError("structured_outputs", f"the JSON schema's pattern {regex!r} is not supported: "
                         f"{_SOURCE.sub('', str(e).strip().splitlines()[0])}") from None
    prefix = rule + "__rx"
    renamed = ebnf.rewrite(rules, name=lambda n: rule if n == "root" else (prefix + n[4:] if n.startswith("root_")
                                                                          else n))
    return ebnf.rewrite(renamed, literal=_json_content_literal, char_class=_json_content_class).strip()


def _json_content_literal(literal: str) -> str:
    """A literal of a pattern's text as it is written inside a JSON string."""
    return ebnf.make_literal(json.dumps(ebnf.literal_text(literal), ensure_ascii=False)[1:-1])


def _json_content_class(char_class: str) -> str:
    """A class of a pattern's characters less those a JSON string writes escaped (quote,
    backslash, control characters): stricter, never invalid."""
    if char_class == _ANY_CHAR_CLASS:  # a regex's `.`: no line terminator either
        return ebnf.class_excluding(char_class, _LINE_TERMINATORS + _JSON_ESCAPED)
    return ebnf.class_excluding(char_class, _JSON_ESCAPED)


def _literal_grammar(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf("root ::= " + ebnf.make_literal(text))


def _characters_only(text: str, what: str, regex_dots: bool = False) -> xgr.Grammar:
    """EBNF text as a grammar where no character class admits a surrogate (U+D800-U+DFFF).
    xgrammar matches code points by their UTF-8 form, and classes that span the surrogates
    admit their encodings, which are not characters: a decoder makes each three U+FFFD,
    so a `maxLength` string or a regex's `.{1,3}` came out longer than allowed, and
    `[\\u0000-\\uffff]{2}` four characters. A literal naming a surrogate is refused. With
    regex_dots, the class xgrammar writes for a regex's `.` (every code point) also leaves
    out the line terminators, as `.` does in JSON Schema's (ECMA-262) regexes and
    Python's."""
    def literal(token: str) -> str:
        for code in ebnf.code_points(token[1:-1]):
            if _SURROGATES[0][0] <= code <= _SURROGATES[0][1]:
                raise ParamError("structured_outputs", f"the {what} asks for U+{code:04X}, a surrogate code "
                                 f"point, which is not a character")
        return token

    def char_class(token: str) -> str:
        excluded = _SURROGATES + (_LINE_TERMINATORS if regex_dots and token == _ANY_CHAR_CLASS else [])
        return ebnf.class_excluding(token, excluded)

    return xgr.Grammar.from_ebnf(ebnf.rewrite(text, literal=literal, char_class=char_class))


_SURROGATES = [(0xD800, 0xDFFF)]
_LINE_TERMINATORS = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_JSON_ESCAPED = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_ANY_CHAR_CLASS = r"[\0-\U0010ffff]"  # how xgrammar writes a regex's `.`
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'
_COMPACT = {'", "': '","', '": "': '":"'}
_SOURCE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _grammar_from_text(text: str) -> xgr.Grammar:
    """EBNF as xgrammar (and llama.cpp's GBNF) write it, or else Lark."""
    try:
        return xgr.Grammar.from_ebnf(text)
    except Exception as ebnf_error:
        try:
            return xgr.Grammar.from_lark(text)
        except Exception:
            raise ebnf_error from None
