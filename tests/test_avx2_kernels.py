"""The kernels built for AVX2 without AVX-512 (AMD Zen 2/3, Intel client cores), on a newer
CPU (tests/older_cpus.py); and the setting's refusals."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from older_cpus import ROOT, check_the_kernels_built_for, newer_than
from vlmserve.kernels import cpu_extension


@pytest.mark.slow
@newer_than("avx2")
def test_the_avx2_kernels_take_their_paths_and_pass_the_kernel_and_parity_tests():
    check_the_kernels_built_for("avx2")


@pytest.mark.parametrize("isa", ["sse", "avx10"])
def test_an_unknown_target_is_one_line_and_exit_code_2(tmp_path, isa):
    result = subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", "caption",
                             str(ROOT / "samples" / "shapes1.png"), "--out", str(tmp_path / "c.jsonl")],
                            env=os.environ | {cpu_extension.ISA_ENV: isa}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert f"VLMSERVE_CPU_ISA='{isa}': use 'native' (this CPU's instructions), 'avx2' or 'avx512'" in result.stderr
    assert "Traceback" not in result.stderr
