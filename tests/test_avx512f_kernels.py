"""The kernels built for AVX-512F without AVX512-BF16 (Xeons from Skylake to Ice Lake), on a
newer CPU (tests/older_cpus.py)."""

from __future__ import annotations

import pytest

from older_cpus import check_the_kernels_built_for, newer_than


@pytest.mark.slow
@newer_than("avx512")
def test_the_avx512f_kernels_take_their_paths_and_pass_the_kernel_and_parity_tests():
    check_the_kernels_built_for("avx512")
