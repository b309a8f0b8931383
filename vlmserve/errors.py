"""Errors the user's settings cause, shared by every layer that checks them."""

from __future__ import annotations


class ConfigError(ValueError):
    """Settings the engine cannot run with; the message says which and what to do."""


class RankFailure(RuntimeError):
    """A rank of a model split across processes died, or failed a step (after which the
    ranks' states may differ): the engine cannot go on, and stops with this error."""
