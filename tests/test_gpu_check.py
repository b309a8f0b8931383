"""benchmarks/gpu_check.py without a GPU: its dry run (the environment, the wheel list
present and absent, the path set-up, the imports; every GPU step listed with its command)
and the report's form, its argument handling, and the wheel list against pyproject."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

GPU_STEPS = ["triton_kernels", "parity", "serve", "gdn", "throughput", "triton_engine"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The dry run with every listed wheel but the last in its folder (empty files under
    the wheels' names), and one the list does not name."""
    tmp = tmp_path_factory.mktemp("gpu-check")
    wheels = tmp / "wheels"
    wheels.mkdir()
    specs = gpu_check.wheel_list()
    for name, version in specs[:-1]:
        (wheels / f"{gpu_check.normalize(name)}-{version}-py3-none-any.whl").write_bytes(b"")
    (wheels / "stray-1.0-py3-none-any.whl").write_bytes(b"")
    out = tmp / "out"
    result = subprocess.run([sys.executable, "benchmarks/gpu_check.py", str(out), "--dry-run", "--wheels", str(wheels)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    return result, out, specs


def test_the_dry_run_passes_what_needs_no_gpu_and_lists_the_rest(dry_run):
    result, out, specs = dry_run
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True
    assert list(report["steps"]) == ["env", "install", "imports", *GPU_STEPS] == report["plan"]
    for name, section in report["steps"].items():
        assert section["status"] in ("passed", "failed", "skipped"), name
        assert isinstance(section["duration_s"], float) and isinstance(section["details"], dict), name
        assert section["command"] and isinstance(section["command"], list), name
        assert {"title", "needs_gpu", "timeout_s"} <= set(section), name
    assert report["summary"] == {"passed": 3, "failed": 0, "skipped": len(GPU_STEPS), "pending": 0}
    env = report["steps"]["env"]["details"]
    assert env["torch"] and env["cuda_available"] is False and env["packages"]["transformers"]
    install = report["steps"]["install"]["details"]
    assert len(install["present"]) == len(specs) - 1
    assert install["missing"] == ["{}=={}".format(*specs[-1])]
    assert install["not_listed"] == ["stray-1.0-py3-none-any.whl"]
    imports = report["steps"]["imports"]["details"]
    assert imports["problems"] == []
    assert imports["modules"]["vlmserve.kernels.triton_gdn"] == f"ok: {ROOT / 'kernels' / 'triton_gdn.py'}"
    for name in GPU_STEPS:
        section = report["steps"][name]
        assert section["status"] == "skipped" and "dry run" in section["details"]["reason"]
    assert "tests/test_cuda_parity.py" in report["steps"]["parity"]["command"]
    log = (out / "log.txt").read_text()
    assert all(f"[{name}]" in log for name in report["steps"])
    assert "gpu_check: 3 passed, 0 failed, 6 skipped" in result.stdout


def test_the_site_folder_maps_vlmserve_to_the_checkout(dry_run):
    """What the GPU machine's steps import through: the carried wheels' folder first on
    the path, vlmserve's packages (kernels/ as vlmserve.kernels) from the checkout."""
    _, out, _ = dry_run
    site = out / "site"
    probe = ("import sys, importlib.util; print(type(sys.meta_path[0]).__name__, [p for p in sys.path if p][0]); "
             "print(importlib.util.find_spec('vlmserve.kernels').origin)")
    result = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(site)})
    finder, path, origin = result.stdout.split()
    assert (finder, path, origin) == ("_CheckoutFinder", str(site), str(ROOT / "kernels" / "__init__.py"))


def test_arguments(capsys):
    args = gpu_check.parse_args(["out", "--only", "env,imports", "--budget", "100"])
    assert args.only == {"env", "imports"} and args.budget == 100 and not args.dry_run
    for bad in (["out", "--only", "bogus"], ["out", "--budget", "0"], []):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(bad)
        assert e.value.code == 2
    assert "unknown step(s) ['bogus']" in capsys.readouterr().err


def test_the_wheel_list_pins_transformers_as_pyproject_does():
    pins = dict(gpu_check.wheel_list())
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert pins["transformers"] == re.search(r'"transformers==([^"]+)"', pyproject).group(1)
    assert not {"torch", "triton", "numpy"} & set(pins)  # the image's stay
    assert "/.whl/" in (ROOT / ".gitignore").read_text().split()


