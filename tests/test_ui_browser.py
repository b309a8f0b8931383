"""The Gradio UI in a real browser (Debian's chromium, driven by Playwright), against a
real `vlmserve ui` process. Screenshots go to artifacts/ui/."""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from test_openai_server import Server, free_port
from vlmserve.testing.checkpoints import build_qwen2_5_vl
from vlmserve.training.shapes import normalize_answer

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"
SHOTS = REPO / "artifacts" / "ui"
CHROMIUM = "/usr/bin/chromium"
SEED_TEST_TEMPERATURE = 2.0  # high enough that the shipped model's answers depend on the seed

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
        """Until an answer was added, the input is usable again, and the answer is real
        text that stays the same over two looks (not gradio's "loading content" placeholder)."""
        deadline, seen = time.time() + timeout, None
        while time.time() < deadline:
            done = self.page.locator("#chat .message").count() > before and self.page.locator(
                "#input textarea").is_enabled()
            answer = self.last_answer() if done else None
            if answer and answer != "loading content" and answer == seen:
                return
            seen = answer
            time.sleep(0.2)
        raise AssertionError("no answer in time")

    def last_answer(self) -> str:
        bots = self.page.locator("#chat .message.bot, #chat [data-testid='bot']")
        return bots.last.inner_text().strip() if bots.count() else ""

    def set_slider(self, label: str, value: str) -> None:
        """Type into a slider's number box until the slider itself holds the value (typing
        while the Settings accordion is still opening can be lost)."""
        deadline = time.time() + 10
        while float(self.page.get_by_label(f"range slider for {label}").input_value()) != float(value):
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
    second = page.stats()
    cached = int(re.search(r"(\d+) from the prefix cache", second).group(1))
    assert cached > 0 and "1 in the prefix cache" in second and "encoder ran" not in second
    assert normalize_answer(again) == normalize_answer(answer)


def test_a_broken_file_shows_an_error_and_the_next_question_works(browser, ui, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes((SAMPLES / "shapes1.png").read_bytes()[:50])
    page = Page(browser, ui.base)
    error = page.ask("Describe the image.", [str(broken)])
    page.shot("3-broken-file")
    assert error.startswith("⚠️") and "not a readable image" in error
    question = "How many shapes are there?"  # in the same conversation: the broken file is not sent again
    answer = page.ask(question, [str(SAMPLES / "shapes3.jpg")])
    page.shot("4-after-error")
    assert normalize_answer(answer) == expected("shapes3.jpg", question)


def test_same_text_through_the_ui_and_the_api_for_the_same_seed(browser, ui):
    """Two turns at a temperature where the seed matters: the UI's answers are the API's
    for the same conversation and seed (and another seed answers otherwise)."""
    page = Page(browser, ui.base)
    page.page.click("text=Settings")
    page.set_slider("temperature", str(SEED_TEST_TEMPERATURE))
    page.page.fill("#seed textarea", "42")
    picture = str(SAMPLES / "shapes4.png")
    first_q, second_q = "Describe the image.", "How many shapes are there?"
    first = page.ask(first_q, [picture])
    second = page.ask(second_q)
    page.shot("6-two-turns")
    client = openai.OpenAI(base_url=ui.base + "/v1", api_key="ui-test-key", max_retries=0)
    url = "data:image/png;base64," + base64.b64encode(Path(picture).read_bytes()).decode()
    turn = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                                         {"type": "text", "text": first_q}]}]

    def api(messages, seed=42):
        return client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                              temperature=SEED_TEST_TEMPERATURE, top_p=1.0, seed=seed,
                                              max_tokens=128).choices[0].message.content.strip()

    assert first == api(turn)
    assert second == api(turn + [{"role": "assistant", "content": first}, {"role": "user", "content": second_q}])
    assert any(api(turn, seed) != first for seed in range(43, 51))  # the seed does matter here


def test_the_ui_against_another_server_and_a_server_that_is_down(browser, ui):
    """--api-base: the UI alone, talking to a running server (here the in-process one of
    the other UI), then to an address where nothing answers."""
    remote = Server(None, "--api-base", ui.base + "/v1", "--api-key", "ui-test-key", command="ui")
    down = Server(None, "--api-base", f"http://127.0.0.1:{free_port()}/v1", command="ui")
    try:
        page = Page(browser, remote.base)
        question = "How many shapes are there?"
        answer = page.ask(question, [str(SAMPLES / "shapes2.png")])
        assert normalize_answer(answer) == expected("shapes2.png", question)
        page = Page(browser, down.base)
        error = page.ask(question, [str(SAMPLES / "shapes2.png")])
        page.shot("7-server-down")
        assert error.startswith("⚠️") and "not reachable" in error
    finally:
        remote.stop()
        down.stop()


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
