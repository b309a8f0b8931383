"""Shared fixtures: tiny checkpoints built once per session, transformers references."""

from __future__ import annotations

import base64
import ctypes.util
import io
import os
import subprocess

# No GPU here: the kernel tests define and run the Triton kernels on CPU tensors, in
# Triton's interpreter, which must be on before they are first defined. VLMSERVE_TEST_DEVICE=cuda
# (benchmarks/gpu_check.py on a GPU machine) runs the device-aware tests on CUDA tensors,
# compiled.
TEST_DEVICE = os.environ.get("VLMSERVE_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Two test workers, each with a team of two OpenMP threads (and the servers they start), on
# a machine of two cores: a team's threads spinning at a barrier hold the core that the
# other worker's team is waiting for. Sleeping there instead (read by libgomp as torch
# loads it, and inherited by every process a test starts): the AVX2 kernel tests' child
# run alone 22 s, two at once 270 s each spinning and 27 s each sleeping (an Ice Lake Xeon).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Every engine the tests build (and the servers they start) keeps a step in flight: the mode
# a GPU runs by default, here on a thread of its own; on these 2 cores an engine's default is
# off (docs/architecture.md). test_async_scheduling.py compares the two modes.
os.environ.setdefault("VLMSERVE_ASYNC_SCHEDULING", "1")

import numpy as np
import pytest
import torch
from PIL import Image

from vlmserve.testing.checkpoints import (Experts, build_gemma3, build_qwen2_5_vl, build_qwen2_vl, build_qwen3_5,
                                         build_qwen3_vl)

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    """Files with end-to-end (slow) tests first: with -n 2 each file runs whole in one
    worker, and a long file started last leaves the other worker idle to the end."""
    long_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in long_files)  # stable: each file's order kept


@pytest.fixture(params=[False, True], ids=["one-stream", "streams"])
def gemv_streams(request):
    """Each way the decode GEMVs can read a thread's weight (the kernels' load sets one by CPU
    family: cpu_extension.gemv_reads_in_streams), then this machine's way again."""
    from vlmserve.kernels.cpu_extension import cpu_kernels

    kernels = cpu_kernels()
    before = kernels.gemv_streams()
    kernels.set_gemv_streams(request.param)
    yield request.param
    kernels.set_gemv_streams(before)


