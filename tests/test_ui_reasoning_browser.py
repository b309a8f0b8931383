"""The chat UI on a thinking model, in a real browser (test_ui_browser.py's chromium and
helpers), against `vlmserve ui --reasoning-parser qwen3`: the reasoning shows folded above
the answer, the answer alone below it, and the next turn does not send the reasoning back."""

from __future__ import annotations

import re
import time

import pytest

from test_openai_server import Server
from test_ui_browser import Page, browser  # noqa: F401 (the browser fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ui(thinking_path):
    s = Server(thinking_path, "--reasoning-parser", "qwen3", "--max-model-len", "1024", command="ui")
    yield s
    s.stop()


def test_the_reasoning_shows_folded_above_the_answer(browser, ui):  # noqa: F811
    page = Page(browser, ui.base)
    answer = page.ask("What is two plus two?")
    assert answer.endswith("The answer is four.") and "</think>" not in answer
    bots = page.page.locator("#chat [data-testid='bot']")
    deadline = time.time() + 20
    while "Reasoning" not in bots.first.inner_text():  # the reasoning's title, in the first bubble
        assert time.time() < deadline, f"no reasoning shown: {bots.first.inner_text()!r}"
        time.sleep(0.2)
    transcript = page.page.inner_text("#chat")
    title, answer_at = transcript.index("Reasoning"), transcript.rindex("The answer is four.")
    assert title < answer_at  # above the answer
    page.shot("reasoning-folded")
    thought = "Two plus two means adding"
    if thought not in page.page.inner_text("#chat"):  # folded: its title opens it
        page.page.get_by_text("Reasoning").first.click()
    deadline = time.time() + 10
    while thought not in page.page.inner_text("#chat"):
        assert time.time() < deadline, "the reasoning does not open"
        time.sleep(0.2)
    time.sleep(1)  # its opening animation
    page.shot("reasoning-open")
    before = shown_prompt_tokens(page, other_than=None)
    page.ask("What is two plus two?", wait=False)
    # the second turn's prompt holds the first turn's answer, not its reasoning (27 tokens more)
    grown = shown_prompt_tokens(page, other_than=before) - before
    assert 0 < grown < 40, grown


def shown_prompt_tokens(page: Page, other_than: int | None) -> int:
    """The prompt tokens the stats line shows, once it shows a count other than `other_than`
    (while an answer streams, the line shows none)."""
    deadline = time.time() + 60
    while True:
        found = re.search(r"prompt (\d+) tokens", page.stats())
        if found and int(found.group(1)) != other_than:
            return int(found.group(1))
        assert time.time() < deadline, f"no new prompt count shown: {page.stats()!r}"
        time.sleep(0.2)
