"""Token-level rewrites of xgrammar's EBNF text (what `str(grammar)` prints), and the
character sets of its literals and classes. grammar.py uses them to correct what xgrammar
would let an answer get wrong."""

from __future__ import annotations

import re
from collections.abc import Callable

# a literal, a character class, a name, white space, or one other character
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|\s+|.', re.S)
MAX_CODE_POINT = 0x10FFFF


def rewrite(ebnf: str, literal: Callable[[str], str] | None = None, char_class: Callable[[str], str] | None = None,
            name: Callable[[str], str] | None = None) -> str:
    """The text with each literal ("..." with its quotes), class ([...] with its brackets)
    and name passed through the given function."""
    out = []
    for token in _TOKEN.findall(ebnf):
        c = token[0]
        if c == '"' and literal is not None:
            token = literal(token)
        elif c == "[" and char_class is not None:
            token = char_class(token)
        elif (c.isalpha() or c == "_") and name is not None:
            token = name(token)
        out.append(token)
    return "".join(out)


def literal_text(literal: str) -> str:
    """What a literal ("..." as printed) stands for."""
    return "".join(chr(c) for c in code_points(literal[1:-1]))


def make_literal(text: str) -> str:
    """A literal of the text: characters as they are (one outside the Basic Multilingual
    Plane too, never as a surrogate pair), quotes, backslashes and control characters
    escaped."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def class_ranges(char_class: str) -> tuple[bool, list[tuple[int, int]]]:
    """A class ([...] as printed) as (negated, code point ranges)."""
    body = char_class[1:-1]
    negated = body.startswith("^")
    codes = code_points(body[1:] if negated else body, keep_dashes=True)
    ranges, k = [], 0
    while k < len(codes):
        if k + 2 < len(codes) and codes[k + 1] is None:  # a - b
            ranges.append((codes[k], codes[k + 2]))
            k += 3
        else:
            code = ord("-") if codes[k] is None else codes[k]
            ranges.append((code, code))
            k += 1
    return negated, ranges


def make_class(negated: bool, ranges: list[tuple[int, int]]) -> str:
    if not ranges:  # nothing in it: negated, everything; else nothing
        return "[\\0-\\U0010ffff]" if negated else "[^\\0-\\U0010ffff]"
    body = "".join(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)
    return ("[^" if negated else "[") + body + "]"


def class_excluding(char_class: str, excluded: list[tuple[int, int]]) -> str:
    """The class less the excluded code points."""
    negated, ranges = class_ranges(char_class)
    if negated:
        return make_class(True, ranges + excluded)
    for lo_x, hi_x in excluded:
        kept = []
        for lo, hi in ranges:
            if hi < lo_x or lo > hi_x:
                kept.append((lo, hi))
                continue
            if lo < lo_x:
                kept.append((lo, lo_x - 1))
            if hi > hi_x:
                kept.append((hi_x + 1, hi))
        ranges = kept
    return make_class(False, ranges)


def code_points(text: str, keep_dashes: bool = False) -> list[int | None]:
    """The code points an EBNF literal or class body names; with keep_dashes, an unescaped
    '-' (a range) is None."""
    codes: list[int | None] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            nxt = text[i + 1]
            width = {"x": 2, "u": 4, "U": 8}.get(nxt)
            if width:
                codes.append(int(text[i + 2 : i + 2 + width], 16))
                i += 2 + width
                continue
            codes.append(ord(_ESCAPES.get(nxt, nxt)))
            i += 2
            continue
        codes.append(None if keep_dashes and c == "-" else ord(c))
        i += 1
    return codes


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "0": "\0", "f": "\f", "v": "\v", "b": "\b", "a": "\a", "e": "\x1b"}
