"""Op registry: name -> implementations by device type, and the one dispatch point.

`ops.<name>` is the implementation chosen for the device the model runs on: chosen once,
by `ops.use(device_type)` when a model is built (before that, on first use, for the CPU),
and then a plain attribute, not a lookup per call. An implementation may need something
the machine might not have (a C++ compiler for the CPU kernels): it is registered with an
`available` check, asked once when ops are chosen; the portable torch version runs where
nothing better is available.
"""

from __future__ import annotations

from collections.abc import Callable
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


def implementation(name: str, device_type: str) -> Callable:
    """The implementation of an op for a device type: its own if registered and
    available, else the portable one."""
    for impl in _impls[name]:
        if impl.device_type == device_type and (impl.available is None or impl.available()):
            return impl.fn
    return next(impl.fn for impl in _impls[name] if impl.device_type == PORTABLE)


class Ops:
    def __init__(self) -> None:
        self.device_type: str | None = None

    def use(self, device_type: str) -> None:
        """Binds every op to its implementation for this device type."""
        self.device_type = device_type
        for name in _impls:
            setattr(self, name, implementation(name, device_type))

    def __getattr__(self, name: str) -> Callable:
        if name not in _impls:
            raise AttributeError(f"no op named {name!r}; known: {sorted(_impls)}")
        self.use("cpu")  # first use before any model was built
        return getattr(self, name)


ops = Ops()
