"""The documentation builds (mkdocs, strict: a link to a missing page or anchor fails it),
and the README stays a one-page introduction whose links all resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_build_with_no_broken_internal_link(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "architecture" / "index.html").is_file()


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links to the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
