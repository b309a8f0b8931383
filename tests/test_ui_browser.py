"""The Gradio UI in a real browser (Debian's chromium, driven by Playwright), against a
real `vlmserve ui` process. Screenshots go to artifacts/ui/."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from test_openai_server import Server
from vlmserve.testing.checkpoints import build_qwen2_5_vl
from vlmserve.training.shapes import normalize_answer

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"
SHOTS = REPO / "artifacts" / "ui"
CHROMIUM = "/usr/bin/chromium"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian's chromium is missing: .ci/run installs it (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def ui():
    s = Server(None, "--api-key", "ui-test-key", command="ui")  # the shipped model
    yield s
    s.stop()


def expected(file: str, question: str) -> str:
    for item in json.loads((SAMPLES / "answers.json").read_text()):
        if item["file"] == file and item["question"] == question:
            return item["answer"]
    raise KeyError((file, question))


class Page:
    def __init__(self, browser, base: str) -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.goto(base + "/")
        self.page.wait_for_selector("#input textarea", timeout=60000)

    def ask(self, question: str, files: list[str] = (), wait: bool = True) -> str:
        page = self.page
        if files:
            page.set_input_files("#input input[type=file]", list(files))
            page.wait_for_timeout(500)
        page.fill("#input textarea", question)
        before = page.locator("#chat .message").count()
        page.keyboard.press("Enter")
        if wait:
            self.wait_done(before)
        return self.last_answer()

    def wait_done(self, before: int, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            # done when the input is usable again and an answer was added
            if self.page.locator("#chat .message").count() > before and self.page.locator(
                    "#input textarea").is_enabled():
                return
            time.sleep(0.2)
        raise AssertionError("no answer in time")

    def last_answer(self) -> str:
        bots = self.page.locator("#chat .message.bot, #chat [data-testid='bot']")
        return bots.last.inner_text().strip() if bots.count() else ""

    def set_slider(self, label: str, value: str) -> None:
        """Type into a slider's number box until the slider itself holds the value (typing
        while the Settings accordion is still opening can be lost)."""
        deadline = time.time() + 10
        while self.page.get_by_label(f"range slider for {label}").input_value() != value:
            assert time.time() < deadline, f"the {label} slider does not take {value}"
            self.page.get_by_label(f"number input for {label}").fill(value)
            self.page.keyboard.press("Tab")
            time.sleep(0.2)

    def stats(self) -> str:
        return self.page.inner_text("#stats").strip()

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_describe_a_sample_then_hit_the_prefix_cache(browser, ui):
    page = Page(browser, ui.base)
    question = "Describe the image."
    answer = page.ask(question, [str(SAMPLES / "shapes4.png")])
    page.shot("1-answer")
    assert normalize_answer(answer) == normalize_answer(expected("shapes4.png", question))
    first = page.stats()
    assert re.search(r"tokens/s .* time to first token", first) and "1 encoder ran" in first
    page.page.click("#clear")
    page.page.wait_for_timeout(300)
    again = page.ask(question, [str(SAMPLES / "shapes4.png")])
    page.shot("2-prefix-cache-hit")
    cached = int(re.search(r"(\d+) from the prefix cache", page.stats()).group(1))
    assert cached > 0 and normalize_answer(again) == normalize_answer(answer)


def test_a_broken_file_shows_an_error_and_the_next_question_works(browser, ui, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes((SAMPLES / "shapes1.png").read_bytes()[:50])
    page = Page(browser, ui.base)
    error = page.ask("Describe the image.", [str(broken)])
    page.shot("3-broken-file")
    assert error.startswith("⚠️") and "not a readable image" in error
    page.page.click("#clear")
    question = "How many shapes are there?"
    answer = page.ask(question, [str(SAMPLES / "shapes3.jpg")])
    page.shot("4-after-error")
    assert normalize_answer(answer) == expected("shapes3.jpg", question)


def test_same_text_through_the_ui_and_the_api_for_the_same_seed(browser, ui):
    page = Page(browser, ui.base)
    page.page.click("text=Settings")
    page.set_slider("temperature", "0.9")
    page.page.fill("#seed textarea", "42")
    question = "Where is the blue circle?"
    ui_text = page.ask(question, [str(SAMPLES / "shapes4.png")])
    client = openai.OpenAI(base_url=ui.base + "/v1", api_key="ui-test-key", max_retries=0)
    import base64

    url = "data:image/png;base64," + base64.b64encode((SAMPLES / "shapes4.png").read_bytes()).decode()
    api = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0.9, top_p=1.0, seed=42, max_tokens=128,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                                               {"type": "text", "text": question}]}])
    assert ui_text == api.choices[0].message.content.strip()


def test_stop_really_aborts_a_long_answer(browser, tmp_path):
    # a random-weight model rambles on to max tokens: a long answer to stop, from a model
    # wide enough that 1024 tokens take seconds, not the fraction of one the tiny ones do
    path = build_qwen2_5_vl(tmp_path / "wide", hidden_size=512, num_layers=4, num_heads=8, intermediate_size=2048)
    s = Server(str(path), "--num-kv-blocks", "512", command="ui")
    try:
        page = Page(browser, s.base)
        page.page.click("text=Settings")
        page.set_slider("max tokens", "1024")
        page.ask("What is in this picture?", wait=False)  # greedy: 1024 tokens without an end
        deadline = time.time() + 30
        while time.time() < deadline and len(page.last_answer()) < 20:  # streaming has begun
            time.sleep(0.05)
        page.page.click("#stop")
        page.page.wait_for_timeout(1000)
        page.shot("5-stopped")
        partial = page.last_answer()
        deadline = time.time() + 10
        while time.time() < deadline and s.metric("num_requests_running"):
            time.sleep(0.2)
        assert s.metric("num_requests_running") == 0 and s.metric("kv_cache_blocks_in_use") == 0
        text = httpx.get(s.base + "/metrics").text
        assert re.search(r'request_success_total\{finished_reason="abort"\} [1-9]', text)
        assert 0 < len(partial)
    finally:
        s.stop()
