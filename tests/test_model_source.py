"""Models from where users keep them (a folder, a hub id in the Hugging Face cache) and a
checkpoint's own sampling defaults. Nothing here reaches the network: the cache is built
in the layout huggingface_hub uses and read offline."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_image, png_bytes
from test_openai_server import Server
from vlmserve import LLM, SamplingParams
from vlmserve.errors import ConfigError
from vlmserve.engine.model_source import resolve_model_path, served_name

REPO = "tiny-org/tiny-vl"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_home(qwen25_path, tmp_path_factory):
    """HF_HOME holding REPO at COMMIT (refs/main), with sampling settings of its own."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(qwen25_path, snapshot)
    config = json.loads((snapshot / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=5, repetition_penalty=1.0)
    (snapshot / "generation_config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return home


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_hub_id_resolves_from_the_cache_offline(hub_home, offline):
    path = resolve_model_path(REPO, download_dir=str(hub_home / "hub"))
    assert Path(path).name == COMMIT and (Path(path) / "config.json").is_file()
    assert resolve_model_path(REPO, revision=COMMIT, download_dir=str(hub_home / "hub")) == path
    with pytest.raises(ConfigError, match="not in the Hugging Face cache .*huggingface-cli download tiny-org/absent"):
        resolve_model_path("tiny-org/absent", download_dir=str(hub_home / "hub"))
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        resolve_model_path(REPO, revision="v9", download_dir=str(hub_home / "hub"))


def test_a_folder_without_a_config_and_a_name_that_is_neither(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ConfigError, match="not a hub id"):
        resolve_model_path(str(tmp_path / "missing" / "deep" / "path"))


def test_the_checkpoints_sampling_defaults_and_the_switch_that_turns_them_off(hub_home, offline):
    llm = LLM(REPO, download_dir=str(hub_home / "hub"), num_kv_blocks=128)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    out = llm.generate(["Hello"], None)[0].outputs[0]  # greedy, 5 tokens: the checkpoint's settings
    assert len(out.token_ids) == 5 or out.finish_reason == "stop"
    again = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
    assert again.token_ids == out.token_ids
    mine = LLM(REPO, download_dir=str(hub_home / "hub"), num_kv_blocks=128, generation_config="vlmserve")
    assert mine.get_default_sampling_params() == SamplingParams()


def test_a_hub_id_is_served_under_its_own_name():
    assert served_name(REPO, "/cache/models--tiny-org--tiny-vl/snapshots/" + COMMIT) == REPO
    assert served_name("/models/my-qwen", "/models/my-qwen") == "my-qwen"
    assert served_name(None, "/site-packages/vlmserve/assets/shapes-qwen3.5") == "shapes-qwen3.5"


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vlmserve.entrypoints.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


@pytest.mark.slow
def test_the_commands_take_a_hub_id_and_say_in_one_line_what_is_missing(hub_home, tmp_path):
    env = {"HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1"}
    (tmp_path / "a.png").write_bytes(png_bytes(make_image(64, 48, seed=2)))
    done = cli("caption", str(tmp_path / "a.png"), "--model", REPO, "--out", str(tmp_path / "c.jsonl"),
               "--num-kv-blocks", "128", env=env)
    assert done.returncode == 0, done.stderr
    row = json.loads((tmp_path / "c.jsonl").read_text().splitlines()[0])
    assert row["error"] is None and row["caption"] is not None
    for model, says in [("tiny-org/absent", "not in the Hugging Face cache"), (str(tmp_path), "has no config.json")]:
        failed = cli("caption", str(tmp_path / "a.png"), "--model", model, "--out", str(tmp_path / "x.jsonl"), env=env)
        assert failed.returncode == 2 and says in failed.stderr
        assert len(failed.stderr.strip().splitlines()) == 1 and "Traceback" not in failed.stderr


@pytest.mark.slow
def test_the_server_serves_a_hub_id_with_its_defaults(hub_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = Server(REPO, "--num-kv-blocks", "128")
    try:
        client = server.client()
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}])
        assert chat.usage.completion_tokens == 5 or chat.choices[0].finish_reason == "stop"
        longer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=9, extra_body={"ignore_eos": True})
        assert longer.usage.completion_tokens == 9  # a field the request sets is its own
    finally:
        server.stop()


def test_every_engine_command_checks_its_model_and_settings_before_importing_the_engine(tmp_path):
    """A wrong --model or setting is one line at once: found before torch (seconds of
    imports) is, and before caption's earlier output is touched."""
    (tmp_path / "out.jsonl").write_text('{"path": "kept"}\n')
    script = f"""
import contextlib, io, sys
from vlmserve.entrypoints.cli import main
for argv in (["serve", "--model", "/no/such/model"], ["ui", "--model", "/no/such/model"],
             ["caption", "{tmp_path}", "--out", "{tmp_path / 'out.jsonl'}", "--model", "/no/such/model"],
             ["embed", "{tmp_path}", "--out", "{tmp_path / 'out.npy'}", "--model", "/no/such/model"],
             ["serve", "--speculative-config", '{{"num_speculative_tokens": 0}}'],
             ["serve", "--max-loras", "0"], ["serve", "--generation-config", "mine"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    print(code, err.getvalue().strip().count(chr(10)), err.getvalue().strip())
print("torch imported:", "torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 8, done.stdout + done.stderr
    for line, says in zip(lines, ["no such folder"] * 4 + ["num_speculative_tokens must be a positive integer",
                                                           "--max-loras 0", "--generation-config mine"]):
        assert line.startswith("2 0 vlmserve: ") and says in line, line
    assert lines[-1] == "torch imported: False"
    assert (tmp_path / "out.jsonl").read_text() == '{"path": "kept"}\n'
