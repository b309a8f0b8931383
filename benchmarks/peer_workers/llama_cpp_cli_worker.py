"""bench_peers.py's llama.cpp worker for the one-user workload: `llama-mtmd-cli`, the
program llama.cpp ships for one user and a picture (benchmarks/setup_llama_cpp.sh builds
it), one process per request on the checkpoint's GGUF files, greedy, ignore_eos.

What is timed is the request, not the program's start: from the moment the CLI has loaded
the model and projector (its "experimental CLI" warning, printed right before it reads the
picture) to its last generated text; the first token is the first text it prints. So a
run's `seconds` is the sum of its requests' times (the model loads are not counted), and
the first token is measured as for the server. The prompt is the workload's own text: the
CLI's chat template is replaced by one that passes the text through (its picture
placeholder as the CLI's media marker), so the model reads what the other engines read.
The CLI prints text, not token ids: the ids are the text tokenized again by the checkpoint's
tokenizer, and the count is -n's (its loop stops early only on an end-of-generation token,
which --ignore-eos bans).

--model is the checkpoint folder; --gguf and --mmproj the files to run."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

from protocol import load_workload, protocol_stdout, serve, summarize, worker_args

PICTURE = "<|vision_start|><|image_pad|><|vision_end|>"
MARKER = "<__media__>"  # mtmd_default_marker(); the CLI adds the vision start/end tokens itself
PASS_THROUGH = "{%- for message in messages -%}{{ message['content'] }}{%- endfor -%}"
READY = b"experimental CLI"  # its warning, printed once the model and projector are loaded


def generate(command: list[str]) -> tuple[str, float, float, float]:
    """One CLI run: its text, and when the request started, its first text came and its
    last text came (time.time())."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ready = [0.0]
    log = bytearray()

    def read_log() -> None:
        for line in proc.stderr:
            if not ready[0] and READY in line:
                ready[0] = time.time()
            log.extend(line)

    reader = threading.Thread(target=read_log)
    reader.start()
    text, first, last = bytearray(), 0.0, 0.0
    while chunk := proc.stdout.read1(4096):
        if not first and chunk.strip():
            first = time.time()
        last = time.time()
        text.extend(chunk)
    reader.join()
    if proc.wait() != 0 or not ready[0]:
        raise RuntimeError(f"llama-mtmd-cli failed ({proc.returncode}): {log[-2000:].decode(errors='replace')}")
    return text.decode(errors="replace").strip(), ready[0], first, last


def main() -> None:
    out = protocol_stdout()
    ap = worker_args(__doc__)
    ap.add_argument("--cli", type=Path, required=True, help="the llama-mtmd-cli binary")
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--mmproj", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, required=True, help="KV cache tokens")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    spec = json.loads(Path(args.workload).read_text())["requests"]
    requests = load_workload(args.workload)
    common = [str(args.cli), "-m", str(args.gguf), "--mmproj", str(args.mmproj), "-t", str(args.threads),
              "-tb", str(args.threads), "-c", str(args.context), "-ngl", "0", "--temp", "0", "--top-k", "1",
              "--ignore-eos", "--jinja", "--chat-template", PASS_THROUGH]

    def run(message: dict) -> dict:
        if not message.get("sequential"):
            raise ValueError("llama-mtmd-cli serves one request at a time: the one-user workload")
        token_ids, firsts, seconds = [], [], 0.0
        for r in spec:
            images = [arg for path in r["images"] for arg in ("--image", path)]
            text, start, first, last = generate(
                [*common, "-n", str(r["max_tokens"]), "-p", r["prompt"].replace(PICTURE, MARKER), *images])
            ids = tokenizer.encode(text, add_special_tokens=False)[: r["max_tokens"]]
            token_ids.append(ids + [-1] * (r["max_tokens"] - len(ids)))  # the count is -n's
            firsts.append(first - start)
            seconds += last - start
        # first tokens relative to each request's start, and the requests' own times (each
        # CLI start and model load left out) in place of the run's wall time
        return {**summarize(requests, token_ids, 0, firsts), "seconds": seconds}

    serve(out, 0.0, lambda: None, run)


if __name__ == "__main__":
    main()
