"""The `vlmserve` command: serve (OpenAI API), caption (batch CLI), ui (Gradio), eval."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import inspect
import json
import logging
import re
import sys
import types as types_module
import typing
from collections.abc import Callable
from typing import Any

from vlmserve import envs
from vlmserve.engine.args import EngineArgs
from vlmserve.errors import ConfigError


TOOL_CALL_PARSERS = ("hermes", "qwen3_xml", "qwen3_coder")  # openai/tool_parsers.py's


def parse_limits(text: str) -> dict[str, int]:
    """'image=4,video=1' -> {'image': 4, 'video': 1}"""
    limits = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in ("image", "video") or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected image=N,video=M, got {text!r}")
        limits[key.strip()] = int(value)
    return limits


def parse_rgb(text: str) -> tuple[int, int, int]:
    """'255,255,255' -> (255, 255, 255)"""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) <= 255 for p in parts):
        raise argparse.ArgumentTypeError(f"expected R,G,B with each 0-255, got {text!r}")
    return tuple(int(p) for p in parts)


def parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def parse_list(text: str) -> list[str]:
    """'a, b' -> ['a', 'b']"""
    return [item.strip() for item in text.split(",") if item.strip()]


# how a field's type reads from the command line, beyond int, float and str
_PARSERS: dict[Any, Callable[[str], Any]] = {
    list[str]: parse_list,
    dict[str, int]: parse_limits,
    tuple[int, int, int]: parse_rgb,
    dict[str, Any]: parse_json_object,
}


def field_help() -> dict[str, str]:
    """Each EngineArgs field's comment: on its line, or in the comment lines just above it."""
    helps, pending = {}, []
    for line in inspect.getsource(EngineArgs).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# "))
            continue
        match = re.match(r"(\w+): [^=]+=.*?(?:#\s*(.*))?$", stripped)
        if match:
            helps[match.group(1)] = " ".join(pending + ([match.group(2)] if match.group(2) else []))
        pending = []
    return helps


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field: --field-name, its type and default, its comment as
    help; booleans as --name / --no-name."""
    group = p.add_argument_group("engine")
    types = typing.get_type_hints(EngineArgs)
    helps = field_help()
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kind = types[f.name]
        shown = helps.get(f.name, "")
        if default is not None and "default" not in shown:
            shown = f"{shown} (default: %(default)s)".strip()
        optional = typing.get_origin(kind) in (typing.Union, types_module.UnionType) and type(None) in typing.get_args(kind)
        base = next(a for a in typing.get_args(kind) if a is not type(None)) if optional else kind
        if base is bool:  # --x / --no-x (an optional one left out: its default, worked out later)
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=helps.get(f.name))
            continue
        group.add_argument(flag, type=_PARSERS.get(base, base), default=default, help=shown)


def add_http_args(p: argparse.ArgumentParser, port: int) -> None:
    """The HTTP server's flags (serve, and ui with the engine in-process)."""
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument("--port", type=int, default=port)
    h.add_argument("--served-model-name", default=None)
    h.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1")
    h.add_argument("--max-pending-requests", type=int, default=512,
                   help="completions in flight (n counts n times); beyond this, answer 429")
    h.add_argument("--max-request-mb", type=int, default=64, help="larger request bodies get 413")
    h.add_argument("--max-connections", type=int, default=1024, help="requests served at once; beyond, 503")
    h.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers")
    h.add_argument("--body-timeout", type=float, default=60.0, help="seconds a request may take to send its body")
    h.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on Ctrl-C / SIGTERM, seconds requests in flight get to finish before they are cut off")
    h.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="hermes",
                   help="the format of the model's tool calls (vLLM's names): hermes, JSON in <tool_call> blocks "
                        "(Qwen2.5-VL, Qwen3-VL); qwen3_xml or qwen3_coder, <tool_call><function=...><parameter=...> "
                        "(Qwen3-Coder, Qwen3.5)")
    h.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as vLLM's command lines give it: tool_choice auto is always served")
    h.add_argument("--log-level", default="INFO")
    h.add_argument("--metrics-names", choices=["vllm", "vlmserve"], default="vllm",
                   help="the names of the /metrics series vLLM also has: vLLM's (vllm:*, with model_name and engine "
                        "labels: its dashboards work unchanged) or vlmserve's earlier ones (vlmserve:*)")


