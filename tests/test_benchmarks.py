"""The benchmark scripts still run, on tiny workloads, and print what the README quotes
(the timings themselves are not judged here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlmserve.engine.model_source import SHIPPED_MODEL

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

pytestmark = pytest.mark.slow


def bench(name: str, *args: str, cache: Path) -> str:
    result = subprocess.run([sys.executable, str(BENCHMARKS / name), *args], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "VLMSERVE_BENCH_CACHE": str(cache)})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


CASES = {  # benchmark: tiny arguments, and what its last lines must say
    "bench_caption.py": (["--images", "4", "--repeats", "1", "--max-tokens", "4"], r"ratio: +[0-9.]+x +[0-9.]+x"),
    "bench_startup.py": (["--runs", "1"], r"first answer"),
    "bench_media.py": (["--images", "4", "--threads", "2"], r"images/s"),
    "bench_soak.py": (["--clients", "4", "--minutes", "0.1"], r"back to idle: yes"),
    # each engine started for its own run (the published-widths runs keep them all started), sampling as Qwen2.5's
    # generation_config does
    "bench_peers.py": (["--requests", "4", "--repeats", "1", "--hf-batch", "4", "--engines", "vlmserve,transformers",
                        "--one-at-a-time",
                        "--sampling", "temperature=0.7,top_p=0.8,top_k=20,repetition_penalty=1.05"],
                       r"each engine started for its run, alone in memory[\s\S]*sampled with temperature=0.7, "
                       r"top_p=0.8, top_k=20, repetition_penalty=1.05: tokens not compared[\s\S]*"
                       r"vlmserve / transformers: [0-9.]+x"),
    # published widths, cut to one layer: the checkpoint builder, the one-user workload and the roofline report
    # (the peers' rows are bench_peers.py's above)
    "bench_peers.py:scale": (["--scale", "qwen2_5_vl_3b", "--layers", "1", "--workload", "one-user", "--max-tokens", "24", "--repeats", "1",
                              "--engines", "vlmserve"],
                             r"decode tok/s +of roofline\nvlmserve( +[0-9.]+ +[0-9.]+%){4}"),
    # the same checkpoint packed as AWQ for every engine: vlmserve loads it, transformers is skipped (no CPU kernel)
    "bench_peers.py:awq": (["--scale", "qwen2_5_vl_3b", "--layers", "1", "--workload", "one-user", "--max-tokens", "24", "--repeats", "1",
                            "--engines", "vlmserve,transformers", "--checkpoint-format", "awq"],
                           r"packed as AWQ[^\n]*\n[\s\S]*transformers: skipped[\s\S]*"
                           r"decode tok/s +of roofline\nvlmserve AWQ( +[0-9.]+ +[0-9.]+%){4}"),
    "bench_serving.py": (["--requests", "8", "--clients", "4", "--repeats", "1", "--servers", "vlmserve"],
                         (r"serving / offline: 4 cold [0-9.]+x\n"
                          r"ceiling [^\n]*: 4 cold [0-9]+ tok/s\nvlmserve at 4 clients: [0-9.]+ tok/s")),
    "bench_spec_decode.py": (["--requests", "2", "--streams", "1,2", "--repeats", "1", "--drafts", "2",
                              "--disable-by-batch-size", "1", "--draft-layers", "0,1"],
                             r"\| plain \| 2 \| draft model \(layers 0,1\) k=3 \|"),
    # an FP8 KV cache against bf16's: the shipped model's held-out questions, 3B widths at one layer
    "kv_cache_drift.py": (["--pictures", "2", "--videos", "2", "--layers", "1", "--tokens", "4"],
                          r"fp8 +KV: +[0-9]+ blocks[\s\S]*greedy answers the same: [0-9]+/[0-9]+[\s\S]*"
                          r"fp8 KV [0-9]+ \(2\.00x\)[\s\S]*fp8 KV against bf16 KV: prompt tokens"),
    # a picture evicted from the device cache comes back from the host tier (a tiny full-attention checkpoint)
    "bench_kv_offloading.py": (["--side", "224", "--rounds", "1", "--host-gb", "0.1"],
                               r"recompute +first token: median [0-9.]+ s, cached tokens 0\n"
                               r"host tier +first token: median [0-9.]+ s, cached tokens [1-9][0-9]*\n[\s\S]*"
                               r"host tier / recompute: [0-9.]+x"),
    # two replicas sharing a Mooncake pool against one replica and two without it (a tiny checkpoint)
    "bench_kv_pool.py": (["--pictures", "1", "--side", "224"],
                         r"two replicas, no pool / one replica: cached tokens 0\.0%\n"
                         r"two replicas, one pool / one replica: cached tokens 100\.0%"),
    # the shipped model, bf16 against int8 and int4 at load, taking turns in one process
    "bench_quantized_decode.py": (["--model", str(SHIPPED_MODEL), "--rounds", "2", "--tokens", "5"],
                                  r"round 2: bf16 [0-9.]+ tok/s \(1.00x\), int8 [0-9.]+ tok/s \([0-9.]+x\), int4 [\s\S]*"
                                  r"\nint4 +[0-9.]+ +[0-9.]+ +[0-9.]+-[0-9.]+ +[0-9.]+ +[0-9]+%"),
    "bench_quantized_kernels.py": (["--rows", "1", "--stream-mb", "1", "--repeats", "1"],
                                   r"2560 x 2048 \(q/k/v\)[^\n]*\n.*\n(.*\n)*int4 GEMV +[0-9.]+ \([0-9]+\)\n"
                                   r"int4 dequant +[0-9.]+ \([0-9]+\)"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_benchmark_runs_and_prints_its_result(name, tmp_path_factory):
    args, expected = CASES[name]
    if name == "bench_kv_pool.py":
        from conftest import ensure_libibverbs

        ensure_libibverbs()
    if name in ("bench_kv_pool.py", "bench_kv_offloading.py"):  # the KV connectors take full attention only
        from vlmserve.testing.checkpoints import build_qwen2_5_vl

        args = [*args, "--model", str(build_qwen2_5_vl(tmp_path_factory.mktemp("full-attention"), sliding_window=None))]
    if name == "bench_quantized_kernels.py":
        from vlmserve.kernels.quantized_linear import tiled_kernels_available

        if not tiled_kernels_available():
            pytest.skip("it times vlmserve's int8/int4 kernels, which need AVX512-VNNI or AVX2")
    out = bench(name.split(":")[0], *args, cache=tmp_path_factory.getbasetemp() / "bench-cache")
    assert re.search(expected, out), out


def test_first_token_median_and_p90_over_few_requests():
    """Two requests: the median between them and the p90 the later one (the nearest rank),
    not the other way round."""
    sys.path.insert(0, str(BENCHMARKS / "peer_workers"))  # as the workers run it
    from protocol import Request, summarize

    requests = [Request(prompt="a", images=[], max_tokens=1), Request(prompt="b", images=[], max_tokens=1)]
    assert summarize(requests, [[1], [2]], 0, [13.0, 11.0], run_start=10.0)["ttft"] == [2.0, 3.0]
    times = [10.0 + t for t in range(1, 33)]
    assert summarize(requests * 16, [[1]] * 32, 0, times, run_start=10.0)["ttft"] == [16.5, 29.0]
