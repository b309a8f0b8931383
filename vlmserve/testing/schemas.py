"""JSON schemas that cost a grammar compiler the most, for tests and benchmarks."""

from __future__ import annotations


def optional_properties(n: int) -> dict:
    """An object of n optional integer properties: compile time grows about as n^4."""
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


def nested(depth: int) -> dict:
    """Objects nested `depth` deep around an integer: building the grammar is cubic in depth."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema
