"""The Gradio UI in a real browser (Debian's chromium, driven by Playwright), against a
real `vlmserve ui` process. Screenshots go to artifacts/ui/."""

from __future__ import annotations

import base64
import json
import re
import struct
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image, ImageDraw
from PIL.PngImagePlugin import PngInfo

from conftest import apt_install
from test_openai_server import Server, free_port
from vlmserve.testing.checkpoints import build_qwen2_5_vl
from vlmserve.training.shapes import normalize_answer

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"
SHOTS = REPO / "artifacts" / "ui"
CHROMIUM = "/usr/bin/chromium"
SEED_TEST_TEMPERATURE = 2.0  # high enough that the shipped model's answers depend on the seed
MAX_IMAGE_PIXELS = 100_000  # the ui fixture's --max-image-pixels: above every sample (288x288 at most)
THUMBNAIL_PX = 9 * 16  # ui/app.py CSS: pictures and clips in the transcript at most 9rem high

pytestmark = pytest.mark.slow


def ensure_chromium() -> None:
    """Installs Debian's chromium the first time the browser tests run on a machine:
    `python -m pytest` alone needs nothing else."""
    if not Path(CHROMIUM).exists():
        apt_install("chromium")


@pytest.fixture(scope="module")
def browser():
    ensure_chromium()
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
    s = Server(None, "--api-key", "ui-test-key", "--max-image-pixels", str(MAX_IMAGE_PIXELS),
               command="ui")  # the shipped model
    yield s
    s.stop()


def expected(file: str, question: str) -> str:
    for item in json.loads((SAMPLES / "answers.json").read_text()):
        if item["file"] == file and item["question"] == question:
            return item["answer"]
    raise KeyError((file, question))


def fresh_copy(folder: Path, name: str) -> str:
    """A sample's pixels (so its answers) in bytes no other test sent: a PNG with a unique
    text chunk, or an MP4 with a unique `free` box at the end, has an mm_hash of its own,
    so no cache of the module's server holds it."""
    if name.endswith(".mp4"):
        path = folder / f"{Path(name).stem}-{uuid.uuid4().hex[:8]}.mp4"
        path.write_bytes((SAMPLES / name).read_bytes() + struct.pack(">I", 24) + b"free" + uuid.uuid4().bytes)
        return str(path)
    info = PngInfo()
    info.add_text("nonce", uuid.uuid4().hex)
    path = folder / f"{Path(name).stem}-{uuid.uuid4().hex[:8]}.png"
    Image.open(SAMPLES / name).save(path, pnginfo=info)
    return str(path)