def apt_install(package: str) -> None:
    """Installs a Debian package the tests need (as root, or through password-less sudo),
    one test worker at a time (dpkg takes one at a time)."""
    import fcntl

    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with open("/tmp/vlmserve-tests-apt.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
            done = subprocess.run(sudo + cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                pytest.fail(f"{package} is missing and `{' '.join(cmd)}` failed: {done.stderr.strip()[-500:]}")


def ensure_libibverbs() -> None:
    """Mooncake's build without CUDA loads Debian's libibverbs1 even for TCP: installed the
    first time its tests run on a machine."""
    if not ctypes.util.find_library("ibverbs"):
        apt_install("libibverbs1")


def make_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(img: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


@pytest.fixture(scope="session")
def thinking_path(tmp_path_factory):
    """Tiny Qwen3-VL with Qwen3's thinking template and tokens, trained (seconds) to think,
    then answer its lessons (vlmserve/testing/thinking.py)."""
    from vlmserve.testing.thinking import build_qwen3_thinking

    return str(build_qwen3_thinking(tmp_path_factory.mktemp("thinking")))


@pytest.fixture(scope="session")
def qwen25_path(tmp_path_factory):
    """Tiny Qwen2.5-VL: 3 layers, the last one sliding-window (32 tokens), vision depth 2."""
    return str(build_qwen2_5_vl(tmp_path_factory.mktemp("qwen25")))


class HFReference:
    """transformers' own model and processor for a checkpoint: the numerical reference."""

    def __init__(self, path: str, **processor_kwargs) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        self.processor_kwargs = processor_kwargs  # for pictures (Gemma 3's do_pan_and_scan)
        self.model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        self._cache: dict = {}

    def prompt(self, text: str, n_images: int = 0) -> str:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        return self.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)

    def inputs(self, prompt: str, images: list[Image.Image]):
        return self.processor(text=[prompt], images=images or None, return_tensors="pt",
                              **(self.processor_kwargs if images else {}))

    @torch.no_grad()
    def generate(self, prompt: str, images: list[Image.Image], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens and the log-probabilities of each step."""
        key = (prompt, tuple(png_bytes(i) for i in images), max_new_tokens)
        if key not in self._cache:
            inp = self.inputs(prompt, images)
            out = self.model.generate(
                **inp, max_new_tokens=max_new_tokens, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )
            tokens = out.sequences[0, inp["input_ids"].shape[1]:].tolist()
            logprobs = torch.log_softmax(torch.stack([l[0] for l in out.logits]).float(), dim=-1)
            self._cache[key] = (tokens, logprobs)
        return self._cache[key]

    @torch.no_grad()
    def generate_video(self, prompt: str, video_path: str, max_new_tokens: int) -> list[int]:
        """Greedy tokens for a prompt with one video, decoded with transformers' PyAV reader."""
        from transformers.video_utils import load_video

        frames, meta = load_video(video_path, backend="pyav")
        inp = self.processor(text=[prompt], videos=[frames], videos_kwargs={"video_metadata": [meta]}, return_tensors="pt")
        out = self.model.generate(**inp, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, inp["input_ids"].shape[1]:].tolist(), inp["input_ids"][0].tolist()

    @torch.no_grad()
    def prompt_logprobs(self, prompt: str, images: list[Image.Image]) -> tuple[list[int], torch.Tensor]:
        inp = self.inputs(prompt, images)
        logits = self.model(**inp).logits[0]
        return inp["input_ids"][0].tolist(), torch.log_softmax(logits.float(), dim=-1)


def assert_greedy_like_transformers(llm, hf: HFReference, image: Image.Image, max_tokens: int = 12,
                                    atol: float = 1e-3) -> None:
    """A prompt with the picture and a text-only one: greedy tokens equal transformers',
    the chosen tokens' logprobs within atol (EOS ignored, so every step counts)."""
    from vlmserve import SamplingParams

    for text, images in (("Describe the image. " * 3, [image]), ("Tell me a story about a fox.", [])):
        prompt = hf.prompt(text, len(images))
        tokens, logprobs = hf.generate(prompt, images, max_tokens)
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                           SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
                           )[0].outputs[0]
        assert out.token_ids == tokens
        chosen = torch.tensor([entry.logprobs[0] for entry in out.logprobs])
        assert torch.allclose(chosen, logprobs[torch.arange(len(tokens)), torch.tensor(tokens)], atol=atol)


@pytest.fixture(scope="module")
def short_context_server(qwen25_path):
    """`vlmserve serve` on the tiny Qwen2.5-VL with a 1,024-token context (what vLLM's
    clients and the evaluation harness are tried against)."""
    from test_openai_server import Server

    server = Server(qwen25_path, "--num-kv-blocks", "512", "--max-model-len", "1024")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def hf_qwen25(qwen25_path):
    return HFReference(qwen25_path)


@pytest.fixture(scope="session")
def qwen2vl_path(tmp_path_factory):
    """Tiny Qwen2-VL: 3 full-attention layers, vision depth 2 (LayerNorm, GELU MLP)."""
    return str(build_qwen2_vl(tmp_path_factory.mktemp("qwen2vl")))


@pytest.fixture(scope="session")
def hf_qwen2vl(qwen2vl_path):
    return HFReference(qwen2vl_path)


@pytest.fixture(scope="session")
def qwen35_path(tmp_path_factory):
    """Tiny Qwen3.5: Gated DeltaNet, attention, DeltaNet, attention; vision depth 2."""
    return str(build_qwen3_5(tmp_path_factory.mktemp("qwen35")))


@pytest.fixture(scope="session")
def hf_qwen35(qwen35_path):
    return HFReference(qwen35_path)


@pytest.fixture(scope="session")
def gemma3_path(tmp_path_factory):
    """Tiny Gemma 3: sliding (window 24) and global layers alternating, SigLIP depth 2
    pooled to 16 tokens a picture, pan-and-scan crops available."""
    return str(build_gemma3(tmp_path_factory.mktemp("gemma3")))


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_path):
    """transformers' Gemma 3 with pan-and-scan on (the engine's tests turn it on too)."""
    return HFReference(gemma3_path, do_pan_and_scan=True)


@pytest.fixture(scope="session")
def qwen3vl_path(tmp_path_factory):
    """Tiny Qwen3-VL: 4 Qwen3 layers; vision depth 3 with DeepStack levels after blocks 0 and 1."""
    return str(build_qwen3_vl(tmp_path_factory.mktemp("qwen3vl")))


@pytest.fixture(scope="session")
def hf_qwen3vl(qwen3vl_path):
    return HFReference(qwen3vl_path)


@pytest.fixture(scope="session")
def qwen3vlmoe_path(tmp_path_factory):
    """Tiny Qwen3-VL-MoE: 8 experts, top 2, layer 1 dense; DeepStack as qwen3vl_path."""
    return str(build_qwen3_vl(tmp_path_factory.mktemp("qwen3vlmoe"), experts=Experts(8, 2, 48, dense_layers=(1,))))


@pytest.fixture(scope="session")
def hf_qwen3vlmoe(qwen3vlmoe_path):
    return HFReference(qwen3vlmoe_path)


@pytest.fixture(scope="session")
def qwen35moe_path(tmp_path_factory):
    """Tiny Qwen3.5-MoE: the qwen35_path layers with 8 experts (top 2) and a shared expert."""
    return str(build_qwen3_5(tmp_path_factory.mktemp("qwen35moe"), experts=Experts(8, 2, 48, shared_intermediate=40)))


@pytest.fixture(scope="session")
def hf_qwen35moe(qwen35moe_path):
    return HFReference(qwen35moe_path)
