"""Errors the user's settings cause, shared by every layer that checks them."""

from __future__ import annotations


class ConfigError(ValueError):
    """Settings the engine cannot run with; the message says which and what to do."""
