"""`vlmserve caption` on real files: duplicates, broken files, a video, resume after a kill, Ray."""

from __future__ import annotations

import json
import re
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
from vlmserve.entrypoints.caption_rows import Row, merge_shards, previous_rows, shard_dir


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


def caption_cmd(model: str, *args: str, progress: bool = False) -> list[str]:
    return [sys.executable, "-m", "vlmserve.entrypoints.cli", "caption", "--model", model, "--num-kv-blocks", "512",
            *args, *([] if progress else ["--no-progress"])]


def caption(model: str, *args: str, check: bool = False, progress: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(caption_cmd(model, *args, progress=progress), capture_output=True, text=True, check=check,
                          timeout=600)


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
    assert re.search(r"done 48 \(of which duplicates 5, captioned 43\), skipped 0, failed 2, in [0-9.]+s: "
                     r"[0-9.]+ files/s, encoder cache hits \d+, prefix-cached tokens \d+", result.stderr), result.stderr
    video = by_path[str(folder / "clip.mp4")]
    assert video["caption"] is not None and video["prompt_tokens"] > 10
    # the captions are the LLM API's for the same settings
    llm = LLM(qwen25_path, num_kv_blocks=512, allowed_local_media_path=str(folder))
    some = [r for r in good if r["path"].endswith(".png")][:6] + [video]
    part = lambda path: ({"type": "video_url", "video_url": {"url": path}} if path.endswith(".mp4")  # noqa: E731
                         else {"type": "image_url", "image_url": {"url": path}})
    question = lambda path: "Describe the video." if path.endswith(".mp4") else "Describe the image."  # noqa: E731
    outs = llm.chat([[{"role": "user", "content": [part(r["path"]), {"type": "text", "text": question(r["path"])}]}]
                     for r in some], SamplingParams(temperature=0, max_tokens=8))
    assert [o.outputs[0].text for o in outs] == [r["caption"] for r in some]
    assert [o.num_prompt_tokens for o in outs] == [r["prompt_tokens"] for r in some]


def written_lines(out: Path) -> list[str]:
    """The output's lines so far, and its shards' (the Ray path's workers write those).
    The driver keeps its own copy of each worker's row: a path counts once."""
    files = [out, *sorted(shard_dir(out).glob("*.jsonl"))]
    lines, seen = [], set()
    for line in (line for f in files if f.exists() for line in f.read_text().splitlines()):
        path = json.loads(line)["path"] if line.endswith("}") else line
        if path not in seen:
            seen.add(path)
            lines.append(line)
    return lines


KILL_SETTINGS = ["--batch-size", "2", "--max-tokens", "48", "--ignore-eos"]


# `vlmserve caption` with a progress hook that sends a signal to its own process once the
# given number of rows is written: the run is cut at a known row on a machine of any speed
INTERRUPTED_AT_ROW = """
import os, signal, sys
from vlmserve.entrypoints.caption import run_caption
from vlmserve.entrypoints.cli import build_parser
sig, at = int(sys.argv[1]), int(sys.argv[2])
# as a terminal's Ctrl-C finds it: whatever the pytest worker's threads left in the signal
# mask or disposition that this process inherited (a CI run's cut never came), said first
status = {l.split(":")[0]: l.split()[1] for l in open("/proc/self/status") if l.startswith(("SigBlk", "SigIgn"))}
print("inherited signal mask and ignored set:", status, file=sys.stderr, flush=True)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
signal.signal(signal.SIGINT, signal.default_int_handler)
args = build_parser().parse_args(sys.argv[3:])
sys.exit(run_caption(args, on_row=lambda row, n: os.kill(os.getpid(), sig) if n == at else None))
"""


def kill_halfway_then_resume(model: str, folder: Path, out: Path, sig: int, *extra: str, at: int = 15
                             ) -> tuple[list[dict], str]:
    """Starts a run that sends itself `sig` once it has written `at` of the 50 rows, resumes;
    returns the rows written before the kill and the resumed run's stderr."""
    cmd = caption_cmd(model, str(folder), "--out", str(out), *KILL_SETTINGS, *extra)
    cmd = [sys.executable, "-c", INTERRUPTED_AT_ROW, str(int(sig)), str(at), *cmd[cmd.index("caption"):]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = written_lines(out)
    if extra:  # the run exited: no worker writes any more (checked over a second)
        time.sleep(1)
        assert written_lines(out) == lines
    first = [json.loads(line) for line in lines if line.endswith("}")]  # SIGKILL may tear the last
    # the interrupted run's exit and log say where a cut came too late (a CI run once saw all 50)
    assert at <= len(first) < 50, (proc.returncode, proc.stderr[:600], proc.stderr[-1500:])
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and all(line.endswith("}") for line in lines)
    result = caption(model, str(folder), "--out", str(out), *KILL_SETTINGS, *extra, "--resume")
    assert not shard_dir(out).exists(), result.stderr  # merged into the output
    rows = rows_of(out)  # every line whole: a torn one was cut off before appending
    paths = [r["path"] for r in rows]
    assert len(paths) == len(set(paths)) == 50  # each path exactly once
    assert f"skipped {len(first)}" in result.stderr
    # nothing captioned twice: the 43 originals (42 pictures, 1 video) ran once across both
    # runs, and every copy points at its original, even one captioned before the kill
    originals_before = sum(1 for r in first if r["error"] is None and r["duplicate_of"] is None)
    captioned = int(re.search(r"captioned (\d+)", result.stderr).group(1))
    assert originals_before + captioned == 43
    copies = [r for r in rows if Path(r["path"]).name.startswith("zcopy")]
    by_path = {r["path"]: r for r in rows}
    assert len(copies) == 5 and all(by_path[c["duplicate_of"]]["caption"] == c["caption"] for c in copies)
    return rows, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_killed_halfway_then_resumed(qwen25_path, folder, tmp_path, sig):
    kill_halfway_then_resume(qwen25_path, folder, tmp_path / "captions.jsonl", sig)


@pytest.mark.slow
def test_globs_lists_prompt_and_max_pixels(qwen25_path, folder, tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text(f"{folder / 'img04.png'}\n# a comment\n{folder / 'img10.png'}\n")
    jsonl = tmp_path / "list.jsonl"
    jsonl.write_text(json.dumps({"path": str(folder / "img13.png")}) + "\n")
    out = tmp_path / "captions.jsonl"
    args = [str(folder / "img0[12].png"), str(listing), str(jsonl), "--prompt", "What is this?",
            "--max-tokens", "5", "--ignore-eos"]
    result = caption(qwen25_path, *args, "--out", str(out), check=True, progress=True)
    bar = result.stderr.replace("\r", "\n")  # tqdm redraws its line in place
    # done/total, elapsed<ETA, the rate (tqdm turns it to s/file under 1 file/s)
    assert re.search(r"5/5 \[[0-9:]+<[0-9:]+, +[0-9.]+ ?(file/s|s/file)", bar), bar
    rows = {Path(r["path"]).name: r for r in rows_of(out)}
    assert sorted(rows) == ["img01.png", "img02.png", "img04.png", "img10.png", "img13.png"]
    assert all(r["output_tokens"] == 5 and r["finish_reason"] == "length" for r in rows.values())
    llm = LLM(qwen25_path, num_kv_blocks=512, allowed_local_media_path=str(folder))
    ref = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(folder / "img13.png")}},
                                                 {"type": "text", "text": "What is this?"}]}],
                   SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert rows["img13.png"]["caption"] == ref.outputs[0].text
    small = tmp_path / "small.jsonl"
    caption(qwen25_path, *args, "--out", str(small), "--max-pixels", str(56 * 56), check=True)
    smaller = {Path(r["path"]).name: r for r in rows_of(small)}
    assert smaller["img13.png"]["prompt_tokens"] < rows["img13.png"]["prompt_tokens"]
    assert smaller["img13.png"]["mm_hash"] != rows["img13.png"]["mm_hash"]  # other pixels, other hash


