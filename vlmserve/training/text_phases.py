"""The phases that train the language model (and merger) on question-answer batches, the
tower frozen (no backward through it: more steps fit). Phase 2 ("vlm"): captions, short
answers and videos, each batch of one kind, with the look-up loss (lookup.py). Then shorter
cosine cycles at lower peaks, each with its own mix: look-up (mostly short answers),
captions, JSON (`--json-steps`) and video captions (`--video-caption-steps`)."""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import torch

from vlmserve.training.batches import BatchStream, make_batch
from vlmserve.training.lookup import LOOKUP_LAYERS, LookupProbe
from vlmserve.training.loop import Run, batch_loader, lr_at, mixed_precision

logger = logging.getLogger(__name__)

BATCH_KINDS = {"caption": 0.35, "short": 0.55, "video": 0.10}
LOOKUP_BATCH_KINDS = {"caption": 0.10, "short": 0.80, "video": 0.10}
CAPTION_BATCH_KINDS = {"caption": 0.60, "short": 0.30, "video": 0.10}
JSON_BATCH_KINDS = {"json": 0.50, "caption": 0.20, "short": 0.20, "video": 0.10}
# video captions: clips of 1 to 3 moving shapes, described; the direction question also on
# such clips; the picture skills kept in the mix
VIDEO_CAPTION_BATCH_KINDS = {"video_caption": 0.40, "video_moving": 0.10, "video": 0.10, "caption": 0.15,
                             "short": 0.15, "json": 0.10}


@dataclasses.dataclass(frozen=True)
class TextPhase:
    """A phase that trains the language model (and merger) on question-answer batches."""

    name: str
    steps: int
    lr: float
    warmup: int
    mix: dict[str, float]  # batch kind -> share of batches


@torch.no_grad()
def exact_match_by_kind(model, batches: list[tuple[dict, list[str]]], bf16: bool = False) -> dict[str, float]:
    """Per kind (of a sequence's first question), the share of sequences whose every answer
    token is the argmax given the correct prefix — exactly when greedy decoding reproduces
    all of its answers."""
    model.eval()
    hits: dict[str, list[bool]] = {}
    for inputs, kinds in batches:
        labels = inputs["labels"]
        with mixed_precision(bf16):
            logits = model(**{k: v for k, v in inputs.items() if k not in ("labels", "lookup")}).logits
        pred = logits[:, :-1].argmax(-1)
        target = labels[:, 1:]
        ok = ((pred == target) | (target == -100)).all(dim=1)
        for kind, good in zip(kinds, ok.tolist()):
            hits.setdefault(kind, []).append(good)
    model.train()
    return {k: sum(v) / len(v) for k, v in sorted(hits.items())}


def text_phases(args) -> list[TextPhase]:
    return [TextPhase("vlm", args.steps, args.lr, args.warmup, BATCH_KINDS),
            TextPhase("lookup", args.lookup_steps, args.lookup_lr, 30, LOOKUP_BATCH_KINDS),
            TextPhase("caption", args.caption_steps, args.caption_lr, 20, CAPTION_BATCH_KINDS),
            TextPhase("json", args.json_steps, args.json_lr, 50, JSON_BATCH_KINDS),
            TextPhase("video_caption", args.video_caption_steps, args.video_caption_lr, 50,
                      VIDEO_CAPTION_BATCH_KINDS)]


def validation_batches(processor, args) -> list[tuple[dict, list[str]]]:
    """A fixed validation set from a seed training never uses."""
    val_rng = random.Random(f"validation-{args.seed}")
    val = [make_batch(processor, val_rng, kind, args.val_size) for kind in ("caption", "short", "short", "short", "video")]
    for kind, steps in (("json", args.json_steps), ("video_caption", args.video_caption_steps)):
        if steps:  # its own seed: the other batches stay those of earlier runs
            val.append(make_batch(processor, random.Random(f"validation-{kind}-{args.seed}"), kind, args.val_size))
    return val


