"""Op registry: name -> implementations by device type, and the one dispatch point.

`ops.<name>` is the implementation chosen for the device the model runs on: chosen once,
by `ops.use(device_type)` when a model is built (before that, on first use, for the CPU),
and then a plain attribute, not a lookup per call. An implementation may need something
the machine might not have (a C++ compiler for the CPU kernels): it is registered with an
`available` check, asked once when ops are chosen; the portable torch version runs where
nothing better is available.
"""

from __future__ import annotations

import os
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


class Ops:
    def __init__(self) -> None:
        self.device_type: str | None = None
        self.triton = False

    def use(self, device_type: str, triton: bool = False) -> None:
        """Binds every op to its implementation for this device type (and the Triton
        switch)."""
        if device_type == "cuda" or triton:
            load_triton_kernels(interpret=device_type != "cuda")
        self.device_type, self.triton = device_type, triton
        order = preference(device_type, triton)
        for name in _impls:
            setattr(self, name, implementation(name, order))

    def __getattr__(self, name: str) -> Callable:
        if name not in _impls:
            raise AttributeError(f"no op named {name!r}; known: {sorted(_impls)}")
        self.use("cpu")  # first use before any model was built
        return getattr(self, name)


def load_triton_kernels(interpret: bool) -> None:
    """Imports (so registers) the Triton kernels. On CPU tensors they run in Triton's
    interpreter, which has to be on before triton is first imported."""
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton kernels on CPU tensors run in Triton's interpreter: start with "
                           "VLMSERVE_USE_TRITON=1 (or TRITON_INTERPRET=1) in the environment")
    from vlmserve.kernels import triton_attention, triton_elementwise, triton_gdn  # noqa: F401


ops = Ops()
