"""The kernels' versions for older CPUs, checked on a newer one: the kernel, quantization,
sampler and parity tests run again in a process whose kernels are built for the older
instruction set (`VLMSERVE_CPU_ISA`) and whose torch is capped there too, so a change made on
a newer machine cannot break them unseen. One test file per target, so that the two runs
(each builds the kernels once, about a minute) go to both test workers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmserve.kernels import cpu_extension

ROOT = Path(__file__).resolve().parent.parent
TEST_FILES = ["tests/test_kernels.py", "tests/test_fp8_kv_kernels.py", "tests/test_decode_layers.py",
              "tests/test_quantization.py", "tests/test_sampler.py"]
# a whole model on each target's kernels: the hybrid on one, the dense family on the other
# (each kernel they call is in the files above too)
PARITY_FILES = {"avx2": "tests/test_qwen3_5_parity.py", "avx512": "tests/test_qwen2_5_vl_parity.py"}
# the entry points' tests in those files: their kernels are the ones above, their time the server's
NOT_KERNEL_TESTS = "not serve and not caption and not unknown_method and not loading_peaks"
# torch's capability and oneDNN's cap that go with each target
TORCH_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
              "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}
# torch's own kernels capped (ATEN_CPU_CAPABILITY=avx2 on an Ice Lake Xeon) move transformers'
# prompt logprobs by up to 8e-5 at the most sensitive position of a two-picture Qwen3.5 prompt,
# where vlmserve is 1.4e-4 from them uncapped: the parity tests' 1e-4 is then the reference's noise
PARITY_TOL_UNDER_OLDER_TORCH = "3e-4"
PATHS_TAKEN = """
import torch
from vlmserve.kernels import cpu_extension, linear, quantized_linear
print(cpu_extension.available(), cpu_extension.has_avx512(), cpu_extension.has_bf16_dot(), cpu_extension.widens_bf16(),
      linear.has_bf16_matmul(), quantized_linear.tiled_kernels_available(), torch.backends.cpu.get_cpu_capability())
"""
# built, AVX-512 or not, no bf16 arithmetic, bf16 widened in registers, oneDNN's bf16 matmul
# (emulated on AVX-512F, none on AVX2), int8/int4 on the AVX2 kernels, torch's capability
EXPECTED_PATHS = {"avx2": "True False False True False True AVX2", "avx512": "True True False True True True AVX512"}


def newer_than(isa: str) -> pytest.MarkDecorator:
    """Skips where this CPU cannot run `isa`'s kernels, or is of its kind (then every test runs them)."""
    flags = set(cpu_extension.cpu_flags())
    kept = cpu_extension.OLDER_TARGETS[isa][1]
    newer = "avx512_bf16" if kept else "avx512f"  # what this CPU must have beyond the target
    runs_it = cpu_extension.available() and {"avx2", "fma", *kept, newer} <= flags
    return pytest.mark.skipif(not runs_it, reason=f"this CPU is no newer than {isa}, or has no kernels built")


def older_env(isa: str) -> dict[str, str]:
    # the child is a pytest run of its own, not one of this run's xdist workers
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    return env | {cpu_extension.ISA_ENV: isa} | TORCH_CAPS[isa] | {"VLMSERVE_PARITY_TOL": PARITY_TOL_UNDER_OLDER_TORCH}


def check_the_kernels_built_for(isa: str) -> None:
    paths = subprocess.run([sys.executable, "-c", PATHS_TAKEN], env=older_env(isa), cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
    assert paths.returncode == 0, paths.stderr[-3000:]
    assert paths.stdout.split() == EXPECTED_PATHS[isa].split(), paths.stdout

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "not slow",
                            "-k", NOT_KERNEL_TESTS, *TEST_FILES, PARITY_FILES[isa]], env=older_env(isa), cwd=ROOT, capture_output=True,
                           text=True, timeout=1800)
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout.splitlines()[-1]
