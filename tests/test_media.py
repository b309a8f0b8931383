"""The media layer: every source, every mode and container, hashing and caching, limits,
and parity with transformers' own processors."""

import contextlib
import http.server
import os
import threading
import time

import numpy as np
import pytest
import torch
from PIL import Image

from media_files import huge_png_header, image_bytes, in_mode, picture, undecodable_video_bytes, video_bytes
from vlmserve import LLM, SamplingParams
from vlmserve.multimodal.hashing import mm_hash
from vlmserve.multimodal.media import MediaError, MediaLimits, MediaLoader
from vlmserve.multimodal.processor import LOW_DETAIL_MAX_PIXELS, MultiModalProcessor


@pytest.fixture(scope="module")
def processor(qwen25_path, tmp_path_factory):
    from transformers import AutoConfig

    folder = tmp_path_factory.mktemp("allowed")
    loader = MediaLoader(MediaLimits(allowed_local_media_path=str(folder)))
    proc = MultiModalProcessor(qwen25_path, AutoConfig.from_pretrained(qwen25_path), loader)
    proc.folder = folder
    return proc


# -- parity with transformers ---------------------------------------------------------------
@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P", "L", "LA", "CMYK"])
@pytest.mark.parametrize("size", [(37, 53), (130, 100), (640, 480), (1000, 300)])
def test_image_pixels_and_grid_equal_transformers(processor, mode, size):
    img = in_mode(picture(*size, seed=size[0]), mode)
    data = image_bytes(img, "JPEG" if mode == "CMYK" else "PNG")
    ours = processor.process(data, "image")
    ref = processor.hf_processor.image_processor(images=[Image.open(__import__("io").BytesIO(data))], return_tensors="pt")
    assert ours.data["grid_thw"] == tuple(ref["image_grid_thw"][0].tolist())
    assert torch.equal(ours.data["pixel_values"], ref["pixel_values"])


def test_pictures_are_kept_in_the_models_dtype_and_encode_the_same(qwen25_path):
    """A bf16 engine keeps pixel_values in bf16 (half the memory of waiting requests'
    pictures): the vision tower casts them to its dtype first, so it encodes them exactly
    as it encodes the fp32 ones."""
    from vlmserve.kernels import kernel_table
    from vlmserve.multimodal.inputs import MultiModalFeature
    from vlmserve.worker.model_loader import load_model

    llm = LLM(qwen25_path, dtype="bfloat16", num_kv_blocks=64)
    data = image_bytes(picture(130, 100), "PNG")
    kept = llm.engine.mm_processor.process(data, "image")
    fp32 = MultiModalProcessor(qwen25_path, llm.engine.hf_config, MediaLoader()).process(data, "image")
    assert kept.data["pixel_values"].dtype == torch.bfloat16 and kept.nbytes * 2 == fp32.nbytes
    assert torch.equal(kept.data["pixel_values"], fp32.data["pixel_values"].to(torch.bfloat16))
    model, _ = load_model(qwen25_path, "bfloat16", kernel_table("cpu"))
    features = [MultiModalFeature("image", item.mm_hash, 0, item.num_tokens, item.data) for item in (kept, fp32)]
    with torch.inference_mode():
        encoded = model.embed_multimodal(features)
    assert torch.equal(encoded[0], encoded[1])


def test_sixteen_bit_and_exif_rotation(processor):
    grey16 = Image.fromarray((np.linspace(0, 65535, 64 * 48).reshape(48, 64)).astype(np.uint16))
    rgb = processor.loader.decode_image(processor.loader.read(image_bytes(grey16), "image"))
    arr = np.asarray(rgb)
    assert rgb.mode == "RGB" and arr.min() == 0 and arr.max() == 255  # scaled, not clipped to white
    assert np.unique(arr).size > 200
    img = picture(60, 30)
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    loaded = processor.loader.decode_image(processor.loader.read(image_bytes(img, "JPEG", exif=exif), "image"))
    assert loaded.size == (30, 60)


