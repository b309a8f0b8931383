"""The steps of benchmarks/gpu_check.py that run Python on the machine being checked,
each in a process of its own (so a crash or a hang costs that step alone):

    python benchmarks/gpu_steps.py env|imports|serve|gdn|throughput OUT.json [options]

Each writes its findings as JSON to OUT.json and exits 0 when the step passed, 1 when it
failed (the findings say why), other codes when it broke. `env` and `imports` need no
GPU (the dry run runs them here); the others do.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import importlib.metadata
import io
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

# what vlmserve needs to import and serve, and what the tests and the check use
PACKAGES = ("torch", "triton", "transformers", "tokenizers", "huggingface-hub", "safetensors", "numpy", "pillow",
            "xxhash", "prometheus-client", "xgrammar", "pydantic", "fastapi", "starlette", "uvicorn", "openai",
            "httpx", "av", "pytest")
MODULES = ("vlmserve", "vlmserve.engine.llm_engine", "vlmserve.entrypoints.cli",
           "vlmserve.entrypoints.openai.api_server", "vlmserve.kernels.triton_attention", "vlmserve.kernels.triton_gdn", "vlmserve.kernels.triton_elementwise",
           "vlmserve.kernels.triton_quantized_linear", "vlmserve.worker.cuda_graphs", "vlmserve.models.qwen3_5",
           "vlmserve.models.gemma3", "vlmserve.testing.checkpoints", "xgrammar", "openai", "fastapi", "uvicorn",
           "transformers")
# torch APIs vlmserve calls that are newer than torch's oldest releases: each must exist on
# the image's torch (2.11) as on the pinned one
TORCH_APIS = ("nn.functional.scaled_dot_product_attention", "linalg.solve_triangular", "cuda.CUDAGraph", "cuda.graph",
              "cuda.graph_pool_handle", "isin", "bincount", "library.Library", "utils.cpp_extension.load")


def pinned(name: str) -> str | None:
    """The version pyproject.toml pins a dependency to (None: not pinned)."""
    match = re.search(rf'"{re.escape(name)}==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    return match.group(1) if match else None


def versions() -> dict[str, str | None]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def nvidia_smi() -> dict[str, str] | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    name, driver, memory, clock = (part.strip() for part in out.stdout.splitlines()[0].split(","))
    return {"name": name, "driver": driver, "memory": memory, "max_sm_clock": clock}


def step_env(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                            "cuda_available": torch.cuda.is_available(), "packages": versions(),
                            "nvidia_smi": nvidia_smi()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                    device_count=torch.cuda.device_count())
    return info["cuda_available"] or args.dry_run, info


def has_torch_api(path: str) -> bool:
    """Whether torch.<path> exists (its submodule imported first: torch.utils.cpp_extension
    is not imported by `import torch`)."""
    import torch

    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module("torch." + ".".join(parts[:i]))
            break
        except ImportError:
            continue
    target: Any = torch
    for part in parts:
        target = getattr(target, part, None)
        if target is None:
            return False
    return True


def step_imports(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """Every module the server, the engine and the check import, where each came from,
    transformers at the project's pin, and the torch APIs vlmserve relies on."""
    modules: dict[str, str] = {}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
            modules[name] = "ok: " + str(getattr(module, "__file__", "") or "")
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            modules[name] = f"error: {type(e).__name__}: {e}"
    missing_apis = [f"torch.{path}" for path in TORCH_APIS if not has_torch_api(path)]
    found = versions()
    want = pinned("transformers")
    problems = [f"{name}: {status}" for name, status in modules.items() if status.startswith("error")]
    problems += [f"{api} is missing" for api in missing_apis]
    if found["transformers"] != want:
        problems.append(f"transformers {found['transformers']} imported, the project pins {want}")
    return not problems, {"modules": modules, "versions": found, "transformers_pin": want,
                          "torch_apis_missing": missing_apis, "problems": problems}