@pytest.mark.slow
def test_ray_interrupted_and_resumed_gives_the_rows_of_one_machine(qwen25_path, folder, tmp_path):
    """On a local 2-worker Ray cluster: Ctrl-C partway leaves the workers' output shards,
    --resume merges them and captions the rest; the rows are the single machine's. The
    driver sees rows a batch (8) at a time while the workers go on with their next ones,
    so the signal goes at its first row: at row 15 each worker was into its third and last
    batch, and the workers could finish every row before Ray stopped them."""
    local, distributed = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    result = caption(qwen25_path, str(folder), "--out", str(local), *KILL_SETTINGS)
    assert result.returncode == 1, result.stderr
    rows, stderr = kill_halfway_then_resume(qwen25_path, folder, distributed, signal.SIGINT, "--ray", "--ray-workers",
                                            "2", at=1)
    key = lambda r: r["path"]  # noqa: E731
    assert sorted(rows, key=key) == sorted(rows_of(local), key=key)
    assert re.search(r"workers 2, encoder cache hits \d+, prefix-cached tokens \d+", stderr)


@pytest.mark.parametrize("ray", [False, True])
def test_a_wrong_model_is_one_line_and_the_earlier_output_stays(folder, tmp_path, ray):
    """Checked before anything starts: no engine, no Ray workers (whose failure was a page
    of their tracebacks), and the output of an earlier run untouched."""
    out = tmp_path / "captions.jsonl"
    out.write_text('{"path": "earlier.png", "caption": "kept"}\n')
    result = caption(str(tmp_path / "no-such-model"), str(folder), "--out", str(out), *(["--ray"] if ray else []))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"vlmserve: --model {tmp_path / 'no-such-model'}: no such folder, "
                                                  "and not a hub id (org/name)"]
    assert out.read_text() == '{"path": "earlier.png", "caption": "kept"}\n'