def test_video_frames_grid_and_time_equal_transformers(processor, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(video_bytes("mp4", frames=20, fps=10))
    ours = processor.process(path.read_bytes(), "video")
    hf = processor.hf_processor
    prompt = hf.apply_chat_template([{"role": "user", "content": [{"type": "video"}]}], add_generation_prompt=True)
    # transformers decodes files with torchcodec by default (not installed); its PyAV reader
    from transformers.video_utils import load_video

    frames, meta = load_video(str(path), backend="pyav")
    ref = hf(text=[prompt], videos=[frames], videos_kwargs={"video_metadata": [meta]}, return_tensors="pt")
    assert ours.data["grid_thw"] == tuple(ref["video_grid_thw"][0].tolist())
    assert torch.equal(ours.data["pixel_values"], ref["pixel_values_videos"])
    assert ours.data["second_per_grid_t"] == pytest.approx(float(ref["second_per_grid_ts"][0]))
    assert ours.data["grid_thw"][0] == 10  # every frame (this processor does not sample), 2 per step


@pytest.mark.parametrize("fmt", ["mp4", "webm", "mov", "gif"])
def test_video_containers_and_frame_lists(processor, fmt):
    video = processor.loader.decode_video(processor.loader.read(video_bytes(fmt), "video"))
    assert video.frames.shape == (12, 64, 96, 3) and video.fps == pytest.approx(4.0)
    frames = [Image.fromarray(f) for f in video.frames]
    as_list = processor.process(frames, "video", {"fps": 4})
    as_file = processor.process(video_bytes(fmt), "video")
    assert as_list.data["grid_thw"][1:] == as_file.data["grid_thw"][1:]


# -- hashing and caching ------------------------------------------------------------------------
def test_mm_hash_covers_modality_bytes_and_settings():
    assert mm_hash("image", b"abc", {}) == mm_hash("image", b"abc", {})
    assert mm_hash("image", b"abc", {}) != mm_hash("video", b"abc", {})
    assert mm_hash("image", b"abc", {}) != mm_hash("image", b"abd", {})
    assert mm_hash("image", b"abc", {"max_pixels": 1000}) != mm_hash("image", b"abc", {})


def test_same_image_twice_is_decoded_and_resized_once(processor, monkeypatch):
    data = image_bytes(picture(120, 90, seed=77))
    calls = []
    original = processor.image_processor.__call__
    monkeypatch.setattr(type(processor.image_processor), "__call__", lambda self, *a, **k: calls.append(1) or original(*a, **k))
    before = processor.cache.stats.hits
    first = processor.process(data, "image")
    second = processor.process(data, "image")
    assert len(calls) == 1 and processor.cache.stats.hits == before + 1
    assert first.mm_hash == second.mm_hash


def test_per_request_resolution_and_detail(processor):
    data = image_bytes(picture(640, 480, seed=5))
    full = processor.process(data, "image")
    small = processor.process(data, "image", {"max_pixels": 56 * 56 * 4})
    low = processor.process(data, "image", {"detail": "low"})
    auto = processor.process(data, "image", {"detail": "auto"})
    tokens = [int(np.prod(m.data["grid_thw"])) // 4 for m in (full, small, low, auto)]
    assert tokens[1] < tokens[0] and tokens[3] == tokens[0]
    assert tokens[2] <= LOW_DETAIL_MAX_PIXELS // (28 * 28)
    assert len({full.mm_hash, small.mm_hash, low.mm_hash}) == 3 and auto.mm_hash == full.mm_hash


def test_low_detail_never_raises_the_models_own_cap():
    """The shipped model caps pictures below detail=low's budget: "low" must not enlarge them."""
    from transformers import AutoConfig

    from vlmserve.engine.model_source import resolve_model_path

    path = resolve_model_path(None)
    shipped = MultiModalProcessor(path, AutoConfig.from_pretrained(path), MediaLoader())
    assert shipped.image_processor.size["longest_edge"] < LOW_DETAIL_MAX_PIXELS
    data = image_bytes(picture(640, 480, seed=5))
    auto, low = (shipped.process(data, "image", {"detail": d}) for d in ("auto", "low"))
    assert np.prod(low.data["grid_thw"]) == np.prod(auto.data["grid_thw"])


# -- sources ---------------------------------------------------------------------------------
class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):
        if self.path == "/drip-headers.png":  # headers a byte every 50 ms
            try:
                self.wfile.write(b"HTTP/1.0 200 OK\r\n")
                for _ in range(1000):
                    self.wfile.write(b"X")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
            return
        if self.path == "/drip.png":  # a byte every 50 ms: no single read is slow, the whole is
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            try:
                for _ in range(1000):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:  # the client gave up
                pass
            return
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    png = image_bytes(picture(50, 40))
    _Handler.routes = {
        "/pic.png": (200, {"Content-Type": "image/png"}, png),
        "/same-host": (302, {"Location": f"http://127.0.0.1:{port}/pic.png"}, b""),
        "/other-host": (302, {"Location": f"http://localhost:{port}/pic.png"}, b""),
        "/big.png": (200, {}, png * 100),
    }
    yield f"http://127.0.0.1:{port}", png
    server.shutdown()


def test_http_fetching_rules(http_server):
    base, png = http_server
    off = MediaLoader(MediaLimits())
    with pytest.raises(MediaError, match="http\\(s\\) media is not enabled"):
        off.read(f"{base}/pic.png", "image")
    loader = MediaLoader(MediaLimits(allowed_media_domains=["127.0.0.1"], max_image_bytes=len(png) * 10))
    assert loader.read(f"{base}/pic.png", "image").content == png
    assert loader.read(f"{base}/same-host", "image").content == png
    with pytest.raises(MediaError, match="redirects to another host"):
        loader.read(f"{base}/other-host", "image")
    with pytest.raises(MediaError, match="over the .*-byte limit"):
        loader.read(f"{base}/big.png", "image")
    with pytest.raises(MediaError, match="HTTP 404"):
        loader.read(f"{base}/missing.png", "image")
    with pytest.raises(MediaError, match="not in the allowed media domains"):
        loader.read("http://example.com/pic.png", "image")


def test_the_fetch_timeout_bounds_the_whole_fetch(http_server):
    base, _ = http_server
    loader = MediaLoader(MediaLimits(allowed_media_domains=["127.0.0.1"], fetch_timeout=0.5))
    for route in ("drip.png", "drip-headers.png"):  # the body, or the headers, trickle in
        start = time.monotonic()
        with pytest.raises(MediaError, match="took longer than the 0.5 s timeout"):
            loader.read(f"{base}/{route}", "image")
        assert time.monotonic() - start < 1.5  # not the 50 s the server would take
    assert loader.read(f"{base}/pic.png", "image").content  # a quick fetch is not cut off


def test_local_files_only_under_the_allowed_folder(processor, tmp_path):
    folder = processor.folder
    (folder / "ok.png").write_bytes(image_bytes(picture(20, 20)))
    outside = tmp_path / "secret.png"
    outside.write_bytes(image_bytes(picture(20, 20)))
    os.symlink(outside, folder / "link.png")
    loader = processor.loader
    assert loader.read(str(folder / "ok.png"), "image").content
    assert loader.read("file://" + str(folder / "ok.png"), "image").content
    for bad in (str(outside), str(folder / ".." / outside.parent.name / "secret.png"), str(folder / "link.png")):
        with pytest.raises(MediaError, match="outside the allowed media folder"):
            loader.read(bad, "image")
    with pytest.raises(MediaError, match="local media is not enabled"):
        MediaLoader(MediaLimits()).read(str(folder / "ok.png"), "image")


# -- bad input through the engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(qwen25_path, processor):
    return LLM(qwen25_path, num_kv_blocks=256, allowed_local_media_path=str(processor.folder),
               limit_mm_per_prompt={"image": 2, "video": 1})


def _chat(part):
    return [{"role": "user", "content": [part, {"type": "text", "text": "Describe the image."}]}]


def _data_url(data: bytes, mime="image/png") -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _bad_inputs(folder):
    png = image_bytes(picture(40, 30))
    (folder / "empty.png").write_bytes(b"")
    escape = folder / "escape.png"
    if not escape.is_symlink():
        escape.symlink_to("/etc/hostname")
    img = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    return {
        "truncated PNG": (img(_data_url(png[: len(png) // 2])), "not a readable image"),
        "not an image": (img(_data_url(b"hello, I am text" * 10)), "not a readable image"),
        "20000 x 20000 PNG": (img(_data_url(huge_png_header())), "too large|pixel limit"),
        "zero-byte file": (img(str(folder / "empty.png")), "empty \\(0 bytes\\)"),
        "outside the folder": (img("/etc/hostname"), "outside the allowed media folder"),
        "dot-dot escape": (img(str(folder / ".." / ".." / "etc" / "hostname")), "outside the allowed media folder"),
        "symlink out of the folder": (img(str(folder / "escape.png")), "outside the allowed media folder"),
        "http when fetching is off": (img("http://127.0.0.1:1/pic.png"), "not enabled"),
        "video without a decodable frame": (
            {"type": "video_url", "video_url": {"url": _data_url(undecodable_video_bytes(), "video/mp4")}},
            "no decodable frame",
        ),
    }


@pytest.mark.parametrize("case", [
    "truncated PNG", "not an image", "20000 x 20000 PNG", "zero-byte file", "outside the folder",
    "dot-dot escape", "symlink out of the folder", "http when fetching is off", "video without a decodable frame",
])
def test_bad_input_is_refused_and_the_next_request_works(llm, processor, case):
    part, message = _bad_inputs(processor.folder)[case]
    with pytest.raises(ValueError, match=message):
        llm.chat(_chat(part))
    assert not llm.engine.has_unfinished_requests()
    ok = llm.chat(_chat({"type": "image", "image": picture(64, 48)}), SamplingParams(max_tokens=2))[0]
    assert ok.outputs[0].token_ids


def test_more_images_than_the_limit_is_refused(llm):
    parts = [{"type": "image", "image": picture(32, 32, seed=i)} for i in range(3)]
    with pytest.raises(ValueError, match="3 image\\(s\\) in one prompt, over the limit of 2"):
        llm.chat([{"role": "user", "content": parts}])
    assert llm.chat(_chat(parts[0]), SamplingParams(max_tokens=2))[0].finished


@pytest.mark.parametrize("family", ["qwen25", "qwen2vl", "qwen35", "qwen3vl", "qwen3vlmoe", "qwen35moe"])
def test_greedy_output_with_a_video_equals_transformers(family, request, tmp_path):
    path, hf = request.getfixturevalue(f"{family}_path"), request.getfixturevalue(f"hf_{family}")
    video = tmp_path / "clip.mp4"
    video.write_bytes(video_bytes("mp4", frames=16, fps=8, size=(96, 64)))
    llm = LLM(path, num_kv_blocks=256, allowed_local_media_path=str(tmp_path))
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": str(video)}},
                                             {"type": "text", "text": "Describe the image."}]}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))[0]
    prompt = hf.processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe the image."}]}],
                                              add_generation_prompt=True)
    ref_tokens, ref_prompt = hf.generate_video(prompt, str(video), 12)
    assert out.prompt_token_ids == ref_prompt  # timestamps and placeholders included
    assert out.outputs[0].token_ids == ref_tokens