class Page:
    def __init__(self, browser, base: str) -> None:
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.goto(base + "/")
        self.page.wait_for_selector("#input textarea", timeout=60000)

    def ask(self, question: str, files: list[str] = (), wait: bool = True) -> str:
        page = self.page
        if files:
            page.set_input_files("#input input[type=file]", list(files))
            self.wait_uploaded(len(files))
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

    def wait_uploaded(self, n: int) -> None:
        """Until the input shows n files (a thumbnail appears once the upload is done)."""
        thumbnails = self.page.locator("#input [aria-label='File thumbnail']")
        deadline = time.time() + 20
        while thumbnails.count() < n:
            assert time.time() < deadline, f"{thumbnails.count()} of {n} files uploaded"
            time.sleep(0.1)

    def wait_stats(self, pattern: str, timeout: float = 60) -> str:
        """Until the stats line matches (an answer that does not add a message, as
        Regenerate's, is done when its own stats appear), then until the answer is done."""
        deadline = time.time() + timeout
        while not re.search(pattern, self.stats()):
            assert time.time() < deadline, f"stats never matched {pattern!r}: {self.stats()!r}"
            time.sleep(0.1)
        self.wait_done(0, deadline - time.time())
        return self.stats()

    def clear(self) -> None:
        """Clicks Clear and waits until the transcript is empty."""
        self.page.click("#clear")
        deadline = time.time() + 20
        while self.page.locator("#chat .message").count():
            assert time.time() < deadline, "Clear left messages in the chat"
            time.sleep(0.1)

    def answers(self) -> int:
        """Assistant messages in the transcript (gradio shows consecutive ones in one row)."""
        return self.page.locator("#chat [data-testid='bot']").count()

    def prompt_tokens(self) -> int:
        return int(re.search(r"prompt (\d+) tokens", self.stats()).group(1))

    def paste(self, path: str, mime: str) -> None:
        """A real paste event on the textarea, its clipboard holding the file (what the
        browser fires for Ctrl+V after copying a picture)."""
        self.page.evaluate("""([data, name, type]) => {
            const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
            const clipboard = new DataTransfer();
            clipboard.items.add(new File([bytes], name, {type}));
            document.querySelector("#input textarea").dispatchEvent(
                new ClipboardEvent("paste", {clipboardData: clipboard, bubbles: true, cancelable: true}));
        }""", [base64.b64encode(Path(path).read_bytes()).decode(), Path(path).name, mime])

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

    def set_number(self, label: str, value: str) -> None:
        box = self.page.get_by_label(label)
        deadline = time.time() + 10
        while box.input_value() != value:  # as for sliders: typing into an opening accordion can be lost
            assert time.time() < deadline, f"{label} does not take {value}"
            box.fill(value)
            self.page.keyboard.press("Tab")
            time.sleep(0.2)

    def stats(self) -> str:
        # the markdown only: while a request runs, #stats also shows gradio's progress timer
        return self.page.inner_text("#stats [data-testid='markdown']").strip()

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
    page.clear()
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
    with ThreadPoolExecutor(2) as pool:  # both start at once: one wait for the imports, not two
        starts = [pool.submit(Server, None, "--api-base", ui.base + "/v1", "--api-key", "ui-test-key", command="ui"),
                  pool.submit(Server, None, "--api-base", f"http://127.0.0.1:{free_port()}/v1", command="ui")]
    started = [f.result() for f in starts if f.exception() is None]
    try:
        remote, down = [f.result() for f in starts]  # raises if one did not come up
        page = Page(browser, remote.base)
        question = "How many shapes are there?"
        answer = page.ask(question, [str(SAMPLES / "shapes2.png")])
        assert normalize_answer(answer) == expected("shapes2.png", question)
        page = Page(browser, down.base)
        error = page.ask(question, [str(SAMPLES / "shapes2.png")])
        page.shot("7-server-down")
        assert error.startswith("⚠️") and "not reachable" in error
    finally:
        for server in started:
            server.stop()


def test_two_pictures_and_a_clip_in_one_turn(browser, ui, tmp_path):
    page = Page(browser, ui.base)
    question = "Which way does the green square move?"
    files = [fresh_copy(tmp_path, name) for name in ("shapes1.png", "shapes2.png", "moving.mp4")]
    answer = page.ask(question, files)
    page.shot("8-pictures-and-a-clip")
    assert normalize_answer(answer) == expected("moving.mp4", question)
    pictures, clips = page.page.locator("#chat img"), page.page.locator("#chat video")
    assert pictures.count() == 2 and clips.count() == 1
    # shown (loaded and decoded: the chat loads them lazily), as thumbnails
    page.page.wait_for_function("() => [...document.querySelectorAll('#chat img')].every("
                                "(img) => img.complete && img.naturalWidth > 0)", timeout=10000)
    for pic in pictures.all():
        assert 0 < pic.bounding_box()["height"] <= THUMBNAIL_PX
    assert clips.first.evaluate("(v) => v.currentSrc").endswith(".mp4")
    assert 0 < clips.first.bounding_box()["height"] <= THUMBNAIL_PX
    # files, not encoder inputs: the clip (2 frame groups, each encoded on its own) counts once
    assert page.stats().endswith("media: 3 encoder ran"), page.stats()


