"""The kernels' AVX2 versions — what AMD Zen 2/3 and Intel client cores run — checked on any
AVX2 CPU: the kernel, quantization and parity tests again in a process whose kernels are
built for AVX2 (`VLMSERVE_CPU_ISA=avx2`) and whose torch is capped at AVX2 too, so a change
made on an AVX-512 machine cannot break them unseen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmserve.kernels import cpu_extension

ROOT = Path(__file__).resolve().parent.parent
AVX2_ENV = {"VLMSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
TEST_FILES = ["tests/test_kernels.py", "tests/test_decode_layers.py", "tests/test_quantization.py",
              "tests/test_qwen2_5_vl_parity.py", "tests/test_qwen3_5_parity.py", "tests/test_sampler.py"]
PATHS_TAKEN = """
import torch
from vlmserve.kernels import cpu_extension, linear, quantized_linear
print(cpu_extension.available(), cpu_extension.has_avx512(), cpu_extension.widens_bf16(),
      linear.has_bf16_matmul(), quantized_linear.tiled_kernels_available(), torch.backends.cpu.get_cpu_capability())
"""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not cpu_extension.available(), reason="vlmserve's CPU kernels are not built here"),
    pytest.mark.skipif("avx2" not in cpu_extension.cpu_flags() or "fma" not in cpu_extension.cpu_flags(),
                       reason="this CPU has no AVX2"),
    pytest.mark.skipif(not cpu_extension.has_avx512(), reason="this CPU runs the AVX2 kernels in every test already"),
]


def avx2_env() -> dict[str, str]:
    # the child is a pytest run of its own, not one of this run's xdist workers
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    return env | AVX2_ENV


def test_an_avx2_build_takes_the_avx2_paths():
    out = subprocess.run([sys.executable, "-c", PATHS_TAKEN], env=avx2_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    # built, no AVX-512, bf16 widened in registers, no oneDNN bf16 matmul, int8/int4 on the AVX2 kernels
    assert out.stdout.split() == ["True", "False", "True", "False", "True", "AVX2"], out.stdout


def test_the_kernel_and_parity_tests_pass_on_the_avx2_kernels():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "not slow",
                          *TEST_FILES], env=avx2_env(), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert " passed" in out.stdout.splitlines()[-1]