# -- serve: `vlmserve serve --device cuda` and the official client ----------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def picture_url(width: int = 160, height: int = 120, seed: int = 3) -> str:
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def step_serve(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """The tiny Qwen2.5-VL behind `vlmserve serve --device cuda`; the `openai` client asks
    about a picture, streamed and not: the same greedy answer both ways."""
    import httpx
    import openai

    from vlmserve.testing.checkpoints import build_qwen2_5_vl

    work = Path(tempfile.mkdtemp(prefix="gpu-check-serve-"))
    model = build_qwen2_5_vl(work / "qwen25")
    port = free_port()
    log_path = Path(args.out).with_suffix(".server.log")
    command = [sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", "--device", "cuda", "--model", str(model),
               "--port", str(port), "--served-model-name", "tiny", "--num-kv-blocks", "512"]
    details: dict[str, Any] = {"command": command}
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start = time.perf_counter()
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with code {server.returncode}")
            if time.perf_counter() - start > args.server_timeout:
                raise RuntimeError(f"the server did not answer /health in {args.server_timeout} s")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        details["start_s"] = round(time.perf_counter() - start, 2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture_url()}},
                                                 {"type": "text", "text": "Describe the image."}]}]
        kwargs = dict(model="tiny", messages=messages, temperature=0, max_tokens=24)
        t = time.perf_counter()
        first = None
        pieces, usage = [], None
        for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - t
                pieces.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        details.update(stream_s=round(time.perf_counter() - t, 3), first_chunk_s=round(first or -1, 3),
                       chunks=len(pieces))
        whole = client.chat.completions.create(**kwargs)
        streamed, text = "".join(pieces), whole.choices[0].message.content
        details.update(text=text, streamed=streamed, prompt_tokens=whole.usage.prompt_tokens,
                       completion_tokens=whole.usage.completion_tokens,
                       streamed_completion_tokens=usage.completion_tokens if usage else None)
        # the picture's tokens count: more prompt tokens than the same text alone
        text_only = client.chat.completions.create(**{**kwargs, "max_tokens": 1, "messages": [
            {"role": "user", "content": "Describe the image."}]})
        details["text_only_prompt_tokens"] = text_only.usage.prompt_tokens
        ok = bool(text) and streamed == text and whole.usage.prompt_tokens > text_only.usage.prompt_tokens
        if not ok:
            details["problem"] = ("empty answer, the streamed answer differs from the plain one, or the picture "
                                  "added no prompt tokens")
        return ok, details
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        details["server_exit"] = server.returncode
        details["server_log_tail"] = log_path.read_text(errors="replace")[-3000:]


# -- gdn: the chunked delta rule against the recurrence, timed -------------------------------
def step_gdn(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """Qwen3.5's delta-rule heads (16 key / 32 value heads of 128), bf16 inputs, fp32
    states: prefills by the chunked (WY) kernels and by the token recurrence, and a decode
    step of 64 sequences; the outputs must agree."""
    import numpy as np
    import torch
    from triton.testing import do_bench

    from vlmserve.kernels import gdn, triton_gdn

    device = torch.device("cuda")
    hk, h, dk, dv = 16, 32, 128, 128
    upload = lambda name, a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    cases: dict[str, Any] = {}
    ok = True
    for label, lengths in (("1 x 4096", [4096]), ("8 x 512", [512] * 8), ("1 x 16384", [16384]),
                           ("decode 64", [1] * 64)):
        meta = gdn.build_recurrent_metadata(list(range(len(lengths))), [0 if n > 1 else 10 for n in lengths],
                                            lengths, upload)
        t = sum(lengths)
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(t, hk, dk, device=device, generator=gen).to(torch.bfloat16)
        k = torch.randn(t, hk, dk, device=device, generator=gen).to(torch.bfloat16)
        v = torch.randn(t, h, dv, device=device, generator=gen).to(torch.bfloat16)
        g = -torch.rand(t, h, device=device, generator=gen)
        beta = torch.rand(t, h, device=device, generator=gen)
        state = torch.zeros(len(lengths), h, dk, dv, device=device)
        inputs = (q, k, v, g, beta)
        fast = lambda s=state, i=inputs, m=meta: triton_gdn.gated_delta_rule_triton(*i, s, m)  # noqa: E731
        slow = lambda s=state, i=inputs, m=meta: triton_gdn.gated_delta_rule_recurrent_triton(*i, s, m)  # noqa: E731
        a, b = fast(state.clone()).float(), slow(state.clone()).float()  # from the same state
        diff = float((a - b).abs().max() / b.abs().max())
        fast_ms = do_bench(fast, warmup=10, rep=50, return_mode="median")
        slow_ms = do_bench(slow, warmup=10, rep=50, return_mode="median")
        cases[label] = {"tokens": t, "chunked_ms": round(fast_ms, 4), "recurrent_ms": round(slow_ms, 4),
                        "speedup": round(slow_ms / fast_ms, 2), "chunked_tok_s": round(t / fast_ms * 1e3),
                        "max_rel_diff": diff}
        ok &= diff < 2e-2
    return ok, {"widths": {"key_heads": hk, "value_heads": h, "dk": dk, "dv": dv}, "cases": cases}


def step_throughput(args: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    from gpu_throughput import measure

    return measure(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("step", choices=["env", "imports", "serve", "gdn", "throughput"])
    ap.add_argument("out", help="the JSON file of the step's findings")
    ap.add_argument("--dry-run", action="store_true", help="no GPU expected (env passes without one)")
    ap.add_argument("--server-timeout", type=float, default=150.0, help="serve: seconds for /health")
    ap.add_argument("--families", default="qwen2_5_vl_3b,qwen3_5", help="throughput: scale checkpoints to time")
    ap.add_argument("--layers", type=int, default=8, help="throughput: text layers (and tower blocks) kept")
    ap.add_argument("--batch-requests", type=int, default=16, help="throughput: requests of the batch workload")
    ap.add_argument("--budget", type=float, default=300.0, help="throughput: seconds; a family that would not fit "
                                                                 "is left out")
    args = ap.parse_args()
    step = {"env": step_env, "imports": step_imports, "serve": step_serve, "gdn": step_gdn,
            "throughput": step_throughput}[args.step]
    try:
        ok, details = step(args)
    except Exception as e:  # noqa: BLE001 - reported, then the step fails
        ok, details = False, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    Path(args.out).write_text(json.dumps(details, indent=1, default=str))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
