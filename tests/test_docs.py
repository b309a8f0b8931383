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


def headings(page: Path) -> set[str]:
    """The anchors mkdocs gives a page's headings (its default toc slugify), code blocks left out."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {slugify(title, "-") for title in re.findall(r"^#+ +(.+?) *$", text, flags=re.M)}


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 180
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links to the docs"
    missing = [link for link in local if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, missing
    # mkdocs checks the anchors of the docs' own links; the README's are checked here
    broken = [link for link in local if "#" in link
              and link.split("#")[1] not in headings(ROOT / link.split("#")[0])]
    assert not broken, broken


def test_the_readme_headline_table_answers_in_at_most_eight_rows_each_with_its_details():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Headline numbers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and its rule
    assert 1 <= len(rows) <= 8, rows
    assert all(re.search(r"\]\(docs/[^)]+#[^)]+\)", row) for row in rows), "each row links to its details"


def test_the_benchmarks_page_holds_the_current_figures_and_the_log_the_history():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(page.splitlines()) <= 500
    assert "(benchmarks-log.md" in page
    log = (ROOT / "docs" / "benchmarks-log.md").read_text()
    assert re.search(r"^### .*\(2026-\d\d-\d\d", log, flags=re.M), "the dated runs live in the log"