def test_own_pixel_cap_and_background_are_settings():
    """The pixel cap is vlmserve's own (refused from the header, far below PIL's bomb
    guard) and so is the colour under transparent pixels."""
    strict = MediaLoader(MediaLimits(max_image_pixels=100 * 100, background=(0, 0, 0)))
    with pytest.raises(MediaError, match="120x100 pixels, over the 10000-pixel limit"):
        strict.decode_image(strict.read(image_bytes(picture(120, 100)), "image"))
    clear = Image.new("RGBA", (8, 8), (200, 10, 10, 0))
    assert np.asarray(strict.decode_image(strict.read(image_bytes(clear), "image"))).max() == 0
    assert np.asarray(MediaLoader().decode_image(MediaLoader().read(image_bytes(clear), "image"))).min() == 255


def test_numpy_pictures_and_the_video_limit(qwen25_path):
    llm = LLM(qwen25_path, num_kv_blocks=256, limit_mm_per_prompt={"image": 1, "video": 0})
    img = picture(64, 48, seed=9)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    as_pil = llm.chat(_chat({"type": "image", "image": img}), greedy)[0]
    as_array = llm.chat(_chat({"type": "image", "image": np.asarray(img)}), greedy)[0]
    assert as_array.outputs[0].token_ids == as_pil.outputs[0].token_ids
    frames = np.stack([np.asarray(picture(64, 48, seed=s)) for s in range(4)])
    with pytest.raises(ValueError, match="1 video\\(s\\) in one prompt, over the limit of 0"):
        llm.chat(_chat({"type": "video", "video": frames}))
    assert llm.chat(_chat({"type": "image", "image": img}), greedy)[0].finished


