"""kernels/, models/, ui/ and samples/ import as vlmserve.*, nothing generic is installed, and
building the package says nothing of its own configuration."""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def copy_sources(src: Path) -> Path:
    """What a build reads, copied (a build leaves build/ and *.egg-info beside its sources)."""
    for name in ("vlmserve", "kernels", "models", "ui", "samples"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    return src


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
    repo = REPO
    src = copy_sources(tmp_path / "src")
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


BUILD = """
import json, sys, warnings
import setuptools.build_meta as backend
dist, editable, report = sys.argv[1:4]  # read first: the backend rewrites sys.argv
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    wheel = backend.build_wheel(dist)
    backend.build_editable(editable)
with open(report, "w") as out:
    json.dump({"wheel": wheel, "warnings": [[w.category.__name__, str(w.message)] for w in caught]}, out)
"""


def test_the_build_is_quiet_and_the_wheel_ships_the_kernel_sources_and_the_model(tmp_path):
    """What `pip install -e ".[dev]"` prints of the backend: no deprecated `license` table, no
    "Package would be ignored" for the C++ sources or the shipped model's folder. The one
    notice left is setuptools' own on every editable install through a meta path finder
    (kernels/ installs as vlmserve.kernels, so the project needs one)."""
    src = copy_sources(tmp_path / "src")
    (tmp_path / "dist").mkdir()
    (tmp_path / "editable").mkdir()
    result = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path / "dist"), str(tmp_path / "editable"),
                             str(tmp_path / "report.json")], cwd=src, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    said = [f"{category}: {message}" for category, message in report["warnings"]
            if not (category == "InformationOnly" and message.startswith("Editable installation."))]
    assert not said, "\n\n".join(said)
    assert not re.search(r"would be ignored|deprecated", result.stdout + result.stderr, re.I)

    wheel = zipfile.ZipFile(tmp_path / "dist" / report["wheel"])
    names = set(wheel.namelist())
    sources = {f"vlmserve/kernels/csrc/{f.name}" for f in (REPO / "kernels" / "csrc").iterdir()
               if f.suffix in (".cpp", ".h")}
    assets = {"vlmserve/" + f.relative_to(REPO / "vlmserve").as_posix()
              for f in (REPO / "vlmserve" / "assets").rglob("*") if f.is_file()}
    assert sources and sources <= names, sorted(sources - names)
    assert assets and assets <= names, sorted(assets - names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in wheel.read(metadata).decode().splitlines()
