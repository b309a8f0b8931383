"""`vlmserve caption` on real files: duplicates, broken files, a video, resume after a kill, Ray."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_image, png_bytes
from media_files import video_bytes
from vlmserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """50 files: 42 distinct images, 5 byte-identical copies, 2 broken files, 1 video."""
    root = tmp_path_factory.mktemp("pictures")
    (root / "sub").mkdir()
    for i in range(42):
        img = make_image(40 + (i % 7) * 13, 40 + (i % 5) * 11, seed=100 + i)
        (root / ("sub" if i % 3 == 0 else ".") / f"img{i:02d}.png").write_bytes(png_bytes(img))
    for k, i in enumerate([1, 2, 5, 5, 7]):
        shutil.copy(root / f"img{i:02d}.png", root / f"zcopy{k}.png")
    (root / "broken.png").write_bytes(png_bytes(make_image(30, 30, 1))[:60])
    (root / "notes.jpg").write_bytes(b"this is not a picture at all")
    (root / "clip.mp4").write_bytes(video_bytes("mp4", frames=8, fps=4))
    return root


def caption(model: str, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vlmserve.entrypoints.cli", "caption", "--model", model, "--no-progress",
           "--num-kv-blocks", "512", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=600)


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_folder_with_copies_broken_files_and_a_video(qwen25_path, folder, tmp_path):
    out = tmp_path / "captions.jsonl"
    result = caption(qwen25_path, str(folder), "--out", str(out), "--max-tokens", "8")
    assert result.returncode == 1, result.stderr  # some files failed
    rows = rows_of(out)
    assert len(rows) == 50 and len({r["path"] for r in rows}) == 50
    good = [r for r in rows if r["error"] is None]
    bad = [r for r in rows if r["error"] is not None]
    assert len(good) == 48 and sorted(Path(r["path"]).name for r in bad) == ["broken.png", "notes.jpg"]
    assert all("not a readable image" in r["error"] for r in bad)
    copies = [r for r in good if r["duplicate_of"]]
    assert sorted(Path(r["path"]).name for r in copies) == [f"zcopy{k}.png" for k in range(5)]
    by_path = {r["path"]: r for r in rows}
    for c in copies:
        original = by_path[c["duplicate_of"]]
        assert original["duplicate_of"] is None
        assert (c["caption"], c["mm_hash"]) == (original["caption"], original["mm_hash"])
    assert "done 48 (of which duplicates 5)" in result.stderr and "failed 2" in result.stderr
    video = by_path[str(folder / "clip.mp4")]
    assert video["caption"] is not None and video["prompt_tokens"] > 10
    # the captions are the LLM API's for the same settings
    llm = LLM(qwen25_path, num_kv_blocks=512, allowed_local_media_path=str(folder))
    some = [r for r in good if r["path"].endswith(".png")][:6]
    outs = llm.chat([[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": r["path"]}},
                                                   {"type": "text", "text": "Describe the image."}]}] for r in some],
                    SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].text for o in outs] == [r["caption"] for r in some]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_killed_halfway_then_resumed(qwen25_path, folder, tmp_path, sig):
    out = tmp_path / "captions.jsonl"
    cmd = [sys.executable, "-m", "vlmserve.entrypoints.cli", "caption", "--model", qwen25_path, str(folder),
           "--out", str(out), "--no-progress", "--num-kv-blocks", "512", "--batch-size", "2", "--max-tokens", "48",
           "--ignore-eos"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 15):
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    first = rows_of(out) if sig == signal.SIGINT else [json.loads(l) for l in out.read_text().splitlines()
                                                        if l.endswith("}")]
    assert 15 <= len(first) < 50
    if sig == signal.SIGKILL:  # a torn last line may remain; the next run ignores it
        pass
    result = caption(qwen25_path, str(folder), "--out", str(out), "--batch-size", "2", "--max-tokens", "48",
                     "--ignore-eos", "--resume")
    lines = out.read_text().splitlines()
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    paths = [r["path"] for r in rows]
    assert len(paths) == len(set(paths)) == 50  # each path exactly once: nothing captioned twice
    assert f"skipped {len(first)}" in result.stderr


@pytest.mark.slow
def test_ray_gives_the_same_rows(qwen25_path, folder, tmp_path):
    pytest.importorskip("ray")
    local, distributed = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    caption(qwen25_path, str(folder), "--out", str(local), "--max-tokens", "8")
    result = caption(qwen25_path, str(folder), "--out", str(distributed), "--max-tokens", "8", "--ray",
                     "--ray-workers", "2")
    assert result.returncode == 1, result.stderr
    key = lambda r: r["path"]  # noqa: E731
    assert sorted(rows_of(distributed), key=key) == sorted(rows_of(local), key=key)
