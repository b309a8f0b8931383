"""kernels/, models/, ui/ and samples/ import as vlmserve.*, and nothing generic is installed."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest


def run(code: str, cwd) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True).stdout


def test_subpackages_live_under_vlmserve(tmp_path):
    out = run(
        "import importlib.util as u, vlmserve.kernels, vlmserve.models, vlmserve.ui, vlmserve.samples;"
        "print([u.find_spec(n) is None for n in ('kernels', 'models', 'ui', 'samples')]);"
        "from vlmserve import LLM, SamplingParams; print('ok')",
        cwd=tmp_path,  # away from the repo root, so only installed modules are found
    )
    assert out.split() == ["[True,", "True,", "True,", "True]", "ok"]


@pytest.mark.slow
def test_the_wheel_ships_the_samples_and_the_ui_finds_them(tmp_path):
    """Built from a copy of the sources (the build leaves nothing in the repo) and installed
    as a user would, not editable: the UI's examples come from inside the package."""
    repo = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"
    for name in ("vlmserve", "kernels", "models", "ui", "samples"):
        shutil.copytree(repo / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp_path / "dist"),
                          str(src)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("vlmserve-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    answers = json.loads((repo / "samples" / "answers.json").read_text())
    for file in {item["file"] for item in answers} | {"answers.json"}:
        assert f"vlmserve/samples/{file}" in names
    assert not any(n.startswith("samples/") for n in names)

    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True,
                   capture_output=True)
    out = subprocess.run(
        [sys.executable, "-c",
         "from vlmserve.ui.launch import shipped_samples; from vlmserve.ui.app import sample_examples;"
         "print(shipped_samples()); print(len(sample_examples(shipped_samples())))"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True).stdout
    folder, count = out.split()
    assert Path(folder) == site / "vlmserve" / "samples"
    assert int(count) == sum(1 for item in answers if not item["file"].endswith(".mp4"))
