"""vlmserve's C++ kernels for the CPU, built on first use with torch's extension tools
and cached on disk (once per machine: about 2 minutes with g++ on 2 cores). Python calls them
through the extension's own module (`cpu_kernels()`), not torch.ops (csrc/python_module.cpp says why).

The build is keyed by the sources, the compiler flags and this CPU's instruction-set
flags (it is compiled with -march=native), so a cache shared between machines never
loads code built for another CPU, and by the sources' folder, so that two checkouts never
rebuild each other's (`build_name`). Without a C++ compiler, or if the build fails,
`available()` is False and the ops fall back to their pure-torch implementations.

`VLMSERVE_CPU_ISA` builds and picks the kernels for an older instruction set than this
CPU's: `avx2` as on a CPU with AVX2 and no AVX-512 (AMD Zen 2/3, Intel client cores),
`avx512` as on one with AVX-512F and no AVX512-BF16 (Xeons from Skylake to Ice Lake). What
those CPUs run is so checked and timed on a newer one (with torch's `ATEN_CPU_CAPABILITY` and
`ONEDNN_MAX_CPU_ISA` for torch's own kernels).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

from vlmserve import envs
from vlmserve.errors import ConfigError

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# what -ffast-math allows for vectorised reductions, without -ffast-math itself: linked
# with it, a library sets the FPU's flush-to-zero mode on load, and oneDNN's bf16 matmuls
# then ran on one thread at half speed (measured). exp is the kernels' own (vec_math.h).
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-freciprocal-math", "-ffp-contract=fast", "-fopenmp"]
ISA_ENV = "VLMSERVE_CPU_ISA"  # "native" (the default), "avx2" or "avx512"
# each older target: the -march every CPU of its kind has (x86-64-v3: AVX2, FMA, F16C, BMI;
# x86-64-v4: AVX-512 F, BW, CD, DQ, VL), and the AVX-512 flags it keeps (AMX's never)
OLDER_TARGETS = {"avx2": ("x86-64-v3", ()),
                 "avx512": ("x86-64-v4", ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"))}


def _cpuinfo_line(key: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line
    except OSError:
        pass
    return ""


def _machine_flags() -> list[str]:
    return _cpuinfo_line("flags").partition(":")[2].split()


@functools.cache
def target_isa() -> str:
    """The instruction set the kernels are built for: "native" (this CPU's), "avx2" or "avx512"."""
    isa = envs.VLMSERVE_CPU_ISA
    if isa == "native":
        return isa
    if isa not in OLDER_TARGETS:
        raise ConfigError(f"{ISA_ENV}={isa!r}: use 'native' (this CPU's instructions), 'avx2' or 'avx512'")
    missing = {"avx2", "fma", *OLDER_TARGETS[isa][1]} - set(_machine_flags())
    if missing:  # built so, the kernels would stop the process at their first instruction
        raise ConfigError(f"{ISA_ENV}={isa}: this CPU has no {', '.join(sorted(missing))}")
    return isa


@functools.cache
def cpu_flags() -> tuple[str, ...]:
    """This CPU's instruction-set flags, less those an older target (`VLMSERVE_CPU_ISA`) lacks."""
    flags = _machine_flags()
    if target_isa() != "native":
        kept = OLDER_TARGETS[target_isa()][1]
        flags = [flag for flag in flags if not flag.startswith(("avx512", "amx")) or flag in kept]
    return tuple(flags)


def _compiler_flags() -> list[str]:
    if target_isa() == "native":
        return FLAGS
    arch = OLDER_TARGETS[target_isa()][0]
    return [f"-march={arch}", "-mtune=native"] + [flag for flag in FLAGS if not flag.startswith("-march=")]


def gemv_reads_in_streams() -> bool:
    """Whether the decode GEMVs read a thread's weight in several memory streams (csrc/gemv.h,
    `gemv_streams`): faster on Intel cores (an AMX Xeon: int4 +24%, int8 +35%), slower on AMD's
    (a Zen 4 EPYC: int4 and int8 0.67-0.76x on a 3B model's large matrices), where one stream
    with software prefetches reads faster."""
    return "GenuineIntel" in _cpuinfo_line("vendor_id")


@functools.cache
def has_bf16_dot() -> bool:
    """Whether the kernels are built for AVX512-BF16 (this CPU has it, no older target is set)."""
    return "avx512_bf16" in cpu_flags()


@functools.cache
def has_avx512() -> bool:
    """Whether the kernels are built for AVX-512F (this CPU has it, no AVX2 target is set)."""
    return "avx512f" in cpu_flags()


@functools.cache
def widens_bf16() -> bool:
    """Whether bf16 layers take the kernels' AVX2 path: a CPU with AVX2 and FMA but no
    AVX512-BF16, where bf16 weights widen to fp32 in registers (csrc/bf16_gemv_widened.h,
    csrc/bf16_batch_linear.cpp)."""
    return "avx2" in cpu_flags() and "fma" in cpu_flags() and not has_bf16_dot() and available()


@functools.cache
def has_amx() -> bool:
    """Whether the kernels can use AMX-BF16 tiles: the CPU has them, the kernels were built
    for them and Linux lets this process use them."""
    if "amx_bf16" not in cpu_flags() or not available():
        return False
    return bool(cpu_kernels().amx_ready())


def cache_dir() -> Path:
    return envs.VLMSERVE_CACHE / "kernels"


def available() -> bool:
    """Whether the kernels are built (or found) and loaded."""
    return _load() is not None


def cpu_kernels() -> ModuleType:
    """The kernels' Python module: one function per kernel (kernels/csrc/python_module.cpp)."""
    module = _load()
    if module is None:
        raise RuntimeError("vlmserve's CPU kernels are not available (see available())")
    return module


@functools.cache
def _load() -> ModuleType | None:
    """Builds (or finds) and imports the kernels' module; None where they cannot be built."""
    if envs.VLMSERVE_NO_CPU_KERNELS:
        return None
    load = _quiet_import_of_load()
    name = build_name(CSRC)
    flags = _compiler_flags()
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        logger.info("building vlmserve's CPU kernels (once for this install, about 2 minutes)")
    try:
        module = load(name=name, sources=[str(path) for path in sources(CSRC)], extra_cflags=flags,
                      extra_ldflags=["-fopenmp"],
                      extra_include_paths=[str(CSRC)],
                      build_directory=str(build), is_python_module=True, verbose=False)
    except Exception as e:  # no compiler, a failed build: the torch fallbacks run
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        logger.warning("vlmserve's CPU kernels could not be built (%s): the slower pure-torch kernels run; install "
                       "a C++ compiler with OpenMP (g++) and restart to build them", first.strip()[:200])
        return None
    module.set_gemv_streams(gemv_reads_in_streams())
    return module


def sources(csrc: Path) -> list[Path]:
    """The kernels' translation units: every .cpp in csrc (as pyproject.toml ships them), so a
    file split in two builds without a list to keep up to date."""
    return sorted(csrc.glob("*.cpp"))


def build_name(csrc: Path) -> str:
    """The build's folder in the cache: its sources' contents, the compiler flags, the CPU's
    flags, torch's version, and where the sources are. Two checkouts (or an installed copy
    and a checkout) of the same sources build once each: in one folder, each one's build
    recompiled the other's (torch's builder compiles by path), and a process of the one
    waited minutes on the other's lock, silently."""
    import torch

    digest = hashlib.sha256(str(csrc.resolve()).encode())
    for path in sources(csrc) + sorted(csrc.glob("*.h")):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(_compiler_flags()).encode() + " ".join(cpu_flags()).encode() + torch.__version__.encode())
    return f"vlmserve_cpu_{digest.hexdigest()[:16]}"


def _quiet_import_of_load():
    """torch's extension builder, imported without its "No CUDA runtime is found" warning:
    it looks for CUDA when imported, which says nothing to a CPU build."""
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import load
    finally:
        cpp_logger.setLevel(level)
    return load
