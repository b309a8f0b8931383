"""The kernels' versions for older CPUs, checked on a newer one: AVX2 (AMD Zen 2/3, Intel
client cores) and AVX-512F without AVX512-BF16 (Xeons from Skylake to Ice Lake). The kernel,
quantization, sampler and parity tests run again in a process whose kernels are built for the
older instruction set (`VLMSERVE_CPU_ISA`) and whose torch is capped there too, so a change
made on a newer machine cannot break them unseen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmserve.kernels import cpu_extension

ROOT = Path(__file__).resolve().parent.parent
TEST_FILES = ["tests/test_kernels.py", "tests/test_decode_layers.py", "tests/test_quantization.py",
              "tests/test_qwen2_5_vl_parity.py", "tests/test_qwen3_5_parity.py", "tests/test_sampler.py"]
# each older target: torch's capability and oneDNN's cap that go with it
TORCH_CAPS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
              "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}
PATHS_TAKEN = """
import torch
from vlmserve.kernels import cpu_extension, linear, quantized_linear
print(cpu_extension.available(), cpu_extension.has_avx512(), cpu_extension.has_bf16_dot(), cpu_extension.widens_bf16(),
      linear.has_bf16_matmul(), quantized_linear.tiled_kernels_available(), torch.backends.cpu.get_cpu_capability())
"""
# built, AVX-512 or not, no bf16 arithmetic, bf16 widened in registers, oneDNN's bf16 matmul
# (emulated on AVX-512F, none on AVX2), int8/int4 on the AVX2 kernels, torch's capability
EXPECTED_PATHS = {"avx2": "True False False True False True AVX2", "avx512": "True True False True True True AVX512"}

SAMPLE = ROOT / "samples" / "shapes1.png"


def older_targets() -> list:
    """Each older target, skipped where this CPU cannot run it or is of its kind (then every
    test runs its kernels)."""
    flags = set(cpu_extension.cpu_flags())
    params = []
    for isa, (_, kept) in cpu_extension.OLDER_TARGETS.items():
        newer = "avx512_bf16" if kept else "avx512f"  # what this CPU has beyond the target
        skip = not {"avx2", "fma", *kept, newer} <= flags
        params.append(pytest.param(isa, marks=pytest.mark.skipif(skip, reason=f"this CPU is no newer than {isa}")))
    return params


def older_env(isa: str) -> dict[str, str]:
    # the child is a pytest run of its own, not one of this run's xdist workers
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    return env | {cpu_extension.ISA_ENV: isa} | TORCH_CAPS[isa]


@pytest.mark.slow
@pytest.mark.skipif(not cpu_extension.available(), reason="vlmserve's CPU kernels are not built here")
@pytest.mark.parametrize("isa", older_targets())
def test_an_older_build_takes_its_paths_and_passes_the_kernel_and_parity_tests(isa):
    paths = subprocess.run([sys.executable, "-c", PATHS_TAKEN], env=older_env(isa), cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
    assert paths.returncode == 0, paths.stderr[-3000:]
    assert paths.stdout.split() == EXPECTED_PATHS[isa].split(), paths.stdout

    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-m", "not slow",
                            *TEST_FILES], env=older_env(isa), cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert tests.returncode == 0, tests.stdout[-6000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout.splitlines()[-1]


@pytest.mark.parametrize("isa", ["sse", "avx10"])
def test_an_unknown_target_is_one_line_and_exit_code_2(tmp_path, isa):
    result = subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", "caption", str(SAMPLE), "--out",
                             str(tmp_path / "c.jsonl")], env=os.environ | {cpu_extension.ISA_ENV: isa}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2
    assert f"VLMSERVE_CPU_ISA='{isa}': use 'native' (this CPU's instructions), 'avx2' or 'avx512'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "c.jsonl").exists() or not (tmp_path / "c.jsonl").read_text()
