"""Structured output: grammars (checked at the front end, compiled off the step loop by
xgrammar) and the per-request matchers whose token bitmask constrains sampling."""
