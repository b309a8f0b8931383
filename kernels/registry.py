"""Op registry: name -> implementations by device type, and the one dispatch point.

A `KernelTable` binds every op to its implementation for a device type, once; each
engine makes its own (`kernel_table` in the package) and runs its model inside
`use_kernels(table)`, where `ops.<name>` is that table's op. An implementation may need
something the machine might not have (a C++ compiler for the CPU kernels): it is
registered with an `available` check, asked once when a table is made; the portable
torch version runs where nothing better is available.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

PORTABLE = "torch"  # pure torch: runs on any device; the reference for every other impl


@dataclass(frozen=True)
class Implementation:
    device_type: str
    fn: Callable
    available: Callable[[], bool] | None = None


_impls: dict[str, list[Implementation]] = {}


def register(name: str, device_type: str = PORTABLE,
             available: Callable[[], bool] | None = None) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        _impls.setdefault(name, []).append(Implementation(device_type, fn, available))
        return fn

    return decorate


def implementation(name: str, preference: tuple[str, ...]) -> Callable:
    """The first implementation of an op, in order of preference, that is registered and
    available; the portable one when none is."""
    for kind in preference:
        for impl in _impls[name]:
            if impl.device_type == kind and (impl.available is None or impl.available()):
                return impl.fn
    return next(impl.fn for impl in _impls[name] if impl.device_type == PORTABLE)


def preference(device_type: str, triton: bool) -> tuple[str, ...]:
    """CUDA runs the Triton kernels; the CPU its C++ ones, or with `triton` the Triton
    kernels under Triton's interpreter (the GPU path, checked on a machine without one)."""
    if device_type == "cuda":
        return ("triton", PORTABLE)
    return ("triton", PORTABLE) if triton else (device_type, PORTABLE)


class KernelTable:
    """Every op bound to its implementation for one device type (and the Triton switch):
    plain attributes, looked up once."""

    def __init__(self, device_type: str, triton: bool = False) -> None:
        self.device_type, self.triton = device_type, triton
        order = preference(device_type, triton)
        for name in _impls:
            setattr(self, name, implementation(name, order))


_active: contextvars.ContextVar[KernelTable | None] = contextvars.ContextVar("vlmserve_kernels", default=None)
_default: list[KernelTable] = []  # the CPU kernels, made on first use outside any engine


@contextmanager
def use_kernels(table: KernelTable) -> Iterator[None]:
    """The table `ops` calls within (an engine around its model's forward and loading)."""
    token = _active.set(table)
    try:
        yield
    finally:
        _active.reset(token)


class _ActiveOps:
    """`ops.<name>`: the op of the engine running in this thread (use_kernels), or the CPU
    kernels outside any engine. Each engine binds its own table, so engines on different
    kernels share a process without a global switch."""

    def __getattr__(self, name: str) -> Callable:
        table = _active.get()
        if table is None:
            if not _default:
                _default.append(KernelTable("cpu"))
            table = _default[0]
        if name not in _impls:
            raise AttributeError(f"no op named {name!r}; known: {sorted(_impls)}")
        return getattr(table, name)


ops = _ActiveOps()