def test_a_long_clip_keeps_only_the_frames_the_model_samples(qwen35_path):
    """Qwen3.5 samples 2 frames per second: of a 3-second, 30-fps clip only those are
    converted to RGB and kept, and they are the frames a full decode has there."""
    from transformers import AutoConfig

    proc = MultiModalProcessor(qwen35_path, AutoConfig.from_pretrained(qwen35_path), MediaLoader())
    data = video_bytes("mp4", frames=90, fps=30)
    decoded = []
    decoding = proc.loader.decoding

    @contextlib.contextmanager
    def watched(raw, choose=None):
        with decoding(raw, choose) as video:
            decoded.append(video)
            yield video

    proc.loader.decoding = watched
    item = proc.process(data, "video")
    video = decoded[0]
    assert video.num_frames == 90 and video.kept is not None and len(video.frames) == len(video.kept) <= 8
    full = proc.loader.decode_video(proc.loader.read(data, "video"))
    assert full.kept is None and len(full.frames) == 90
    assert np.array_equal(video.frames, full.frames[video.kept])
    assert item.data["grid_thw"][0] == len(video.kept) // 2


def test_a_video_counts_once_in_the_media_stats(qwen35_path, tmp_path):
    """Qwen3.5 encodes a clip in frame groups (one feature each); the usage counts files."""
    video = tmp_path / "clip.mp4"
    video.write_bytes(video_bytes("mp4", frames=16, fps=8, size=(96, 64)))
    llm = LLM(qwen35_path, num_kv_blocks=256, allowed_local_media_path=str(tmp_path))
    messages = [{"role": "user", "content": [{"type": "image", "image": picture(64, 48, seed=3)},
                                             {"type": "video_url", "video_url": {"url": str(video)}},
                                             {"type": "text", "text": "Describe the image."}]}]
    greedy = SamplingParams(temperature=0, max_tokens=2)
    scheduler = llm.engine.engine_core.scheduler
    requests, add = [], scheduler.add_request
    scheduler.add_request = lambda r: (requests.append(r), add(r))[1]
    first = llm.chat(messages, greedy)[0]
    assert [f.piece for f in requests[0].mm_features] == [0, 0, 1]  # the picture, the clip in 2 groups
    assert first.media_stats == {"encoded": 2, "encoder_cache": 0, "prefix_cache": 0}
    again = llm.chat(messages, greedy)[0]
    assert again.media_stats == {"encoded": 0, "encoder_cache": 0, "prefix_cache": 2}
