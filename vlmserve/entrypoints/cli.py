"""The `vlmserve` command: serve (OpenAI API), caption (batch CLI), ui (Gradio), eval."""

from __future__ import annotations

import argparse
import logging
import sys

from vlmserve.engine.args import EngineArgs


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


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineArgs()
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="checkpoint folder (default: the shipped shapes model)")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-n", type=int, default=d.max_n, help="most completions one request may ask for (n)")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="overrides --kv-cache-memory-gb")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--encoder-cache-size", type=int, default=d.encoder_cache_size)
    g.add_argument("--no-weight-packing", action="store_true",
                   help="keep no prepacked copy of the linear weights (saves their memory; batched decode is slower)")
    g.add_argument("--seed", type=int, default=d.seed)
    m = p.add_argument_group("media")
    m.add_argument("--allowed-local-media-path", default=None, help="serve local files under this folder only")
    m.add_argument("--allowed-media-domains", default="", help="comma-separated hosts http(s) media may come from")
    m.add_argument("--limit-mm-per-prompt", type=parse_limits, default=dict(d.limit_mm_per_prompt),
                   help="image=N,video=M")
    m.add_argument("--max-image-mb", type=float, default=d.max_image_bytes / (1 << 20))
    m.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                   help="larger pictures are refused from their header, before decoding")
    m.add_argument("--max-video-mb", type=float, default=d.max_video_bytes / (1 << 20))
    m.add_argument("--media-fetch-timeout", type=float, default=d.media_fetch_timeout, help="seconds, for http(s) media")
    m.add_argument("--processor-cache-gb", type=float, default=d.processor_cache_gb)
    m.add_argument("--image-background", type=parse_rgb, default=d.image_background,
                   help="R,G,B under transparent pixels")


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
    h.add_argument("--engine-process", action="store_true",
                   help="run the engine core in a process of its own (measured: slower on 2 cores, where the two "
                        "processes share the cores; for machines with cores to spare)")
    h.add_argument("--log-level", default="INFO")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=args.model,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_n=args.max_n,
        block_size=args.block_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        encoder_cache_size=args.encoder_cache_size,
        pack_weights=not args.no_weight_packing,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=[h.strip() for h in args.allowed_media_domains.split(",") if h.strip()],
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        max_image_bytes=int(args.max_image_mb * (1 << 20)),
        max_image_pixels=args.max_image_pixels,
        max_video_bytes=int(args.max_video_mb * (1 << 20)),
        media_fetch_timeout=args.media_fetch_timeout,
        processor_cache_gb=args.processor_cache_gb,
        image_background=args.image_background,
        engine_process=getattr(args, "engine_process", False),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmserve", description="Serve vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_http_args(serve, port=8000)

    caption = sub.add_parser("caption", help="caption images and videos into a JSONL file")
    add_engine_args(caption)
    from vlmserve.entrypoints.caption import add_caption_args

    add_caption_args(caption)

    ui = sub.add_parser("ui", help="Gradio chat UI (with the engine in-process, or for --api-base)")
    add_engine_args(ui)
    add_http_args(ui, port=7860)
    ui.add_argument("--api-base", default=None, help="an OpenAI-compatible server to talk to (else: in-process)")
    ui.add_argument("--samples", default=None, help="folder of sample pictures with answers.json")

    evaluate = sub.add_parser("eval", help="score a model on a held-out set of the shapes world")
    from vlmserve.training.evaluate import add_eval_args

    add_eval_args(evaluate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "WARNING" if args.command in ("caption", "eval") else "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        from vlmserve.entrypoints.openai.api_server import run_server

        run_server(args)
    elif args.command == "caption":
        from vlmserve.entrypoints.caption import run_caption

        return run_caption(args)
    elif args.command == "ui":
        from vlmserve.ui.launch import run_ui

        run_ui(args)
    elif args.command == "eval":
        from vlmserve.training.evaluate import run_eval

        return run_eval(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
