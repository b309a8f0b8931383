"""The grammar of a forced tool call in Qwen's XML form (Qwen3-Coder, Qwen3.5: a
`<function=name>` block of `<parameter=name>` blocks inside `<tool_call>`, as
entrypoints/openai/tool_calls_xml.py shows and reads it), built from the calls' JSON schema (one `{"name": {"const": ...}, "arguments": {...}}`
schema per tool, under `anyOf` when several): the parameters in the order the tool lists
them, the required ones always, the others optional; a string parameter's value is its
text (no `<`: the tags stay unambiguous; an enum, one of its values), any other a compact
JSON value of its schema, as the parser converts it back."""

from __future__ import annotations

from typing import Any

import xgrammar as xgr

from vlmserve.sampling_params import ParamError
from vlmserve.structured_output import ebnf

TEXT_VALUE = r"[^<]*"


def xml_call_grammar(schema: dict[str, Any], json_grammar, characters_only) -> xgr.Grammar:
    """One call of any of the tools the schema lists. json_grammar and characters_only are
    grammar.py's (a JSON value's grammar, and the surrogate-free rewrite of EBNF text)."""
    calls = schema.get("anyOf", [schema])
    rules = ["root ::= " + " | ".join(f"call_{i}" for i in range(len(calls)))]
    for i, call in enumerate(calls):
        rules += _call_rules(i, call, json_grammar)
    return characters_only("\n".join(rules), "tool call")


def _call_rules(i: int, call: dict[str, Any], json_grammar) -> list[str]:
    try:
        named = call["properties"]["name"]  # a const, or the one-value enum the schema checks make of it
        name = named["const"] if "const" in named else named["enum"][0]
        parameters = call["properties"]["arguments"]
    except (KeyError, TypeError, IndexError):
        raise ParamError("tools", "a tool call's schema needs a name and arguments") from None
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    body = [ebnf.make_literal(f"<tool_call>\n<function={name}>\n")]
    rules = []
    for j, (param, param_schema) in enumerate(properties.items()):
        value, value_rules = _value(f"v{i}_{j}_", param_schema, json_grammar)
        rules += value_rules
        rules.append(f"p{i}_{j} ::= {ebnf.make_literal(f'<parameter={param}>' + chr(10))} {value} "
                     f"{ebnf.make_literal(chr(10) + '</parameter>' + chr(10))}")
        body.append(f"p{i}_{j}" + ("" if param in required else "?"))
    body.append(ebnf.make_literal("</function>\n</tool_call>"))
    return [f"call_{i} ::= " + " ".join(body), *rules]


def _value(prefix: str, schema: Any, json_grammar) -> tuple[str, list[str]]:
    """A parameter value's expression and the rules it needs."""
    if not isinstance(schema, dict):
        schema = {}
    if is_text_parameter(schema):
        if isinstance(schema.get("enum"), list):
            return "(" + " | ".join(ebnf.make_literal(str(v)) for v in schema["enum"]) + ")", []
        return TEXT_VALUE, []
    text = str(json_grammar(schema))
    renamed = ebnf.rewrite(text, name=lambda n: prefix + n)
    return prefix + "root", [line for line in renamed.splitlines() if line.strip()]


def is_text_parameter(schema: dict[str, Any]) -> bool:
    """A string parameter: written as plain text, not as JSON (anything else, an optional
    string's anyOf among them, is written as JSON and read back as JSON)."""
    kind = schema.get("type")
    if kind == "string":
        return True
    enum = schema.get("enum")
    return kind is None and isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)
