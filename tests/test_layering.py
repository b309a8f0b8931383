"""Imports point down: every import in the package (at the top of a module or inside a
function) goes to a module of the same layer or a lower one, and no two modules import
each other, however indirectly, nor do two folders. The layers, lowest first, are the
architecture's."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> the package it installs as (pyproject.toml's package-dir)
FOLDERS = {"vlmserve": "vlmserve", "kernels": "vlmserve.kernels", "models": "vlmserve.models", "ui": "vlmserve.ui"}

LAYERS = [
    # shared vocabulary: settings, errors, what a request asks for
    ["vlmserve", "vlmserve.errors", "vlmserve.sampling_params", "vlmserve.config", "vlmserve.phase_timer", "vlmserve.allocator",
     "vlmserve.multimodal.inputs", "vlmserve.multimodal.hashing", "vlmserve.lora.request", "vlmserve.distributed"],
    # the pieces: kernels, media, grammars, the scheduler and its caches
    ["vlmserve.kernels", "vlmserve.multimodal", "vlmserve.structured_output", "vlmserve.core", "vlmserve.request",
     "vlmserve.outputs", "vlmserve.lora"],
    ["vlmserve.models"],
    ["vlmserve.worker"],
    ["vlmserve.spec_decode"],  # the ways to draft tokens, built by the engine, handed to the runner
    ["vlmserve.engine", "vlmserve.metrics"],
    ["vlmserve.entrypoints", "vlmserve.ui", "vlmserve.training"],
    ["vlmserve.testing"],  # checkpoints for tests and benchmarks: nothing else imports it
]


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules a file imports (a name imported from a package counts as the
    submodule it is, where it is one)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlmserve"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("vlmserve")}
    return out


def layer_of(module: str) -> int:
    best, depth = None, -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = i, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def test_every_import_points_down():
    known = modules()
    graph = {m: imports(p, known) for m, p in known.items()}
    upward = [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
              for m, targets in graph.items() for t in targets if layer_of(t) > layer_of(m)]
    assert not upward, "\n".join(upward)


def assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            assert state.get(target) != 1, f"{what}: " + " -> ".join(path[path.index(target):] + [target])
            if not state.get(target):
                visit(target, path + [target])
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node, [node])


def test_no_import_cycle():
    known = modules()
    assert_acyclic({m: imports(p, known) - {m} for m, p in known.items()}, "import cycle")


def folder_of(module: str) -> str:
    """The package folder a module is in (vlmserve.worker.sampler -> vlmserve.worker); a
    module at the package's top is a folder of its own."""
    return ".".join(module.split(".")[:2])


def test_no_loop_between_folders():
    """Two folders never import each other, even where a layer holds both (the runner and
    the proposers, the engine and its metrics, the entry points and the UI)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for module, path in known.items():
        graph.setdefault(folder_of(module), set()).update(folder_of(t) for t in imports(path, known))
    assert_acyclic({folder: targets - {folder} for folder, targets in graph.items()}, "folders import each other")
