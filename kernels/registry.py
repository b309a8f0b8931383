"""Op registry: name -> {device type -> implementation}."""

from __future__ import annotations

from collections.abc import Callable

import torch

PORTABLE = "torch"  # pure torch: runs on any device; the reference for every other impl
_impls: dict[str, dict[str, Callable]] = {}


def register(name: str, device_type: str = PORTABLE) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        _impls.setdefault(name, {})[device_type] = fn
        return fn

    return decorate


def implementation(name: str, device_type: str) -> Callable:
    by_device = _impls[name]
    return by_device.get(device_type) or by_device[PORTABLE]


class _Ops:
    """Attribute access returns a dispatcher: ops.rms_norm(x, w, eps)."""

    def __getattr__(self, name: str) -> Callable:
        if name not in _impls:
            raise AttributeError(f"no op named {name!r}; known: {sorted(_impls)}")

        def dispatch(*args, **kwargs):
            device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
            return implementation(name, device)(*args, **kwargs)

        dispatch.__name__ = name
        return dispatch


ops = _Ops()