def test_a_picture_from_the_encoder_cache(browser, ui, tmp_path):
    """A, then (after Clear) B and A: A's place in the prompt differs, so the prefix cache
    has none of it, but its encoder output is still cached and the encoder runs for B only."""
    page = Page(browser, ui.base)
    a, b = fresh_copy(tmp_path, "shapes1.png"), fresh_copy(tmp_path, "shapes2.png")
    question = "Describe the image."
    assert normalize_answer(page.ask(question, [a])) == normalize_answer(expected("shapes1.png", question))
    assert page.stats().endswith("media: 1 encoder ran"), page.stats()
    page.clear()
    answer = page.ask("How many shapes are there?", [b, a])
    page.shot("9-encoder-cache")
    assert answer and not answer.startswith("⚠️")
    stats = page.stats()
    assert "0 from the prefix cache" in stats, stats
    assert stats.endswith("media: 1 encoder ran, 1 from the encoder cache"), stats


def test_regenerate_replaces_the_answer(browser, ui, tmp_path):
    page = Page(browser, ui.base)
    question = "Describe the image."
    answer = page.ask(question, [fresh_copy(tmp_path, "shapes3.jpg")])
    assert normalize_answer(answer) == normalize_answer(expected("shapes3.jpg", question))
    assert "0 from the prefix cache" in page.stats() and page.answers() == 1
    page.page.click("#regenerate")
    stats = page.wait_stats(r"in the prefix cache")  # the first answer's stats had none
    page.shot("10-regenerated")
    assert page.answers() == 1  # the new answer in place of the old, not after it
    assert page.last_answer() == answer  # temperature 0
    assert int(re.search(r"(\d+) from the prefix cache", stats).group(1)) > 0 and "encoder ran" not in stats


def test_max_pixels_makes_the_prompt_shorter(browser, ui, tmp_path):
    picture = fresh_copy(tmp_path, "shapes4.png")
    page = Page(browser, ui.base)
    page.ask("Describe the image.", [picture])
    full = page.prompt_tokens()
    page.clear()
    page.page.click("text=Settings")
    page.set_number("max pixels per image (0: the model's)", "3136")
    page.ask("Describe the image.", [picture])
    page.shot("11-max-pixels")
    # 200x200 at the model's bounds is 192x192: 3x3 tokens of 64x64 pixels (16 px patches
    # merged 4x4); under 3136 pixels (56x56) it shrinks to one token
    assert page.prompt_tokens() == full - 8
    assert page.stats().endswith("media: 1 encoder ran")  # another size: another encoder input


def test_a_picture_over_the_pixel_limit_shows_an_error(browser, ui, tmp_path):
    big = tmp_path / "big.png"
    picture = Image.new("RGB", (400, 400), "white")
    ImageDraw.Draw(picture).ellipse((100, 100, 300, 300), fill="blue")
    picture.save(big)
    page = Page(browser, ui.base)
    error = page.ask("Describe the image.", [str(big)])
    page.shot("12-too-large")
    assert error.startswith("⚠️") and f"400x400 pixels, over the {MAX_IMAGE_PIXELS}-pixel limit" in error
    question = "How many shapes are there?"
    assert normalize_answer(page.ask(question, [str(SAMPLES / "shapes1.png")])) == expected("shapes1.png", question)


def test_a_pasted_picture(browser, ui):
    page = Page(browser, ui.base)
    page.paste(str(SAMPLES / "shapes4.png"), "image/png")
    page.wait_uploaded(1)
    question = "What color is the circle?"
    answer = page.ask(question)
    page.shot("13-pasted")
    assert page.page.locator("#chat img").count() == 1
    assert normalize_answer(answer) == expected("shapes4.png", question)


def test_a_sample_is_a_clickable_example(browser, ui):
    page = Page(browser, ui.base)
    question = "Where is the green triangle?"  # one sample has it: the example to click is unique
    page.page.get_by_text(question).click()
    page.wait_uploaded(1)
    assert page.page.input_value("#input textarea") == question
    before = page.page.locator("#chat .message").count()
    page.page.focus("#input textarea")
    page.page.keyboard.press("Enter")
    page.wait_done(before)
    page.shot("14-example")
    assert normalize_answer(page.last_answer()) == expected("shapes2.png", question)