def test_files_are_captioned_in_one_continuous_batch(qwen25_path, folder):
    """Not one file at a time: many requests share each engine step."""
    from vlmserve.engine.args import EngineArgs
    from vlmserve.engine.llm_engine import LLMEngine
    from vlmserve.entrypoints.caption_rows import expand_inputs
    from vlmserve.entrypoints.captioner import Captioner

    engine = LLMEngine(EngineArgs(model=qwen25_path, num_kv_blocks=512))
    captioner = Captioner(engine, "Describe the image.", "Describe the image.",
                          SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), {}, concurrency=8)
    running = []
    step = engine.step
    engine.step = lambda: (running.append(len(engine.engine_core.scheduler.running)), step())[1]
    paths = [p for p in expand_inputs([str(folder)]) if p.endswith(".png")][:16]
    rows = list(captioner.run(paths))
    assert len(rows) == 16 and all(r.output_tokens == 6 for r in rows if r.error is None)
    assert max(running) >= 6 and len(running) < 16 * 6  # steps are shared


def test_merging_shards_keeps_each_path_once_and_can_run_again(tmp_path):
    """What a crashed Ray run leaves: rows in the output, the same rows again in shards (the
    driver's copy and a worker's), a torn last line; merged, every path is there once."""
    out = tmp_path / "captions.jsonl"
    row = lambda name, caption="a": json.dumps(Row(name, caption=caption).__dict__) + "\n"  # noqa: E731
    out.write_text(row("done.png"))
    shards = shard_dir(out)
    shards.mkdir()
    (shards / "part-driver.jsonl").write_text(row("a.png") + row("broken.png", None))
    (shards / "part-host-1.jsonl").write_text(row("a.png") + row("b.png") + row("done.png") + '{"path": "c.p')
    rows = previous_rows(out)  # what --resume does first
    assert [r.path for r in rows] == ["done.png", "a.png", "broken.png", "b.png"] and not shards.exists()
    merge_shards(out)  # nothing left to merge: a no-op
    assert [r.path for r in previous_rows(out)] == ["done.png", "a.png", "broken.png", "b.png"]
    assert out.read_text().endswith("\n")


def test_a_ray_actor_makes_its_shard_only_when_it_has_rows(qwen25_path, folder, tmp_path):
    """Ray starts a pool's actors asynchronously: one still loading its model when the last
    batch is done must not make the shard folder again after the driver's merge removed it."""
    from vlmserve.engine.args import EngineArgs
    from vlmserve.entrypoints.caption_ray import CaptionActor

    shards = shard_dir(tmp_path / "captions.jsonl")
    actor = CaptionActor(EngineArgs(model=qwen25_path, num_kv_blocks=512), "Describe the image.",
                         "Describe the video.", SamplingParams(temperature=0, max_tokens=4), {}, 2, str(shards))
    assert not shards.exists()
    picture = str(folder / "img01.png")
    columns = actor({"path": [picture], "copies": [json.dumps([str(folder / "zcopy0.png")])]})
    assert columns["path"] == [picture, str(folder / "zcopy0.png")]
    assert [r.path for r in previous_rows(tmp_path / "captions.jsonl")] == columns["path"]  # the shard, merged
