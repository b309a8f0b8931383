"""What a structured-output spec may ask for before anything compiles it: size limits,
and for JSON schemas the keywords the grammar engine enforces. A keyword that would be
silently ignored (xgrammar skips `not`, `allOf`, `uniqueItems`, ...) is refused, so an
answer never breaks the schema it was asked to follow; `allOf` and `$ref` with siblings
are merged into one schema where that is exact, and `oneOf` becomes `anyOf` where no
value can match two branches. Everything here is linear in the spec's size and runs in
the front end, before the request is queued."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from vlmserve.sampling_params import ParamError, StructuredOutputsParams


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on what one request may ask the grammar compiler to do (each a flag)."""

    max_bytes: int = 65536  # a spec's size: the schema's JSON, the regex, the grammar, the choices
    max_schema_depth: int = 32  # nested subschemas
    max_schema_properties: int = 512  # object properties across the whole schema
    max_regex_chars: int = 4096  # a regex, or one `pattern` of a schema


# checked by the grammar engine (see tests/test_structured_output.py for each)
_ENFORCED = {
    "type", "enum", "const", "properties", "required", "additionalProperties", "minProperties", "maxProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
}
# validation keywords the grammar engine would skip: refused
_UNSUPPORTED = {
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
    "minContains", "maxContains", "uniqueItems", "unevaluatedProperties", "unevaluatedItems",
    "additionalItems", "$dynamicRef", "$recursiveRef", "contentSchema",
    # property names by pattern: matched by a regex mode of xgrammar's that is inexact
    "patternProperties", "propertyNames",
}
MAX_MULTIPLES = 1000
# string formats the grammar engine enforces; any other format is refused
FORMATS = {"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
           "uri-reference", "json-pointer"}
# keywords whose value is one subschema / a list of them / a map of them
_SUB = ("additionalProperties", "items")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_MAPS = ("properties", "$defs", "definitions")
_TYPES = {"string", "number", "integer", "boolean", "null", "array", "object"}