def test_the_throughput_comparison():
    """gpu_throughput.compare on an engine's figures as run_engine gives them: the graphs'
    and asynchronous scheduling's speed-ups and tokens against the runs without them, the
    ratios against transformers at the largest batch; a failed engine fails the family."""
    import gpu_throughput

    def engine(decode: float, batch: float, one: list[int], firsts: list[list[int]]) -> dict:
        return {"one_user": {"decode_tok_s": decode, "first_tokens": [one]},
                "batches": {16: {"tok_s": batch / 2, "first_tokens": firsts},
                            64: {"tok_s": batch, "first_tokens": firsts}}}

    firsts = [[1, 2, 3], [4, 5, 6]]
    results = {"vlmserve": engine(300.0, 3000.0, [7, 8], firsts),
               "vlmserve sync": engine(150.0, 1500.0, [7, 8], firsts),
               "vlmserve eager": engine(100.0, 2000.0, [7, 8], [[1, 2, 3], [4, 5, 0]]),
               "transformers": engine(50.0, 1000.0, [7, 9], [[1, 9], [0, 5]])}
    got = gpu_throughput.compare(results)
    assert got["cuda_graphs"] == {"same_tokens": True, "batch_agreement": 0.5, "decode_speedup": 3.0,
                                  "batch_speedup": 1.5}
    assert got["async_scheduling"] == {"same_tokens": True, "batch_agreement": 1.0, "decode_speedup": 2.0,
                                       "batch_speedup": 2.0}
    assert got["vs_transformers"] == {"one_user_decode": 6.0, "batch": 3.0, "first_token_agreement": 0.5}
    assert got["ok"] is True
    results["vlmserve sync"]["one_user"]["first_tokens"] = [[7, 9]]
    assert gpu_throughput.compare(results)["ok"] is False
    results["transformers"] = {"error": "WorkerDied: transformers"}
    assert gpu_throughput.compare(results)["ok"] is False


def test_a_batch_runs_whole_in_the_throughput_workers_engine(qwen25_path, tmp_path):
    """The first GPU run's batch of 16 ran at 1.1x one user: the worker's engine was sized
    for its default workload (one request), so the batch ran one request at a time. Sized
    for the largest batch (gpu_throughput passes --max-num-seqs), a batch of 4 runs in about
    the steps of its longest request, not in the sum of theirs."""
    from bench_peers import WORKERS, Worker, write_workload

    for name, n in (("one", 1), ("batch", 4)):
        (tmp_path / name).mkdir()
        write_workload(tmp_path / name, qwen25_path, "one-user" if n == 1 else "batch", n, max_tokens=12)
    command = [sys.executable, str(WORKERS / "vlmserve_worker.py"), "--workload", str(tmp_path / "one" / "workload.json"),
               "--model", qwen25_path, "--dtype", "float32", "--profile", "--max-num-seqs", "4"]
    worker = Worker("vlmserve", command, {**os.environ, "OMP_NUM_THREADS": "2"}, tmp_path / "worker.log")
    try:
        worker.receive()
        run = worker.run(workload=str(tmp_path / "batch" / "workload.json"))
    finally:
        worker.stop()
    tokens = [r["max_tokens"] for r in json.loads((tmp_path / "batch" / "workload.json").read_text())["requests"]]
    assert run["tokens"] == sum(tokens) and run["steps"] < max(tokens) + 8 < sum(tokens), (run["steps"], tokens)
    assert 0 < run["host_seconds"] < sum(run["phases"].values())


def test_the_one_user_figures():
    """gpu_throughput.one_user_figures on a worker's run: decode after the first token, its
    share of the HBM roofline, and (with the worker's --profile) milliseconds a step per
    phase, largest first."""
    import gpu_throughput

    run = {"seconds": 1.0, "tokens": 201, "ttft": [0.2], "first_tokens": [1, 2],
           "phases": {"schedule": 0.05, "runner: sample": 0.4, "runner: forward": 0.25}, "steps": 200}
    got = gpu_throughput.one_user_figures(run, step_bytes=2e9, copy_gbs=4000.0)
    assert got["decode_tok_s"] == 250.0 and got["ttft_s"] == 0.2
    assert got["hbm_share"] == 0.125  # 250 steps/s x 2 GB over 4,000 GB/s
    assert list(got["phase_ms_per_step"].items()) == [("runner: sample", 2.0), ("runner: forward", 1.25),
                                                      ("schedule", 0.25)]
    assert "phase_ms_per_step" not in gpu_throughput.one_user_figures({**run, "steps": 0}, 2e9, 4000.0)