def run_text_phases(run: Run, config) -> None:
    """The text phases, from where the state is; each ends with a checkpoint. Stopped, the
    rest wait for the next run."""
    args, state, model = run.args, run.state, run.model
    # the tower stays as phase 1 left it: no backward through it, more steps in the budget
    model.model.visual.requires_grad_(False)
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.requires_grad], "scale": 1.0}],
                                  lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    phases = text_phases(args)
    val = validation_batches(run.processor, args)
    probe = None
    if args.lookup_weight > 0:
        # the probe reads attention probabilities; the (frozen) tower keeps sdpa
        model.set_attn_implementation({"text_config": "eager"})
        probe = LookupProbe(model, LOOKUP_LAYERS, (config.image_token_id, config.video_token_id))
    names = [p.name for p in phases]
    for i in range(names.index(state["phase"]), len(phases)):
        if not phases[i].steps:
            continue
        step = train_text(run, phases[i], optimizer, val, probe)
        run.checkpoint(optimizer, phases[i].name, step)
        if step < phases[i].steps:
            logger.info("stopped at %s step %d; rerun the same command to resume", phases[i].name, step)
            break
        if i + 1 < len(phases):
            state.update(phase=names[i + 1], step=0)


def train_text(run: Run, phase: TextPhase, optimizer: torch.optim.Optimizer, val: list,
               probe: LookupProbe | None) -> int:
    args, state, model = run.args, run.state, run.model
    # the first text phase keeps the plain seed, so its batches are those of the runs before
    # phases had names (the shipped model's); later phases draw their own
    seed = str(args.seed) if phase.name == "vlm" else f"{args.seed}-{phase.name}"
    loader = batch_loader(BatchStream(run.processor, seed, state["step"], args.batch_size, phase.mix), run.processor)
    model.train()
    last_save, t0, start, ema = time.time(), time.time(), state["step"], {}
    step = start
    for step, kind, inputs, _ in loader:
        if step >= phase.steps or run.stop["now"]:
            break
        lr = lr_at(step, phase.steps, phase.lr, phase.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["scale"]
        losses = text_step(run, optimizer, probe, kind, inputs)
        for name, value in losses.items():
            ema[name] = value.item() if name not in ema else 0.95 * ema[name] + 0.05 * value.item()
        entry = {"phase": phase.name, "step": step + 1, "kind": kind, "loss": round(losses[kind].item(), 4),
                 "time": round(time.time() - t0, 1)}
        if "lookup" in losses:
            entry["lookup_loss"] = round(losses["lookup"].item(), 4)
        if (step + 1) % args.eval_every == 0 or step + 1 == phase.steps:
            entry["exact_match"] = exact_match_by_kind(model, val, args.bf16)
            logger.info("%s step %d exact match %s", phase.name, step + 1, entry["exact_match"])
        state["log"].append(entry)
        if (step + 1) % 20 == 0:
            logger.info("%s step %d lr %.2e loss %s (%.2fs/step)", phase.name, step + 1, lr,
                        {k: round(v, 3) for k, v in ema.items()}, (time.time() - t0) / (step + 1 - start))
        if time.time() - last_save > args.save_minutes * 60:
            run.checkpoint(optimizer, phase.name, step + 1)
            last_save = time.time()
        step += 1
    return step


def text_step(run: Run, optimizer: torch.optim.Optimizer, probe: LookupProbe | None, kind: str,
              inputs: dict) -> dict[str, torch.Tensor]:
    """One optimizer step on a batch; its losses: the answers' (under the batch's kind) and
    the look-up's."""
    targets = inputs.pop("lookup")
    with mixed_precision(run.args.bf16):
        loss = run.model(**inputs).loss
    losses = {kind: loss}
    if probe is not None and len(targets):
        losses["lookup"] = probe.loss(inputs["input_ids"], targets)
        loss = loss + run.args.lookup_weight * losses["lookup"]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return losses
