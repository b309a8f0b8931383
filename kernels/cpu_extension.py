"""vlmserve's C++ kernels for the CPU, built on first use with torch's extension tools
and cached on disk (once per machine: ~30 s with g++).

The build is keyed by the sources, the compiler flags and this CPU's instruction-set
flags (it is compiled with -march=native), so a cache shared between machines never
loads code built for another CPU. Without a C++ compiler, or if the build fails,
`available()` is False and the ops fall back to their pure-torch implementations.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / name for name in ("paged_attention.cpp", "gdn.cpp", "elementwise.cpp", "sampling.cpp")]
HEADERS = [CSRC / "vec_math.h"]
# what -ffast-math allows for vectorised reductions, without -ffast-math itself: linked
# with it, a library sets the FPU's flush-to-zero mode on load, and oneDNN's bf16 matmuls
# then ran on one thread at half speed (measured). exp is the kernels' own (vec_math.h).
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
         "-freciprocal-math", "-ffp-contract=fast", "-fopenmp"]
DISABLE_ENV = "VLMSERVE_NO_CPU_KERNELS"  # set to 1: pure torch everywhere (for comparisons)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def cache_dir() -> Path:
    root = os.environ.get("VLMSERVE_CACHE") or Path.home() / ".cache" / "vlmserve"
    return Path(root) / "kernels"


@functools.cache
def available() -> bool:
    """Builds (or finds) and loads the kernels; registers torch.ops.vlmserve_cpu.*."""
    if os.environ.get(DISABLE_ENV) == "1":
        return False
    import torch
    from torch.utils.cpp_extension import load

    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    digest.update(" ".join(FLAGS).encode() + _cpu_flags().encode() + torch.__version__.encode())
    name = f"vlmserve_cpu_{digest.hexdigest()[:16]}"
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        logger.info("building vlmserve's CPU kernels (once on this machine, about 30 s)")
    try:
        load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
             extra_include_paths=[str(CSRC)],
             build_directory=str(build), is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, a failed build: the torch fallbacks run
        logger.warning("vlmserve's CPU kernels are not available (%s); using the pure-torch ops", e)
        return False
    return True
