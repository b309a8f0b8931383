"""Trains the default model on the shapes world with transformers' Qwen3.5.

    python -m vlmserve.training.train --out runs/shapes   # vision 900, VLM 2000, look-up 300, captions 200 steps; seed 1

Resumable: the state (weights, optimizer, step) is saved every few minutes and on
Ctrl-C; rerunning the same command continues from it. Batches are a pure function of
(seed, phase, step), so a resumed run sees exactly the data an uninterrupted one would.

The model sees a picture as 3 x 3 tokens, one per grid cell (recipe.py). Five phases:
1. Vision. The vision tower (and its merger) learns to see first, with dense labels the
   generator gives for free: a linear head names, from each cell's token, what is in
   the cell (empty, or one of 3 shapes x 6 colours x 2 sizes) and which cell it is, so
   place is in the features too. In the last third, every 4th batch is of clips, and a
   head names from the clip tokens which way the shape moves. A language
   model trained from scratch on top of a random tower takes thousands of steps to
   start looking at the picture at all; this phase makes that unnecessary.
2. Vision-language, the tower frozen (no backward through it: more steps fit). Batches
   are homogeneous — captions, short answers, videos, drawn 35% / 55% / 10% — which
   keeps padding low. A caption or video sequence asks one question, exactly as in
   evaluation. A short-answer sequence asks up to 5 about its picture, one after the
   other, chosen so that no answer gives another away (the count, one question per
   object, an absent colour-shape pair): the first question is in the evaluation
   format, the rest are extra supervision of the same look-up for a few more tokens.
   Loss on answer tokens, plus a look-up loss (`LookupProbe`): trained on answers
   alone, an earlier model never learned to find the object a question names (with two
   objects it answered about either one, at chance, after 2400 steps), so head 0 of
   the first two full-attention layers is told where to look — at the object's cell,
   from the position that predicts the answer (or, in a caption, each object's size
   word).
3. Look-up. A second, shorter cosine cycle at a lower peak with mostly short-answer
   batches, for the questions that name one object.
4. Captions. A last short cycle with mostly captions, which have the most to get
   right (up to three objects, each size, colour, shape and place).
5. JSON (`--json-steps`, off by default; `--init-from` an exported model starts here):
   the caption's content as compact JSON, with look-up targets at each shape's colour
   and shape value. The shipped model got it in four short runs (docs/models.md).
6. Video captions, in two parts, off by default (after JSON). Clips (`--clip-steps`): the
   tower alone learns what each token of a clip of 1 to 3 moving shapes shows (one frame
   a token: the kind, colour and size of the shape covering the most of its cell, and
   where in the cell its centre is). Then (`--video-caption-steps`) clips of 1 to 3
   shapes, each moving its own way, described ("a small green square moving up and ...");
   the direction question also asked about one shape of such clips; the picture skills
   kept in the mix.
AdamW, warm-up then cosine decay, in every phase; fp32 by default (`--bf16` for CPUs with
native bf16 matmul: on AVX2-only CPUs torch's bf16 gemm is ~50x slower than fp32).
The tower's phases are vision_phase.py's, the text phases text_phases.py's (their batches:
batches.py; the look-up loss: lookup.py); here the command line, the run's start and the export.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
from pathlib import Path

import torch

from vlmserve.training import recipe
from vlmserve.training.loop import Run
from vlmserve.training.text_phases import run_text_phases
from vlmserve.training.vision_phase import VisionHeads, run_vision_phases

logger = logging.getLogger("vlmserve.train")


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = recipe.build_tokenizer()
    processor = recipe.build_processor(tokenizer)
    config = recipe.build_config(tokenizer)
    run = start_run(args, processor, config)
    if not run_vision_phases(run):
        return
    run_text_phases(run, config)
    with open(args.out / "train_log.jsonl", "w") as f:
        for entry in run.state["log"]:
            f.write(json.dumps(entry) + "\n")
    if not run.stop["now"]:
        export(run.model, tokenizer, processor, args.out / "model", getattr(torch, args.export_dtype))
        logger.info("done: exported to %s", args.out / "model")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vision-steps", type=int, default=900)
    ap.add_argument("--vision-batch-size", type=int, default=64)
    ap.add_argument("--vision-lr", type=float, default=2e-3)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--lookup-steps", type=int, default=300)
    ap.add_argument("--lookup-lr", type=float, default=5e-4)
    ap.add_argument("--caption-steps", type=int, default=200)
    ap.add_argument("--caption-lr", type=float, default=3e-4)
    ap.add_argument("--json-steps", type=int, default=0, help="phase 5 (JSON answers); the shipped model: see README")
    ap.add_argument("--json-lr", type=float, default=3e-4)
    ap.add_argument("--clip-steps", type=int, default=0,
                    help="the clips phase: the tower learns what each token of a clip of moving shapes shows "
                         "(after phase 1, or first with --init-from); the shipped model: see docs/models.md")
    ap.add_argument("--clip-lr", type=float, default=5e-4)
    ap.add_argument("--video-caption-steps", type=int, default=0,
                    help="phase 6 (video captions); the shipped model: see docs/models.md")
    ap.add_argument("--video-caption-lr", type=float, default=3e-4)
    ap.add_argument("--init-from", type=Path, default=None,
                    help="an exported model to start from, at the phases after the captions' (JSON, video captions: "
                         "how the shipped model got them)")
    ap.add_argument("--lookup-weight", type=float, default=1.0,
                    help="weight of the look-up attention loss (0: answers only)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save-minutes", type=float, default=5.0)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--val-size", type=int, default=64, help="sequences per validation batch (5 batches)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (fast only with native bf16 matmul)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--export-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    return ap.parse_args()


def start_run(args: argparse.Namespace, processor, config) -> Run:
    """A new model, resumed from the saved state or started from --init-from (or from scratch);
    Ctrl-C and SIGTERM from then on stop it at the next step, saved."""
    from transformers import Qwen3_5ForConditionalGeneration

    torch.manual_seed(args.seed)
    model = Qwen3_5ForConditionalGeneration(config)
    patch_embed_as_linear(model)
    head = VisionHeads(config.vision_config.out_hidden_size)
    run = Run(args, model, head, processor, {"phase": "vision", "step": 0, "log": []})
    if run.state_path.exists():
        run.state = torch.load(run.state_path, weights_only=False)
        model.load_state_dict(run.state["model"])
        head.load_state_dict(run.state["head"])
        logger.info("resumed: %s phase, step %d", run.state["phase"], run.state["step"])
    elif args.init_from is not None:
        load_exported(model, config, args.init_from)
        run.state.update(phase="clips" if args.clip_steps else "json", step=0)
        logger.info("starting from %s at the %s phase", args.init_from, run.state["phase"])
    (args.out / "run.json").write_text(json.dumps(vars(args), default=str, indent=1))
    logger.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    signal.signal(signal.SIGINT, lambda *_: run.stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: run.stop.update(now=True))
    return run


def load_exported(model, config, path: Path) -> None:
    """An exported model's weights (the phases after the captions' start from one)."""
    from safetensors.torch import load_file

    weights = recipe.one_frame_patches(load_file(str(path / "model.safetensors")))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    tied = {"lm_head.weight"} if config.get_text_config().tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{path} does not fit this recipe: missing {missing}, unexpected {unexpected}")


def patch_embed_as_linear(model) -> None:
    """The tower's patch embedding is a Conv3d whose kernel equals its stride: one matmul
    per patch. On CPU, autocast runs its bf16 backward through a naive slow_conv3d gemm
    (tens of seconds per step); the same product as a linear layer takes milliseconds.
    Only this instance's forward changes; the weights and the exported checkpoint don't."""
    embed = model.model.visual.patch_embed

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        weight = embed.proj.weight
        flat = hidden_states.reshape(-1, weight[0].numel()).to(weight.dtype)
        return torch.nn.functional.linear(flat, weight.reshape(weight.shape[0], -1), embed.proj.bias)

    embed.forward = forward


def export(model, tokenizer, processor, out: Path, dtype: torch.dtype) -> None:
    """The HF checkpoint: config, safetensors, tokenizer, processor, chat template, generation config."""
    recipe.save_skeleton(out, tokenizer, processor)
    model.to(dtype).save_pretrained(str(out))
    model.float()


if __name__ == "__main__":
    main()