def stop_looks(page: Page) -> tuple[str, str]:
    """The Stop button as a user sees it: enabled or not, and whether its background is a
    saturated red (Gradio's "stop" variant)."""
    button = page.page.locator("#stop")
    r, g, b = (int(x) for x in re.findall(r"\d+", button.evaluate("e => getComputedStyle(e).backgroundColor"))[:3])
    red = r > 150 and r > 2 * g and r > 2 * b
    return ("disabled" if button.is_disabled() else "enabled"), ("red" if red else "not red")


def test_stop_really_aborts_a_long_answer(browser, tmp_path):
    # a random-weight model rambles on to max tokens: a long answer to stop, from a model
    # wide enough that 8192 tokens take many seconds on any machine
    path = build_qwen2_5_vl(tmp_path / "wide", hidden_size=512, num_layers=4, num_heads=8, intermediate_size=2048,
                            max_position_embeddings=16384)
    s = Server(str(path), "--num-kv-blocks", "1100", command="ui")
    try:
        page = Page(browser, s.base)
        # nothing runs: Stop looks inactive (disabled, not the solid red of the primary action)
        assert stop_looks(page) == ("disabled", "not red")
        page.page.click("text=Settings")
        page.set_slider("max tokens", "8192")
        page.ask("What is in this picture?", wait=False)  # greedy: 8192 tokens without an end
        deadline = time.time() + 30
        while time.time() < deadline and len(page.last_answer()) < 20:  # streaming has begun
            time.sleep(0.05)
        assert stop_looks(page) == ("enabled", "red")  # an answer streams: Stop is the action
        page.page.click("#stop")
        page.page.wait_for_timeout(1000)
        page.shot("5-stopped")
        assert stop_looks(page) == ("disabled", "not red")
        partial = page.last_answer()
        deadline = time.time() + 10
        while time.time() < deadline and s.metric("num_requests_running"):
            time.sleep(0.2)
        assert s.metric("num_requests_running") == 0 and s.metric("kv_cache_blocks_in_use") == 0
        text = httpx.get(s.base + "/metrics").text
        assert re.search(r'request_success_total\{[^}]*finished_reason="abort"[^}]*\} [1-9]', text)
        assert 0 < len(partial)
        page.page.close()  # the browser's connections end before the server drains
    finally:
        s.stop()


def test_choosing_a_lora_adapter(browser, tmp_path):
    """`vlmserve ui --lora-modules`: the model choice lists the base model and the adapter
    (from /v1/models); an answer under the adapter is the API's under it, and differs from
    the base model's."""
    from vlmserve.engine.model_source import resolve_model_path
    from vlmserve.testing.lora_adapters import write_lora_adapter

    shipped = resolve_model_path(None)
    adapter = write_lora_adapter(shipped, tmp_path / "shaped", 8, ["q_proj", "v_proj", "down_proj"], seed=21, std=0.3)
    s = Server(None, "--lora-modules", f"shaped={adapter}", command="ui")
    try:
        page = Page(browser, s.base)
        question, picture = "Describe the image.", str(SAMPLES / "shapes4.png")
        base_answer = page.ask(question, [picture])
        page.page.click("#model input")
        page.page.get_by_role("option", name="shaped").click()
        page.clear()
        answer = page.ask(question, [picture])
        page.shot("9-lora-adapter")
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "shaped"]
        url = "data:image/png;base64," + base64.b64encode(Path(picture).read_bytes()).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                                                 {"type": "text", "text": question}]}]

        def api(model):
            return client.chat.completions.create(model=model, messages=messages, temperature=0, top_p=1.0,
                                                  max_tokens=128).choices[0].message.content.strip()

        assert answer == api("shaped") and base_answer == api("tiny")
        assert answer != base_answer
    finally:
        s.stop()
