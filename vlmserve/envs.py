"""Every environment variable vlmserve reads, in one place: its name, its type, what it
does. Read when used (`envs.VLMSERVE_CPU_ISA` reads the environment at that moment), never
at import, so a process that sets one before building an engine is heard. Library code
reads the environment only through this module (tests/test_code_health.py checks)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _flag(name: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# name -> how it is read (its type and default); documented in docs/environment.md
VARIABLES: dict[str, Callable[[], Any]] = {
    # the Triton kernels on CPU tensors, run by Triton's interpreter (the GPU path checked
    # without a GPU): the default of --use-triton
    "VLMSERVE_USE_TRITON": _flag("VLMSERVE_USE_TRITON"),
    # Triton's own switch of its interpreter; vlmserve turns it on itself where the Triton
    # kernels run on CPU tensors (vlmserve.kernels.kernel_table)
    "TRITON_INTERPRET": _flag("TRITON_INTERPRET"),
    # which instructions the C++ CPU kernels are built for: native (this CPU's), avx2, avx512
    "VLMSERVE_CPU_ISA": lambda: os.environ.get("VLMSERVE_CPU_ISA", "").strip().lower() or "native",
    # 1: no C++ CPU kernels, the portable torch ones everywhere (for comparisons)
    "VLMSERVE_NO_CPU_KERNELS": _flag("VLMSERVE_NO_CPU_KERNELS"),
    # where the C++ kernels are built and cached
    "VLMSERVE_CACHE": lambda: Path(os.environ.get("VLMSERVE_CACHE") or Path.home() / ".cache" / "vlmserve"),
    # the log level of the engine core's own process (--engine-process)
    "VLMSERVE_CORE_LOG_LEVEL": lambda: os.environ.get("VLMSERVE_CORE_LOG_LEVEL", "INFO").upper(),
    # 1 or 0: the default of --async-scheduling (unset: on with a GPU, and on a CPU with a core
    # to spare beside the forward's threads)
    "VLMSERVE_ASYNC_SCHEDULING": lambda: None if os.environ.get("VLMSERVE_ASYNC_SCHEDULING", "").strip() == ""
    else _flag("VLMSERVE_ASYNC_SCHEDULING")(),
    # vLLM's Mooncake store connector's: a JSON file of the pool's settings (local_hostname,
    # metadata_server, master_server_address, protocol, global_segment_size, local_buffer_size)
    "MOONCAKE_CONFIG_PATH": lambda: os.environ.get("MOONCAKE_CONFIG_PATH") or None,
    # huggingface_hub's own: no hub access, checkpoints from the local cache only
    "HF_HUB_OFFLINE": _flag("HF_HUB_OFFLINE"),
    # vLLM's name, so that a vLLM deployment's environment works: the default of
    # --allow-runtime-lora-updating
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": _flag("VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name]()
    raise AttributeError(f"module 'vlmserve.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(VARIABLES)


def turn_on_triton_interpreter() -> None:
    """Triton's interpreter for the Triton kernels about to be defined on CPU tensors: Triton
    reads its switch when a kernel is decorated, so this is set before vlmserve's Triton
    modules are first imported (the one place vlmserve writes the environment)."""
    os.environ["TRITON_INTERPRET"] = "1"
