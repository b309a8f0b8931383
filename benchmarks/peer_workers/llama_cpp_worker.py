"""bench_peers.py's llama.cpp worker: a llama-server (benchmarks/setup_llama_cpp.sh builds
it) on the checkpoint's GGUF files (benchmarks/llama_cpp_convert.py makes them), driven over
its own /completion endpoint with the workload's prompts: the same text, each picture
placeholder as the server's media marker (/props says which; it adds <|vision_start|>
and <|vision_end|> itself), greedy, ignore_eos. All requests at once (one client each, as many slots) or one
at a time (the one-user workload); streamed, so each first token's time is seen.

--model is the checkpoint folder (for the driver's common flags); --gguf and --mmproj the
files to serve."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from protocol import load_workload, protocol_stdout, serve, summarize, worker_args

PICTURE = "<|vision_start|><|image_pad|><|vision_end|>"


def post(url: str, body: dict[str, Any], timeout: float = 3600) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(request, timeout=timeout)


def complete(base: str, prompt: str, pictures: list[str], max_tokens: int) -> tuple[list[int], float, int]:
    """One request (its prompt with the media markers): its output token ids, the
    wall-clock time of its first token, and the prompt tokens the server took from its cache."""
    body = {"prompt": {"prompt_string": prompt, "multimodal_data": pictures},
            "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True, "stream": True,
            "cache_prompt": True, "return_tokens": True}
    tokens: list[int] = []
    first, cached = 0.0, 0
    with post(base + "/completion", body) as response:
        for line in response:
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("tokens"):
                first = first or time.time()
                tokens.extend(chunk["tokens"])
            if chunk.get("stop"):
                cached = chunk.get("timings", {}).get("cache_n", 0)
    return tokens, first, cached


def main() -> None:
    out = protocol_stdout()
    ap = worker_args(__doc__)
    ap.add_argument("--server", type=Path, required=True, help="the llama-server binary")
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--mmproj", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--context", type=int, required=True, help="KV cache tokens, shared by the slots")
    args = ap.parse_args()

    requests = load_workload(args.workload)
    pictures = {}
    for r in requests:
        for im in r.images:
            if id(im) not in pictures:
                buffer = io.BytesIO()
                im.save(buffer, format="PNG")
                pictures[id(im)] = base64.b64encode(buffer.getvalue()).decode()
    slots = len(requests)
    t = time.perf_counter()
    # one slot per request (all run at once), a KV cache they share
    server = subprocess.Popen([
        str(args.server), "-m", str(args.gguf), "--mmproj", str(args.mmproj), "-t", str(args.threads),
        "-tb", str(args.threads), "-np", str(slots), "--kv-unified", "-c", str(args.context),
        "--host", "127.0.0.1", "--port", str(args.port), "--no-webui", "--cache-ram", "0", "-ngl", "0",
        "--slot-save-path", tempfile.mkdtemp(prefix="llama-slots-")])  # the slot actions (erase) need it
    base = f"http://127.0.0.1:{args.port}"
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(0.2)
    start_seconds = time.perf_counter() - t
    with urllib.request.urlopen(base + "/props", timeout=10) as response:
        marker = json.load(response)["media_marker"]

    def reset() -> None:
        for slot in range(slots):  # forget every slot's prompt cache
            post(f"{base}/slots/{slot}?action=erase", {}).close()

    def run(message: dict) -> dict[str, Any]:
        results: list[tuple[list[int], float, int] | None] = [None] * len(requests)

        def one(i: int) -> None:
            r = requests[i]
            results[i] = complete(base, r.prompt.replace(PICTURE, marker), [pictures[id(im)] for im in r.images],
                                  r.max_tokens)

        run_start = time.time()
        if message.get("sequential"):
            for i in range(len(requests)):
                one(i)
        else:
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        if any(r is None for r in results):
            raise RuntimeError("a request failed")
        return summarize(requests, [r[0] for r in results], sum(r[2] for r in results),
                         [r[1] for r in results], run_start)

    try:
        serve(out, start_seconds, reset, run)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
