"""The GPU check: one command that a machine with a GPU runs as a whole, within 8 minutes
on one H100, writing OUTDIR/report.json and OUTDIR/log.txt.

    python benchmarks/gpu_check.py OUTDIR [--dry-run] [--wheels DIR] [--budget SECONDS]
        [--only STEP,STEP] [--skip STEP,STEP]

Steps, in order (each a section of the report: status passed / failed / skipped, its
duration, its details; each in a process of its own with its own timeout, so a failing
or hanging step costs itself alone; the report is rewritten after every step):

1. env: the device, driver, CUDA, torch, Triton and package versions;
2. install: the wheels carried beside the tree (benchmarks/gpu_wheels.sh downloads them
   into .whl/) installed with pip --target into a folder of their own, first on
   PYTHONPATH, keeping the image's torch; a sitecustomize.py there maps vlmserve's
   packages to the checkout (as the editable install does: kernels/ is vlmserve.kernels);
3. imports: everything the engine, the server and the check import, transformers at the
   project's pin, the torch APIs vlmserve calls;
4. triton_kernels: tests/test_triton_kernels.py on CUDA tensors, fp32 and bf16, and the
   real-width cases (VLMSERVE_TEST_DEVICE=cuda);
5. parity: tests/test_cuda_parity.py, every family against transformers on the same GPU
   (fp32 tokens equal, bf16 first tokens agree, CUDA graphs give the eager tokens);
6. serve: `vlmserve serve --device cuda` answering the `openai` client about a picture,
   streamed and not;
7. gdn: the chunked (WY) delta rule against the token recurrence at Qwen3.5's widths, timed;
8. throughput: benchmarks/gpu_throughput.py, vlmserve (graphs and eager) and transformers
   at published widths, one user and a batch, decode against the HBM roofline;
9. triton_engine: tests/test_triton_engine.py on CUDA.

A step gets at most its own timeout and what is left of --budget (450 s by default); a
step with under 20 s left is skipped. `--dry-run` runs here, without a GPU, what needs none (env, the wheel list
present/absent, the path set-up, imports, the argument handling, the report) and
lists the command of every other step; tests/test_gpu_check.py runs it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEEL_LIST = ROOT / "benchmarks" / "gpu_wheels.txt"
STEPS_SCRIPT = ROOT / "benchmarks" / "gpu_steps.py"
MIN_STEP_SECONDS = 20.0
logger = logging.getLogger("gpu_check")


@dataclass
class Step:
    name: str
    title: str
    timeout: float  # seconds, at most
    needs_gpu: bool
    run: Callable[[Check, Step, float], tuple[str, dict[str, Any]]]  # -> status, details
    command: list[str] = field(default_factory=list)  # what it runs (filled in by the plan)


@dataclass
class Check:
    out: Path
    dry_run: bool
    wheels: Path
    site: Path  # where the wheels go, with the sitecustomize.py that sets the path up
    budget: float
    started: float = field(default_factory=time.monotonic)
    report: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def env(self) -> dict[str, str]:
        """The environment of every step's process: the installed folder first on the path,
        the tests on CUDA, nothing fetched from the network."""
        path = [str(self.site)] if (self.site / "sitecustomize.py").exists() else []
        if os.environ.get("PYTHONPATH"):
            path.append(os.environ["PYTHONPATH"])
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLMSERVE_TEST_DEVICE": "cpu" if self.dry_run else "cuda"}
        if path:
            env["PYTHONPATH"] = os.pathsep.join(path)
        if not self.dry_run:
            env.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU
            # no C++ build there: the parity step's CPU reference engine runs pure torch
            env["VLMSERVE_NO_CPU_KERNELS"] = "1"
        return env

    def save(self) -> None:
        self.report["finished"] = now()
        self.report["duration_s"] = round(time.monotonic() - self.started, 1)
        steps = self.report["steps"].values()
        self.report["summary"] = {s: sum(1 for step in steps if step["status"] == s)
                                  for s in ("passed", "failed", "skipped", "pending")}
        (self.out / "report.json").write_text(json.dumps(self.report, indent=1, default=str))


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# -- running a command with a timeout ---------------------------------------------------------
def run_command(command: list[str], env: dict[str, str], timeout: float, log_name: str,
                out: Path) -> tuple[int | None, str]:
    """Runs a command in a session of its own, its output into the log and OUTDIR/<log_name>;
    past the timeout its whole process group gets SIGTERM, then SIGKILL. Returns the exit
    code (None: timed out) and the output's last 6000 characters."""
    logger.info("$ %s", " ".join(command))
    lines: list[str] = []
    with open(out / log_name, "w") as step_log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)

        def pump() -> None:
            for line in proc.stdout:
                lines.append(line)
                step_log.write(line)
                logger.debug("  %s", line.rstrip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code: int | None = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            code = None
            logger.warning("timed out after %.0f s: stopping it", timeout)
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=5)
    return code, "".join(lines)[-6000:]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def python_step(check: Check, step: Step, timeout: float, extra: list[str] = ()) -> tuple[str, dict[str, Any]]:
    """A step of gpu_steps.py: its JSON findings, passed when it exits 0."""
    out_json = check.out / f"{step.name}.json"
    command = [sys.executable, str(STEPS_SCRIPT), step.name, str(out_json), *extra,
               *(["--dry-run"] if check.dry_run else [])]
    step.command = command
    code, tail = run_command(command, check.env(), timeout, f"{step.name}.log", check.out)
    details: dict[str, Any] = {}
    if out_json.exists():
        details = json.loads(out_json.read_text())
    if code is None:
        details["timed_out"] = True
    if code not in (0, 1):
        details["output_tail"] = tail[-3000:]
    return ("passed" if code == 0 else "failed"), details