def check_spec(spec: StructuredOutputsParams, limits: GrammarLimits) -> StructuredOutputsParams:
    """The spec as it will be compiled (JSON schemas normalised), or ParamError saying what
    is over a limit or cannot be enforced."""
    size = len(spec.key[1].encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise ParamError("structured_outputs", f"the {spec.name} is {size} bytes, over this server's limit of "
                         f"{limits.max_bytes} (--max-grammar-bytes)")
    for value in spec.choice or ():
        _check_text(value, "choice")
    if spec.regex is not None:
        _check_regex(spec.regex, limits, "structured_outputs.regex")
    if spec.grammar is not None:
        _check_text(spec.grammar, "grammar")
    if spec.json is None:
        return spec
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ParamError("structured_outputs", f"the JSON schema is not valid JSON: {e}") from None
    return replace(spec, json=SchemaChecker(schema, limits).normalized())


def check_tool_parameters(parameters: Any, where: str) -> None:
    """A tool's parameters must describe a JSON object (OpenAI sends arguments as one)."""
    if parameters is None:
        return
    kind = parameters.get("type", "object") if isinstance(parameters, dict) else None
    if kind != "object":
        raise ParamError("tools", f"{where}.parameters must be a JSON schema of type object (the arguments are "
                         f"a JSON object), got {json.dumps(parameters)[:80]}")


def _check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError("structured_outputs", f"the {what} holds a lone surrogate ({text[e.start]!r}), "
                         f"which is not a character") from None


def _check_regex(regex: str, limits: GrammarLimits, where: str) -> None:
    if len(regex) > limits.max_regex_chars:
        raise ParamError("structured_outputs", f"{where} is {len(regex)} characters, over this server's limit of "
                         f"{limits.max_regex_chars} (--max-regex-chars)")
    _check_text(regex, "regex")


class SchemaChecker:
    """One walk over a JSON schema: limits, keywords, $ref targets and cycles; then the
    rewrites that make it exact for the grammar engine (allOf merged, oneOf as anyOf)."""

    def __init__(self, schema: Any, limits: GrammarLimits) -> None:
        if not isinstance(schema, dict):
            raise ParamError("structured_outputs", f"a JSON schema must be an object, got {type(schema).__name__}")
        self.root = schema
        self.limits = limits
        self.num_properties = 0

    def normalized(self) -> dict:
        self._walk(self.root, "#", 0)
        self._check_ref_cycles()
        return self._rewrite(_copy(self.root), "#")

    # -- checks -------------------------------------------------------------------------------
    def _fail(self, where: str, message: str) -> ParamError:
        if len(where) > 80:  # deep in a schema: its start and its end
            where = where[:40] + "..." + "/".join([""] + where.split("/")[-2:])
        return ParamError("structured_outputs", f"the JSON schema at {where}: {message}")

    def _walk(self, schema: Any, where: str, depth: int) -> None:
        if isinstance(schema, bool):
            return
        if not isinstance(schema, dict):
            raise self._fail(where, f"a schema must be an object or a boolean, got {json.dumps(schema)[:60]}")
        if depth > self.limits.max_schema_depth:
            raise self._fail(where, f"nested deeper than this server's limit of {self.limits.max_schema_depth} "
                             f"subschemas (--max-schema-depth)")
        for key in schema:
            if key in _UNSUPPORTED and not (key == "uniqueItems" and schema[key] is False):
                raise self._fail(where, f"'{key}' is not supported: the grammar engine cannot enforce it, and an "
                                 f"answer could break it")
        self._check_values(schema, where)
        properties = schema.get("properties") or {}
        self.num_properties += len(properties)
        if self.num_properties > self.limits.max_schema_properties:
            raise self._fail(where, f"more than this server's limit of {self.limits.max_schema_properties} "
                             f"properties in all (--max-schema-properties)")
        for key in _SUB:
            if key in schema and not isinstance(schema[key], bool):
                self._walk(schema[key], f"{where}/{key}", depth + 1)
        for key in _SUB_LISTS:
            if key in schema:
                if not isinstance(schema[key], list) or not schema[key]:
                    raise self._fail(where, f"'{key}' must be a non-empty list of schemas")
                for i, sub in enumerate(schema[key]):
                    self._walk(sub, f"{where}/{key}/{i}", depth + 1)
        for key in _SUB_MAPS:
            if key in schema:
                if not isinstance(schema[key], dict):
                    raise self._fail(where, f"'{key}' must be an object of schemas")
                for name, sub in schema[key].items():
                    self._walk(sub, f"{where}/{key}/{name}", depth + 1)

    def _check_values(self, schema: dict, where: str) -> None:
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if kinds is not None and (not isinstance(kinds, list) or not set(kinds) <= _TYPES or not kinds):
            raise self._fail(where, f"'type' must be one of {sorted(_TYPES)} or a list of them, "
                             f"got {json.dumps(schema['type'])[:60]}")
        fmt = schema.get("format")
        if fmt is not None and fmt not in FORMATS and (kinds is None or "string" in kinds):
            raise self._fail(where, f"the string format {fmt!r} is not supported (supported: {sorted(FORMATS)})")
        if "multipleOf" in schema and (kinds != ["integer"] or not isinstance(schema["multipleOf"], int)
                                       or schema["multipleOf"] < 1):
            raise self._fail(where, "'multipleOf' is supported on integers by a positive integer only")
        if isinstance(schema.get("pattern"), str):
            _check_regex(schema["pattern"], self.limits, f"{where}/pattern")
        if isinstance(schema.get("items"), list):
            raise self._fail(where, "'items' as a list is the old form of 'prefixItems': use prefixItems")
        if "$ref" in schema:
            self._target(schema["$ref"], where)
        properties = schema.get("properties") or {}
        allows_others = schema.get("additionalProperties", False) is not False
        for name in schema.get("required") or []:
            if name not in properties and not allows_others:
                raise self._fail(where, f"the required property {name!r} is not among the properties, and no "
                                 f"other property is allowed: no value matches")
        for text in _strings(schema.get("enum"), schema.get("const")):
            _check_text(text, "schema")

    def _target(self, ref: Any, where: str) -> Any:
        """The subschema a local $ref points to."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise self._fail(where, f"only local references ('#/...') are supported, got {json.dumps(ref)[:60]}")
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise self._fail(where, f"the reference {ref!r} points to nothing")
        return node

    def _check_ref_cycles(self) -> None:
        """A schema that reaches itself through $ref, anyOf, oneOf or allOf alone, never
        through a property or an item, describes no finite value."""
        edges: dict[str, list[str]] = {}

        def collect(schema: Any, where: str) -> None:
            if not isinstance(schema, dict):
                return
            out = edges.setdefault(where, [])
            if "$ref" in schema:
                out.append(_pointer(schema["$ref"]))
            for key in ("anyOf", "oneOf", "allOf"):
                out += [f"{where}/{key}/{i}" for i in range(len(schema.get(key, [])))]
            for key in _SUB:
                collect(schema.get(key), f"{where}/{key}")
            for key in _SUB_LISTS:
                for i, sub in enumerate(schema.get(key, [])):
                    collect(sub, f"{where}/{key}/{i}")
            for key in _SUB_MAPS:
                for name, sub in schema.get(key, {}).items():
                    collect(sub, f"{where}/{key}/{name}")

        collect(self.root, "#")
        state: dict[str, int] = {}  # 1: on the path, 2: done
        for start in edges:
            stack = [(start, iter(edges.get(start, [])))]
            if state.get(start):
                continue
            state[start] = 1
            while stack:
                node, children = stack[-1]
                child = next(children, None)
                if child is None:
                    state[node] = 2
                    stack.pop()
                elif state.get(child) == 1:
                    raise self._fail(child, "it refers back to itself through $ref/anyOf/oneOf/allOf without a "
                                     "property or item in between: it describes no finite value")
                elif not state.get(child):
                    state[child] = 1
                    stack.append((child, iter(edges.get(child, []))))

    # -- rewrites -------------------------------------------------------------------------------
    def _rewrite(self, schema: Any, where: str) -> Any:
        """The schema in the forms the grammar engine enforces exactly (each rule below is
        one it would otherwise get wrong), or ParamError where there is none."""
        if not isinstance(schema, dict):
            return schema
        for key in _SUB:
            if key in schema:
                schema[key] = self._rewrite(schema[key], f"{where}/{key}")
        for key in _SUB_LISTS:
            if key in schema:
                schema[key] = [self._rewrite(s, f"{where}/{key}/{i}") for i, s in enumerate(schema[key])]
        for key in _SUB_MAPS:
            if key in schema:
                schema[key] = {n: self._rewrite(s, f"{where}/{key}/{n}") for n, s in schema[key].items()}
        if "$ref" in schema and _constraints(schema) - {"$ref"}:
            # it ignores the siblings of a $ref: they constrain the same value, so merge them
            siblings = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {"allOf": [siblings, self._resolved(schema["$ref"], where)]}
        if "allOf" in schema:  # it ignores allOf
            for part in schema.pop("allOf"):
                if isinstance(part, dict) and set(part) == {"$ref"}:
                    part = self._resolved(part["$ref"], where)
                schema = self._merge(schema, part, where)
        if "oneOf" in schema:  # it takes oneOf as anyOf: the same only where no value matches two
            if not _disjoint(schema["oneOf"]):
                raise self._fail(where, "'oneOf' is supported where no value can match two of its schemas "
                                 "(different types, or a required property with different const values); "
                                 "use anyOf")
            schema["anyOf"] = schema.pop("oneOf")
        if "anyOf" in schema and _constraints(schema) - {"anyOf"}:
            # it ignores the siblings of anyOf: each branch gets them
            schema = self._distribute(schema, where)
        if "enum" in schema or "const" in schema:
            schema = self._filter_values(schema, where)
        if "format" in schema or "pattern" in schema:
            schema = self._string_pattern(schema, where)
        if "multipleOf" in schema and {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & set(schema):
            schema = self._multiples(schema, where)
        return schema

    def _resolved(self, ref: str, where: str) -> Any:
        return self._rewrite(_copy(self._target(ref, where)), where)

    def _distribute(self, schema: dict, where: str) -> dict:
        siblings = {k: v for k, v in schema.items() if k not in ("anyOf", "$defs", "definitions")}
        branches = []
        for branch in schema["anyOf"]:
            if isinstance(branch, dict) and set(branch) == {"$ref"}:
                branch = self._resolved(branch["$ref"], where)
            try:
                branches.append(self._merge(dict(siblings), branch, where))
            except _NoValue:
                continue  # a branch no value matches with the siblings: dropped
        if not branches:
            raise self._fail(where, "no branch of 'anyOf' can hold with the keywords beside it: no value matches")
        kept = {k: v for k, v in schema.items() if k in ("$defs", "definitions") or k in _ANNOTATIONS}
        return {**kept, "anyOf": branches}

    def _filter_values(self, schema: dict, where: str) -> dict:
        """It answers with any value of enum/const, whatever else the schema says: keep the
        values that hold with the rest of it."""
        values = [schema["const"]] if "const" in schema else list(schema["enum"])
        if "const" in schema and "enum" in schema:
            values = [v for v in values if any(_same(v, e) for e in schema["enum"])]
        rest = _constraints(schema) - {"enum", "const"}
        unsure = rest - set(_VALUE_CHECKS)
        if unsure:
            raise self._fail(where, f"'enum'/'const' beside {sorted(unsure)} is not supported")
        values = [v for v in values if all(_VALUE_CHECKS[k](v, schema[k], schema) for k in rest)]
        if not values:
            raise self._fail(where, "no value of 'enum'/'const' holds with the keywords beside it: no value matches")
        return {**{k: v for k, v in schema.items() if k in _ANNOTATIONS}, "enum": values}

    def _string_pattern(self, schema: dict, where: str) -> dict:
        """A string format as the pattern that checks it exactly (its own formats let through
        February 30, second 60, octets with leading zeros and labels of any length); a
        length beside a pattern or a format it would ignore."""
        kinds = _types(schema)
        if kinds is not None and "string" not in kinds:
            return schema  # format is an annotation on other types
        if "format" in schema and "pattern" in schema:
            raise self._fail(where, "'format' and 'pattern' on one string are not supported together")
        if ("minLength" in schema or "maxLength" in schema) and ("format" in schema or "pattern" in schema):
            raise self._fail(where, "'minLength'/'maxLength' beside 'pattern' or 'format' are not supported: "
                             "bound the length in the pattern")
        fmt = schema.get("format")
        if fmt in _FORMAT_PATTERNS:
            schema = {k: v for k, v in schema.items() if k != "format"}
            schema["pattern"] = _FORMAT_PATTERNS[fmt]
        return schema

    def _multiples(self, schema: dict, where: str) -> dict:
        """It ignores multipleOf beside a bound: the multiples in the range, as an enum."""
        m = schema["multipleOf"]
        lo = max([schema.get("minimum", -math.inf), schema.get("exclusiveMinimum", -math.inf) + 1e-9])
        hi = min([schema.get("maximum", math.inf), schema.get("exclusiveMaximum", math.inf) - 1e-9])
        if math.isinf(lo) or math.isinf(hi) or (hi - lo) / m > MAX_MULTIPLES:
            raise self._fail(where, f"'multipleOf' beside a bound is supported where both bounds are given and the "
                             f"range holds at most {MAX_MULTIPLES} multiples")
        values = list(range(math.ceil(lo / m) * m, math.floor(hi / m) * m + 1, m))
        if not values:
            raise self._fail(where, "no multiple of 'multipleOf' lies within the bounds: no value matches")
        return {**{k: v for k, v in schema.items() if k in _ANNOTATIONS}, "enum": values}

    def _merge(self, a: dict, b: Any, where: str) -> dict:
        """One schema that a value matches exactly when it matches both (allOf)."""
        if b is True:
            return a
        if b is False or not isinstance(b, dict):
            raise _NoValue(self._fail(where, "'allOf' holds a schema that no value matches"))
        if "$ref" in b or "anyOf" in b or "oneOf" in b:
            raise self._fail(where, "'allOf' of schemas with $ref, anyOf or oneOf inside is not supported")
        a, b = self._closed_to(a, b, where), self._closed_to(b, a, where)
        out = dict(a)
        for key, value in b.items():
            if key not in out or out[key] == value or key in _ANNOTATIONS:
                out.setdefault(key, value)
            elif key == "type":
                mine, theirs = _types(out), _types(b)
                common = _intersect_types(set(mine), set(theirs))
                if not common:
                    raise _NoValue(self._fail(where, f"'allOf' asks for types {sorted(mine)} and {sorted(theirs)} at "
                                              f"once: no value matches"))
                out[key] = sorted(common) if len(common) > 1 else common.pop()
            elif key == "required":
                out[key] = list(dict.fromkeys(out[key] + value))
            elif key == "properties":
                clash = [n for n in value if n in out[key] and out[key][n] != value[n]]
                if clash:
                    raise self._fail(where, f"'allOf' gives the property {clash[0]!r} two different schemas, "
                                     f"which is not supported")
                out[key] = {**out[key], **value}
            elif key == "additionalProperties" and False in (out[key], value):
                out[key] = False  # each side's names are pruned to what the other allows
            elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties"):
                out[key] = max(out[key], value)
            elif key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"):
                out[key] = min(out[key], value)
            else:
                raise self._fail(where, f"'allOf' gives '{key}' two different values, which is not supported")
        return out


    def _closed_to(self, part: dict, other: dict, where: str) -> dict:
        """`part` without the properties that `other` forbids: in JSON Schema, an object
        schema's additionalProperties (absent: anything) judges every name it does not
        declare, whichever schema of the allOf declares it."""
        closed = other.get("additionalProperties", True)
        if closed is True or not part.get("properties"):
            return part
        foreign = [n for n in part["properties"] if n not in (other.get("properties") or {})]
        if not foreign:
            return part
        if closed is not False:
            raise self._fail(where, "'allOf' of object schemas whose additionalProperties is a schema is not "
                             "supported")
        required = [n for n in foreign if n in (part.get("required") or []) or n in (other.get("required") or [])]
        if required:
            raise _NoValue(self._fail(where, f"'allOf' requires the property {required[0]!r}, which another of its "
                                      f"schemas does not allow: no value matches"))
        return {**part, "properties": {n: v for n, v in part["properties"].items() if n not in foreign}}


class _NoValue(ParamError):
    """A merge whose result no value matches."""

    def __init__(self, error: ParamError) -> None:
        super().__init__(error.param, str(error))


_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$anchor"}


def _copy(schema: Any) -> Any:
    """A copy that shares nothing (a schema built in Python may hold one dict twice, and
    the rewrites change dicts in place)."""
    return json.loads(json.dumps(schema))


def _constraints(schema: dict) -> set[str]:
    """The keywords of a schema that constrain its value (not annotations, not $defs)."""
    return {k for k in schema if k in _ENFORCED} - {"$defs", "definitions"}


def _types(schema: dict) -> list[str] | None:
    kinds = schema.get("type")
    return [kinds] if isinstance(kinds, str) else kinds


def _is_type(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, {"number": (int, float), "string": str, "array": list, "object": dict}[kind])


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 equals 1.0, true does not equal 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# keyword -> whether a value (of enum/const) holds with it: a keyword applies to its own type only
_VALUE_CHECKS = {
    "type": lambda v, k, s: any(_is_type(v, t) for t in _types(s)),
    "minLength": lambda v, k, s: not isinstance(v, str) or len(v) >= k,
    "maxLength": lambda v, k, s: not isinstance(v, str) or len(v) <= k,
    "pattern": lambda v, k, s: not isinstance(v, str) or re.search(k, v) is not None,
    "format": lambda v, k, s: not isinstance(v, str) or k not in _FORMAT_PATTERNS or
    re.fullmatch(_FORMAT_PATTERNS[k], v) is not None,
    "minimum": lambda v, k, s: not _number(v) or v >= k,
    "maximum": lambda v, k, s: not _number(v) or v <= k,
    "exclusiveMinimum": lambda v, k, s: not _number(v) or v > k,
    "exclusiveMaximum": lambda v, k, s: not _number(v) or v < k,
    "multipleOf": lambda v, k, s: not _number(v) or v % k == 0,
    "minItems": lambda v, k, s: not isinstance(v, list) or len(v) >= k,
    "maxItems": lambda v, k, s: not isinstance(v, list) or len(v) <= k,
    "minProperties": lambda v, k, s: not isinstance(v, dict) or len(v) >= k,
    "maxProperties": lambda v, k, s: not isinstance(v, dict) or len(v) <= k,
    "required": lambda v, k, s: not isinstance(v, dict) or all(n in v for n in k),
}

# string formats its own rules get wrong, as patterns that are exact (RFC 3339 dates and
# times, dotted-quad IPv4, RFC 1123 host names of at most 251 characters)
_YEAR = r"([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
_DATE = (rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|"
         rf"02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,60}[A-Za-z0-9])?"
_FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": rf"^{_OCTET}(\.{_OCTET}){{3}}$",
    "hostname": rf"^{_LABEL}(\.{_LABEL}){{0,3}}$",
}


def _intersect_types(a: set[str], b: set[str]) -> set[str]:
    """The JSON types both allow (an integer is a number)."""
    common = a & b
    if "number" in a and "integer" in b or "integer" in a and "number" in b:
        common.add("integer")
    return common


def _pointer(ref: str) -> str:
    return "#" + "".join("/" + p for p in ref[1:].split("/") if p)


def _strings(*values: Any):
    for value in values:
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            yield from (v for v in value if isinstance(v, str))


def _disjoint(branches: list[Any]) -> bool:
    """Whether no value matches two branches: each names its types and no two share one, or
    all require one property whose const (or enum) values differ between branches."""
    types = []
    for b in branches:
        kinds = b.get("type") if isinstance(b, dict) else None
        if kinds is None:
            types = None
            break
        kinds = {kinds} if isinstance(kinds, str) else set(kinds)
        types.append(kinds | ({"integer"} if "number" in kinds else set()))
    if types is not None and all(not (types[i] & types[j]) for i in range(len(types)) for j in range(i)):
        return True
    if not all(isinstance(b, dict) for b in branches):
        return False
    common = set.intersection(*(set(b.get("required") or []) for b in branches))
    for name in common:
        seen: set[str] = set()
        for b in branches:
            prop = (b.get("properties") or {}).get(name)
            values = [prop["const"]] if isinstance(prop, dict) and "const" in prop else \
                prop.get("enum") if isinstance(prop, dict) and isinstance(prop.get("enum"), list) else None
            if values is None:
                break
            keys = {json.dumps(v, sort_keys=True) for v in values}
            if keys & seen:
                break
            seen |= keys
        else:
            return True
    return False