def parse_lora_module(text: str) -> tuple[str, str]:
    """'name=path', or vLLM's JSON form '{"name": ..., "path": ...}' -> (name, path)"""
    if text.lstrip().startswith("{"):
        value = parse_json_object(text)
        if not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str):
            raise argparse.ArgumentTypeError(f"expected {{\"name\": ..., \"path\": ...}}, got {text!r}")
        return value["name"], value["path"]
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name.strip(), path.strip()


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """Adapters served under names of their own (serve, ui)."""
    group = p.add_argument_group("LoRA adapters")
    group.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=[], metavar="NAME=PATH",
                       help="PEFT LoRA adapters, each served under its name (a request's \"model\"); turns on "
                            "--enable-lora")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       default=envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING,
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with "
                            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as in vLLM); turns on --enable-lora")
    group.add_argument("--allowed-lora-path", default=None,
                       help="adapters loaded at run time must lie under this folder (default: any folder the "
                            "server can read, which the log warns about)")


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """Engine replicas on Ray Serve behind this server (serve --replicas N)."""
    r = p.add_argument_group("replicas (Ray Serve)")
    r.add_argument("--replicas", type=int, default=0,
                   help="engine replicas on a Ray cluster behind this server (0: one engine in this process)")
    r.add_argument("--prefill-replicas", type=int, default=0,
                   help="replicas that only compute prompts (prefill/decode disaggregation): each request's prompt "
                        "goes to one of them first, then the request to one of the --replicas, which reads the "
                        "prompt's KV and pictures from the pool of --kv-transfer-config (needed)")
    r.add_argument("--ray-address", default=None, help="a Ray cluster to join (default: start a local one)")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each replica asks for (and its threads)")
    r.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs each replica asks for")
    r.add_argument("--min-replicas", type=int, default=1, help="autoscaling: fewest replicas")
    r.add_argument("--max-replicas", type=int, default=0, help="autoscaling: most replicas (0: no autoscaling)")
    r.add_argument("--target-ongoing-requests", type=float, default=8.0,
                   help="autoscaling: requests in flight per replica it aims at")
    r.add_argument("--router", choices=["affinity", "default"], default="affinity",
                   help="affinity: to the replica holding the request's prefix and pictures; default: Ray Serve's")
    r.add_argument("--affinity-imbalance", type=int, default=4,
                   help="requests in flight a replica may have over the least loaded one and still be chosen for "
                        "affinity")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmserve", description="Serve vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_http_args(serve, port=8000)
    add_lora_args(serve)
    add_replica_args(serve)

    caption = sub.add_parser("caption", help="caption images and videos into a JSONL file")
    add_engine_args(caption)
    from vlmserve.entrypoints.caption import add_caption_args

    add_caption_args(caption)

    embed = sub.add_parser("embed", help="embed pictures, videos and texts into a Parquet or .npy file")
    add_engine_args(embed)
    from vlmserve.entrypoints.embed import add_embed_args

    add_embed_args(embed)

    ui = sub.add_parser("ui", help="Gradio chat UI (with the engine in-process, or for --api-base)")
    add_engine_args(ui)
    add_http_args(ui, port=7860)
    add_lora_args(ui)
    ui.add_argument("--api-base", default=None, help="an OpenAI-compatible server to talk to (else: in-process)")
    ui.add_argument("--samples", default=None, help="folder of sample pictures with answers.json")

    evaluate = sub.add_parser("eval", help="score a model on a held-out set of the shapes world")
    from vlmserve.training.evaluate import add_eval_args

    add_eval_args(evaluate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING" if args.command in ("caption", "embed", "eval")
                                      else "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_command(args)
    except ConfigError as e:  # the user's settings: one line, not a traceback
        print(f"vlmserve: {e}", file=sys.stderr)
        return 2


def check_engine_settings(args: argparse.Namespace) -> None:
    """The engine's settings and its model, checked before the engine's modules are
    imported (seconds of torch and transformers): a wrong one is one line at once. The
    engine checks them again where it loads (on Ray, another host)."""
    from vlmserve.engine.model_source import resolve_model_path

    EngineArgs.from_namespace(args).check_settings()
    resolve_model_path(args.model, args.revision, args.download_dir)


def builds_engine(args: argparse.Namespace) -> bool:
    return args.command in ("serve", "caption", "embed") or (args.command == "ui" and not args.api_base)


def run_command(args: argparse.Namespace) -> int:
    if builds_engine(args):
        check_engine_settings(args)
    # The imports (torch, transformers: a million objects that live as long as the process)
    # with the cyclic GC off: its full collections would walk them again and again (1.1 s of
    # a 6 s start); then frozen, out of its reach for good (as vLLM freezes after start-up).
    gc.disable()
    try:
        command = import_command(args)
    finally:
        gc.freeze()
        gc.enable()
    return command(args) or 0


def import_command(args: argparse.Namespace) -> Callable[[argparse.Namespace], int | None]:
    """The command's function, with the modules it runs on imported."""
    if builds_engine(args) and not getattr(args, "ray", None):  # (on Ray, the workers build the engines)
        importlib.import_module("vlmserve.engine.llm_engine")  # which the command imports when it builds one
    if args.command == "serve":
        from vlmserve.entrypoints.openai.api_server import run_server

        return run_server
    if args.command == "embed":
        from vlmserve.entrypoints.embed import run_embed

        return run_embed
    if args.command == "caption":
        from vlmserve.entrypoints.caption import run_caption

        return run_caption
    if args.command == "ui":
        from vlmserve.entrypoints.chat_ui import run_ui

        return run_ui
    from vlmserve.training.evaluate import run_eval

    return run_eval


if __name__ == "__main__":
    sys.exit(main())
