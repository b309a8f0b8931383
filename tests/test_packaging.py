"""kernels/, models/ and ui/ import as vlmserve.*, and nothing generic is installed."""

import subprocess
import sys


def run(code: str, cwd) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True).stdout


def test_subpackages_live_under_vlmserve(tmp_path):
    out = run(
        "import importlib.util as u, vlmserve.kernels, vlmserve.models, vlmserve.ui;"
        "print([u.find_spec(n) is None for n in ('kernels', 'models', 'ui')]);"
        "from vlmserve import LLM, SamplingParams; print('ok')",
        cwd=tmp_path,  # away from the repo root, so only installed modules are found
    )
    assert out.split() == ["[True,", "True,", "True]", "ok"]