def pytest_step(test_file: str) -> Callable[[Check, Step, float], tuple[str, dict[str, Any]]]:
    def run(check: Check, step: Step, timeout: float) -> tuple[str, dict[str, Any]]:
        junit = check.out / f"{step.name}-junit.xml"
        step.command = [sys.executable, "-m", "pytest", test_file, "-v", "-p", "no:cacheprovider", "-o",
                        "addopts=-ra", "--junitxml", str(junit)]
        code, tail = run_command(step.command, check.env(), timeout, f"{step.name}.log", check.out)
        # the junit file is written at the end: a run cut short is read from its -v lines
        details = junit_summary(junit) if junit.exists() else verbose_summary(check.out / f"{step.name}.log")
        details["output_tail"] = tail[-2500:]
        if code is None:
            details["timed_out"] = True
        passed = code == 0 and details.get("tests", 0) > details.get("skipped", 0)
        return ("passed" if passed else "failed"), details

    return run


def verbose_summary(log: Path) -> dict[str, Any]:
    """Counts by outcome from pytest -v's lines (a run that was stopped writes no junit)."""
    outcomes = dict(re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", log.read_text(), re.M))
    count = lambda kind: sum(1 for o in outcomes.values() if o == kind)  # noqa: E731
    return {"tests": len(outcomes), "failures": count("FAILED"), "errors": count("ERROR"), "skipped": count("SKIPPED"),
            "failed_tests": [{"test": name, "kind": o.lower()} for name, o in outcomes.items()
                             if o in ("FAILED", "ERROR")],
            "outcomes": outcomes}


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts by outcome, each test's time, and the failures' messages."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failures, times = [], {}
    for case in suite.iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        times[name] = round(float(case.get("time", 0)), 2)
        for kind in ("failure", "error"):
            found = case.find(kind)
            if found is not None:
                failures.append({"test": name, "kind": kind, "message": (found.get("message") or "")[:500],
                                 "text": (found.text or "")[-1500:]})
    return {**counts, "failed_tests": failures, "seconds_per_test": times}


# -- the install step -----------------------------------------------------------------------
def wheel_list() -> list[tuple[str, str]]:
    """(name, version) of every wheel the check carries."""
    specs = []
    for line in WHEEL_LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            specs.append((name.strip(), version.strip()))
    return specs


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheels_present(folder: Path) -> tuple[dict[str, str], list[str], list[str]]:
    """The listed wheels found in the folder (name -> file), those missing, and wheels there
    that the list does not name."""
    files = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    present, missing = {}, []
    for name, version in wheel_list():
        prefix = f"{normalize(name)}-{version}-"
        match = next((f.name for f in files if f.name.lower().startswith(prefix.lower())), None)
        if match:
            present[name] = match
        else:
            missing.append(f"{name}=={version}")
    extra = [f.name for f in files if f.name not in present.values()]
    return present, missing, extra


SITECUSTOMIZE = '''"""Written by benchmarks/gpu_check.py: this folder's packages (the carried wheels) come
before the image's, and vlmserve imports from the checkout as an editable install would
(pyproject's package-dir: kernels/ as vlmserve.kernels, ...), with nothing installed."""
import importlib.abc
import importlib.util
import sys

_FOLDER = {folder!r}
_PACKAGES = {packages!r}
sys.path[:] = [_FOLDER] + [p for p in sys.path if p != _FOLDER]


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        where = _PACKAGES.get(fullname)
        if where is None:
            return None
        return importlib.util.spec_from_file_location(fullname, where + "/__init__.py",
                                                      submodule_search_locations=[where])


sys.meta_path.insert(0, _CheckoutFinder())
'''


def package_dirs() -> dict[str, str]:
    """pyproject.toml's package-dir, as absolute folders."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: str(ROOT / folder) for name, folder in config["tool"]["setuptools"]["package-dir"].items()}


def install(check: Check, step: Step, timeout: float) -> tuple[str, dict[str, Any]]:
    """The carried wheels (not in a dry run: they are for the GPU machine's Python 3.12)
    into one folder, put first on every step's path by the sitecustomize.py written there,
    which also maps vlmserve's packages to the checkout."""
    present, missing, extra = wheels_present(check.wheels)
    files = sorted(check.wheels.glob("*.whl")) if check.wheels.is_dir() else []
    details: dict[str, Any] = {
        "wheels_dir": str(check.wheels), "present": present, "missing": missing, "not_listed": extra,
        "wheels_mib": round(sum(f.stat().st_size for f in files) / 2**20, 1), "site": str(check.site)}
    if check.site.exists():
        shutil.rmtree(check.site)
    check.site.mkdir(parents=True)
    ok = True
    if files and not check.dry_run:
        step.command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(check.site), *map(str, files)]
        code, tail = run_command(step.command, {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}, timeout,
                                 "install.log", check.out)
        if code != 0:
            ok = False
            details["error"] = f"pip exited with {code}"
            details["output_tail"] = tail[-2500:]
    (check.site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(folder=str(check.site),
                                                                      packages=package_dirs()))
    if check.dry_run:
        details["note"] = "dry run: the wheels are listed, not installed (they are built for Python 3.12)"
    elif missing:
        details["note"] = "wheels missing: run `bash benchmarks/gpu_wheels.sh` where pip can download"
    return ("passed" if ok else "failed"), details


# -- the plan -----------------------------------------------------------------------------
def steps(args: argparse.Namespace) -> list[Step]:
    throughput = ["--families", args.families, "--layers", str(args.layers),
                  "--batch-requests", str(args.batch_requests)]
    return [
        Step("env", "device, driver, CUDA, torch, Triton", 60, False, python_step),
        Step("install", "carried wheels first on the path (the image's torch kept), vlmserve from the checkout", 150,
             False, install),
        Step("imports", "engine, server and check imports; transformers at the pin; torch APIs", 90, False,
             python_step),
        Step("triton_kernels", "every Triton kernel on CUDA, fp32 and bf16, real widths", 150, True,
             pytest_step(TEST_FILES["triton_kernels"])),
        Step("parity", "every family against transformers on the same GPU", 180, True,
             pytest_step(TEST_FILES["parity"])),
        Step("serve", "vlmserve serve --device cuda and the openai client, a picture, streamed", 120, True,
             python_step),
        Step("gdn", "chunked delta rule vs the recurrence at Qwen3.5 widths", 90, True, python_step),
        Step("throughput", "published widths: vlmserve (graphs, async, sync, eager) vs transformers, HBM roofline",
             300, True,
             lambda check, step, timeout: python_step(check, step, timeout,
                                                      [*throughput, "--budget", str(max(timeout - 25, 0))])),
        Step("triton_engine", "whole engines on the Triton kernels on CUDA vs transformers", 150, True,
             pytest_step(TEST_FILES["triton_engine"])),
    ]


TEST_FILES = {"triton_kernels": "tests/test_triton_kernels.py", "parity": "tests/test_cuda_parity.py",
              "triton_engine": "tests/test_triton_engine.py"}


def planned_command(check: Check, step: Step) -> list[str]:
    """What a step would run (listed by the dry run for the steps it skips)."""
    if step.name in TEST_FILES:
        return [sys.executable, "-m", "pytest", TEST_FILES[step.name], "-q", "--junitxml",
                str(check.out / f"{step.name}-junit.xml")]
    if step.name == "install":
        return [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(check.site),
                f"{check.wheels}/*.whl"]
    return [sys.executable, str(STEPS_SCRIPT), step.name, str(check.out / f"{step.name}.json")]


def run_steps(check: Check, plan: list[Step], only: set[str], skip: set[str]) -> None:
    check.report["steps"] = {s.name: {"title": s.title, "status": "pending", "needs_gpu": s.needs_gpu,
                                      "timeout_s": s.timeout} for s in plan}
    check.save()
    for step in plan:
        section = check.report["steps"][step.name]
        reason = None
        if (only and step.name not in only) or step.name in skip:
            reason = "not asked for (--only / --skip)"
        elif check.dry_run and step.needs_gpu:
            reason = "dry run: needs a GPU"
        elif check.left() < MIN_STEP_SECONDS:
            reason = f"out of time: {check.left():.0f} s of the {check.budget:.0f} s budget left"
        if reason:
            section.update(status="skipped", duration_s=0.0, details={"reason": reason},
                           command=planned_command(check, step))
            logger.info("[%s] skipped: %s", step.name, reason)
            check.save()
            continue
        timeout = min(step.timeout, check.left())
        logger.info("[%s] %s (timeout %.0f s)", step.name, step.title, timeout)
        t = time.monotonic()
        try:
            status, details = step.run(check, step, timeout)
        except Exception as e:  # noqa: BLE001 - a broken step is a failed step; the others go on
            logger.exception("[%s] broke", step.name)
            status, details = "failed", {"error": f"{type(e).__name__}: {e}"}
        section.update(status=status, duration_s=round(time.monotonic() - t, 1), timeout_s=round(timeout, 1),
                       details=details, command=step.command or planned_command(check, step))
        logger.info("[%s] %s in %.1f s", step.name, status, section["duration_s"])
        check.save()


def one_line(name: str, section: dict[str, Any]) -> str:
    """A step's outcome in a line of the closing table."""
    d = section.get("details", {})
    note = d.get("reason") or d.get("error") or ""
    if "tests" in d:
        note = (f"{d['tests']} tests, {d['failures'] + d['errors']} failed, {d['skipped']} skipped"
                + ("; timed out" if d.get("timed_out") else ""))
    elif name == "env" and "torch" in d:
        note = f"{d.get('device', 'no GPU')}, torch {d['torch']}, CUDA {d['torch_cuda']}, " \
               f"driver {(d.get('nvidia_smi') or {}).get('driver')}, triton {d['packages'].get('triton')}"
    elif name == "install" and "present" in d:
        note = f"{len(d['present'])} wheels present, {len(d['missing'])} missing, {d['wheels_mib']} MiB"
    elif name == "imports" and "problems" in d:
        note = "; ".join(d["problems"])[:150] or "all imported"
    elif name == "gdn" and "cases" in d:
        note = ", ".join(f"{k}: x{v['speedup']}" for k, v in d["cases"].items())
    elif name == "serve" and "text" in d:
        note = f"first chunk {d.get('first_chunk_s')} s, {d.get('completion_tokens')} tokens: {d['text'][:40]!r}"
    elif name == "throughput" and "limits" in d:
        parts = [f"copy {d['limits']['copy_gbs']:.0f} GB/s"]
        for family in ("qwen2_5_vl_3b", "qwen3_5"):
            f = d.get(family, {})
            if "vs_transformers" in f:
                parts.append(f"{family}: x{f['vs_transformers']['one_user_decode']} one user, "
                             f"x{f['vs_transformers']['batch']} batch vs HF")
            for key, what in (("cuda_graphs", "graphs"), ("async_scheduling", "async")):
                if key in f:
                    parts.append(f"{what} x{f[key]['decode_speedup']}")
        note = "; ".join(parts)
    return f"{name:<16}{section['status']:<9}{section.get('duration_s', 0):>7.1f}s  {note}"[:200]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir", type=Path, help="where report.json, log.txt and each step's files go")
    ap.add_argument("--dry-run", action="store_true", help="run only what needs no GPU; list the rest")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried wheels (default: .whl/)")
    ap.add_argument("--site", type=Path, default=None,
                    help="where they are installed (default: /tmp/vlmserve-gpu-site; dry run: OUTDIR/site)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for all the steps together")
    ap.add_argument("--only", default="", help="run only these steps (comma-separated names)")
    ap.add_argument("--skip", default="", help="skip these steps")
    ap.add_argument("--families", default="qwen2_5_vl_3b,qwen3_5", help="throughput: scale checkpoints")
    ap.add_argument("--layers", type=int, default=0,
                    help="throughput: layers kept of each (0: the published depth; widths stay published)")
    ap.add_argument("--batch-requests", default="16,64", help="throughput: the batch workloads' sizes")
    args = ap.parse_args(argv)
    names = {s.name for s in steps(args)}
    args.only = {s.strip() for s in args.only.split(",") if s.strip()}
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if unknown := (args.only | args.skip) - names:
        ap.error(f"unknown step(s) {sorted(unknown)}; steps: {', '.join(s.name for s in steps(args))}")
    sizes = args.batch_requests.split(",")
    if args.budget <= 0 or args.layers < 0 or not all(s.strip().isdigit() and int(s) > 0 for s in sizes):
        ap.error("--budget must be positive, --layers 0 or more, --batch-requests positive sizes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.outdir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    site = (args.site or (out / "site" if args.dry_run else Path("/tmp/vlmserve-gpu-site"))).resolve()
    to_file, to_screen = logging.FileHandler(out / "log.txt", mode="w"), logging.StreamHandler()
    to_screen.setLevel(logging.INFO)  # the steps' output lines (DEBUG) go to the file only
    logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(message)s", datefmt="%H:%M:%S",
                        handlers=[to_file, to_screen])
    check = Check(out, args.dry_run, args.wheels.resolve(), site, args.budget)
    plan = steps(args)
    check.report.update(version=1, command=[sys.executable, *sys.argv], dry_run=args.dry_run, started=now(),
                        budget_s=args.budget, root=str(ROOT), python=sys.version.split()[0],
                        plan=[s.name for s in plan])
    run_steps(check, plan, args.only, args.skip)
    check.save()
    print("\n" + "\n".join(one_line(name, section) for name, section in check.report["steps"].items()))
    summary = check.report["summary"]
    print(f"gpu_check: {summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped "
          f"in {check.report['duration_s']} s; report: {out / 'report.json'}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
