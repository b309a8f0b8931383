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
   head names from the two frame pairs' tokens which way the shape moves. A language
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
   and shape value. The shipped model got it in four short runs (README).
AdamW, warm-up then cosine decay, in every phase; fp32 by default (`--bf16` for CPUs with
native bf16 matmul: on AVX2-only CPUs torch's bf16 gemm is ~50x slower than fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import signal
import time
from pathlib import Path

import torch

from vlmserve.training import recipe, shapes

logger = logging.getLogger("vlmserve.train")

BATCH_KINDS = {"caption": 0.35, "short": 0.55, "video": 0.10}
LOOKUP_BATCH_KINDS = {"caption": 0.10, "short": 0.80, "video": 0.10}
CAPTION_BATCH_KINDS = {"caption": 0.60, "short": 0.30, "video": 0.10}
JSON_BATCH_KINDS = {"json": 0.50, "caption": 0.20, "short": 0.20, "video": 0.10}
SHORT_QUESTIONS_PER_PICTURE = 5  # all that question_set gives for 3 objects
LOOKUP_LAYERS = (1, 3)  # the first two full-attention layers; head 0 of each learns to find the object asked about


# -- data ---------------------------------------------------------------------------------
def sample_image_qas(rng: random.Random, kind: str, per_picture: int) -> tuple[object, list[shapes.QA]]:
    scene = shapes.random_scene(rng)
    image = shapes.through_file(shapes.render(scene, rng), rng)
    if kind == "caption":
        return image, [shapes.all_questions(scene, rng)[0]]
    if kind == "json":
        cells = tuple(sorted(s.cell for s in scene.shapes))
        return image, [shapes.QA("json", shapes.JSON_QUESTION, shapes.json_description(scene), cells)]
    return image, shapes.question_set(scene, rng, per_picture)


def sample_video(rng: random.Random) -> tuple[torch.Tensor, object, shapes.Video]:
    """A clip as the processor takes it (frames, 2-fps metadata), half of them through
    an MP4 (H.264, 4:2:0) as an uploaded file would arrive."""
    import numpy as np
    from transformers.video_utils import VideoMetadata

    video = shapes.random_video(rng)
    frames = video.frames
    if rng.random() < 0.5:
        frames = shapes.decode_video(shapes.encode_mp4(frames))
    pixels = torch.from_numpy(np.stack([np.asarray(f) for f in frames])).permute(0, 3, 1, 2)
    n = len(frames)
    meta = VideoMetadata(total_num_frames=n, fps=2, width=frames[0].width, height=frames[0].height,
                         duration=n / 2, frames_indices=list(range(n)))
    return pixels, meta, video


# the processor samples the clip's frames as at inference (recipe.VIDEO_FRAMES of them)
VIDEO_KWARGS = {"do_sample_frames": True, "cap_pixels_per_frame": False}


def make_batch(processor, rng: random.Random, kind: str, size: int, per_picture: int = 1) -> tuple[dict, list[str]]:
    """A batch of one kind. With per_picture > 1, a short-answer sequence asks several
    questions about its picture, one after another (the first right after the picture,
    exactly as in evaluation; the others are extra supervision for the same look-up)."""
    texts, images, videos, metas, kinds, questions = [], [], [], [], [], []
    for _ in range(size):
        if kind == "video":
            pixels, meta, video = sample_video(rng)
            videos.append(pixels)
            metas.append(meta)
            qas, part = [video.question], {"type": "video"}
        else:
            image, qas = sample_image_qas(rng, kind, per_picture)
            images.append(image)
            part = {"type": "image"}
        messages = [{"role": "user", "content": [part, {"type": "text", "text": qas[0].question}]},
                    {"role": "assistant", "content": qas[0].answer}]
        for qa in qas[1:]:
            messages += [{"role": "user", "content": qa.question}, {"role": "assistant", "content": qa.answer}]
        texts.append(processor.apply_chat_template(messages, add_generation_prompt=False))
        kinds.append(qas[0].kind)
        questions.append(qas)
    kwargs = {}
    if videos:
        kwargs = dict(videos=videos, videos_kwargs={"video_metadata": metas, **VIDEO_KWARGS})
    inputs = processor(text=texts, images=images or None, return_tensors="pt", padding=True, **kwargs)
    inputs["labels"], inputs["lookup"] = answer_labels(processor.tokenizer, inputs["input_ids"], questions)
    return dict(inputs), kinds


def answer_spans(ids: list[int], header: list[int], im_end: int) -> list[tuple[int, int]]:
    """[start, end) of every assistant answer, up to and including its <|im_end|>."""
    spans = []
    for i in range(len(ids) - len(header) + 1):
        if ids[i : i + len(header)] == header:
            start = i + len(header)
            spans.append((start, ids.index(im_end, start) + 1))
    return spans


def answer_labels(tokenizer, input_ids: torch.Tensor, questions: list[list[shapes.QA]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels = every assistant answer with its <|im_end|>; the rest -100. And the look-up
    targets, (row, query position, cell): for an answer about one object, the position
    that predicts the answer's first token; for a caption, each position that predicts an
    object's size word ("a| small red circle ..."), with that object's cell."""
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    size_words = set(tokenizer.convert_tokens_to_ids([f"\u0120{z}" for z in shapes.SIZES]))
    labels = torch.full_like(input_ids, -100)
    targets = []
    for row, qas in enumerate(questions):
        ids = input_ids[row].tolist()
        spans = answer_spans(ids, header, im_end)
        assert len(spans) == len(qas)
        for (start, end), qa in zip(spans, qas):
            labels[row, start:end] = input_ids[row, start:end]
            if qa.kind == "caption":
                sizes = [i for i in range(start, end) if ids[i] in size_words]
                assert len(sizes) == len(qa.cells)
                targets += [(row, i - 1, cell) for i, cell in zip(sizes, qa.cells)]
            elif qa.kind == "json":
                targets += [(row, i - 1, cell) for i, cell in json_value_positions(tokenizer, ids, start, end, qa.cells)]
            elif qa.cells:
                targets.append((row, start - 1, qa.cells[0]))
    return labels, torch.tensor(targets, dtype=torch.long).reshape(-1, 3)


def json_value_positions(tokenizer, ids: list[int], start: int, end: int,
                         cells: tuple[int, ...]) -> list[tuple[int, int]]:
    """In a JSON description, the first token of each shape's colour and shape value, with
    that shape's cell: where the model has to look at the picture."""
    text, ends = "", []
    for i in range(start, end):  # the text's length after each token
        text = tokenizer.decode(ids[start : i + 1])
        ends.append(len(text))
    found = []
    for key in ('"color":"', '"shape":"'):
        at = -1
        for cell in cells:
            at = text.index(key, at + 1)
            value = at + len(key)
            token = next(i for i, n in enumerate(ends) if n > value)
            found.append((start + token, cell))
    return found


class BatchStream(torch.utils.data.IterableDataset):
    """Batches for steps start, start+1, ...; each a pure function of (seed, phase, step)."""

    def __init__(self, processor, seed: str, start: int, batch_size: int, mix: dict[str, float]) -> None:
        self.processor, self.seed, self.start, self.batch_size, self.mix = processor, seed, start, batch_size, mix

    def __iter__(self):
        step = self.start
        while True:
            rng = random.Random(f"{self.seed}-{step}")
            kind = rng.choices(list(self.mix), weights=list(self.mix.values()))[0]
            inputs, kinds = make_batch(self.processor, rng, kind, self.batch_size, SHORT_QUESTIONS_PER_PICTURE)
            yield step, kind, inputs, kinds
            step += 1


# -- phase 1: the vision tower ---------------------------------------------------------------
CELL_CLASSES = [(k, c, z) for k in shapes.SHAPES for c in shapes.COLORS for z in shapes.SIZES]


def cell_labels(scene: shapes.Scene) -> list[int]:
    """Per grid cell: 0 if empty, else 1 + the index of (shape, colour, size)."""
    labels = [0] * 9
    for s in scene.shapes:
        labels[s.cell] = 1 + CELL_CLASSES.index((s.kind, s.color, s.size))
    return labels


# in the last third of phase 1, every 4th step is a batch of clips (half as many: the same
# patch count). Not earlier: with clips from the start the tower learnt motion at once but
# small circles and squares worse (94% of pictures right after 900 steps, against 98-100%
# after 700 without clips)
VISION_VIDEO_EVERY = 4
VISION_VIDEO_FROM = 2 / 3


class CellBatches(torch.utils.data.IterableDataset):
    """Phase 1 batches, (step, kind, pixels, grid, labels): pictures with the content of
    each cell, or clips with the way their shape moves."""

    def __init__(self, processor, seed: int, start: int, batch_size: int, steps: int) -> None:
        self.processor, self.seed, self.start, self.batch_size = processor, seed, start, batch_size
        self.video_from = int(VISION_VIDEO_FROM * steps)

    def __iter__(self):
        step = self.start
        while True:
            rng = random.Random(f"{self.seed}-vision-{step}")
            if step >= self.video_from and step % VISION_VIDEO_EVERY == VISION_VIDEO_EVERY - 2:
                clips = [sample_video(rng) for _ in range(max(1, self.batch_size // 2))]
                out = self.processor.video_processor(videos=[c[0] for c in clips], video_metadata=[c[1] for c in clips],
                                                     return_tensors="pt", **VIDEO_KWARGS)
                labels = [shapes.DIRECTIONS.index(c[2].direction) for c in clips]
                yield step, "video", out["pixel_values_videos"], out["video_grid_thw"], torch.tensor(labels)
            else:
                images, labels = [], []
                for _ in range(self.batch_size):
                    scene = shapes.random_scene(rng)
                    images.append(shapes.through_file(shapes.render(scene, rng), rng))
                    labels.append(cell_labels(scene))
                out = self.processor.image_processor(images=images, return_tensors="pt")
                yield step, "image", out["pixel_values"], out["image_grid_thw"], torch.tensor(labels)
            step += 1


class VisionHeads(torch.nn.Module):
    """Phase 1 read-outs of the merged tokens, one per grid cell: what is in the cell and
    which cell the token is (so place is in the features, for "where" and for ordering
    captions); for a clip, from its two frame pairs pooled, which way the shape moves
    (so motion is in the features)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.cell = torch.nn.Linear(dim, len(CELL_CLASSES) + 1 + 9)
        self.direction = torch.nn.Linear(2 * dim, len(shapes.DIRECTIONS))

    def forward(self, model, kind: str, pixels: torch.Tensor, grid: torch.Tensor):
        """Pictures: ([B, 9, classes], [B, 9, 9]); clips: [B, 4]."""
        tokens = model.model.visual(pixels, grid_thw=grid).pooler_output.float()
        if kind == "video":
            pairs = tokens.view(len(grid), -1, 9, tokens.shape[-1]).mean(2)  # [B, frame pairs, dim]
            return self.direction(pairs.flatten(1))
        logits = self.cell(tokens.view(-1, 9, tokens.shape[-1]))
        return logits[..., : len(CELL_CLASSES) + 1], logits[..., len(CELL_CLASSES) + 1 :]


def mixed_precision(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


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


def token_cells() -> torch.Tensor:
    """The cell (0..8) of each of a picture's merged tokens, row by row: one per cell."""
    return torch.arange(9)


# -- teaching the look-up ------------------------------------------------------------------
class LookupProbe:
    """Captures the attention probabilities of the chosen full-attention layers (eager
    attention returns them) for the look-up loss: head 0 is told where to look."""

    def __init__(self, model, layers: tuple[int, ...], image_token_id: int) -> None:
        self.maps: dict[int, torch.Tensor] = {}
        self.image_token_id = image_token_id
        for i in layers:
            attn = model.model.language_model.layers[i].self_attn
            attn.register_forward_hook(lambda _m, _a, out, i=i: self.maps.__setitem__(i, out[1]))

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lookup_loss(list(self.maps.values()), input_ids, targets, self.image_token_id)


def lookup_loss(maps: list[torch.Tensor], input_ids: torch.Tensor, targets: torch.Tensor,
                image_token_id: int) -> torch.Tensor:
    """Mean over targets (row, query, cell) and maps [B, heads, L, L] of -log(head 0's
    attention mass from the query on the image tokens of the cell)."""
    rows, queries, cells = targets.unbind(1)
    # the cell of every image token (raster order within its row), -1 elsewhere
    per_image = token_cells()
    is_image = input_ids == image_token_id
    order = (is_image.long().cumsum(1) - 1).clamp(0, len(per_image) - 1)
    cell_of = torch.where(is_image, per_image[order], -1)
    mask = (cell_of[rows] == cells[:, None]).float()  # [targets, positions]
    losses = [-(m[rows, 0, queries] * mask).sum(-1).clamp(min=1e-6).log().mean() for m in maps]
    return torch.stack(losses).mean()


# -- evaluation during training ------------------------------------------------------------
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


# -- the run ------------------------------------------------------------------------------------
def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash mid-save leaves the previous state intact


def export(model, tokenizer, processor, out: Path, dtype: torch.dtype) -> None:
    """The HF checkpoint: config, safetensors, tokenizer, processor, chat template, generation config."""
    recipe.save_skeleton(out, tokenizer, processor)
    model.to(dtype).save_pretrained(str(out))
    model.float()


def main() -> None:
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
    ap.add_argument("--init-from", type=Path, default=None,
                    help="an exported model to start from, at the JSON phase (how the shipped model got it)")
    ap.add_argument("--lookup-weight", type=float, default=1.0,
                    help="weight of the look-up attention loss (0: answers only)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save-minutes", type=float, default=5.0)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--val-size", type=int, default=64, help="sequences per validation batch (5 batches)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (fast only with native bf16 matmul)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--export-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = recipe.build_tokenizer()
    processor = recipe.build_processor(tokenizer)
    config = recipe.build_config(tokenizer)
    torch.manual_seed(args.seed)
    model = Qwen3_5ForConditionalGeneration(config)
    patch_embed_as_linear(model)
    head = VisionHeads(config.vision_config.out_hidden_size)
    state_path = args.out / "train_state.pt"
    state = {"phase": "vision", "step": 0, "log": []}
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        head.load_state_dict(state["head"])
        logger.info("resumed: %s phase, step %d", state["phase"], state["step"])
    elif args.init_from is not None:
        from safetensors.torch import load_file

        weights = load_file(str(args.init_from / "model.safetensors"))
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        tied = {"lm_head.weight"} if config.get_text_config().tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise ValueError(f"{args.init_from} does not fit this recipe: missing {missing}, unexpected {unexpected}")
        state.update(phase="json", step=0)
        logger.info("starting from %s at the JSON phase", args.init_from)
    (args.out / "run.json").write_text(json.dumps(vars(args), default=str, indent=1))
    logger.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)

    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    def checkpoint(optimizer, phase: str, step: int) -> None:
        save_state(state_path, {"phase": phase, "step": step, "log": state["log"], "model": model.state_dict(),
                                "head": head.state_dict(), "optimizer": optimizer.state_dict()})

    if state["phase"] == "vision":
        params = list(model.model.visual.parameters()) + list(head.parameters())
        optimizer = torch.optim.AdamW(params, lr=args.vision_lr, weight_decay=0.01)
        if "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        step = train_vision(args, model, head, processor, optimizer, state, stop, checkpoint)
        if stop["now"]:
            checkpoint(optimizer, "vision", step)
            logger.info("stopped at vision step %d; rerun the same command to resume", step)
            return
        state.update(phase="vlm", step=0)
        state.pop("optimizer", None)

    # the tower stays as phase 1 left it: no backward through it, more steps in the budget
    model.model.visual.requires_grad_(False)
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.requires_grad], "scale": 1.0}],
                                  lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    phases = [TextPhase("vlm", args.steps, args.lr, args.warmup, BATCH_KINDS),
              TextPhase("lookup", args.lookup_steps, args.lookup_lr, 30, LOOKUP_BATCH_KINDS),
              TextPhase("caption", args.caption_steps, args.caption_lr, 20, CAPTION_BATCH_KINDS),
              TextPhase("json", args.json_steps, args.json_lr, 50, JSON_BATCH_KINDS)]
    # a fixed validation set from a seed training never uses
    val_rng = random.Random(f"validation-{args.seed}")
    val = [make_batch(processor, val_rng, kind, args.val_size) for kind in ("caption", "short", "short", "short", "video")]
    if args.json_steps:  # its own seed: the other five batches stay those of earlier runs
        val.append(make_batch(processor, random.Random(f"validation-json-{args.seed}"), "json", args.val_size))
    probe = None
    if args.lookup_weight > 0:
        # the probe reads attention probabilities; the (frozen) tower keeps sdpa
        model.set_attn_implementation({"text_config": "eager"})
        probe = LookupProbe(model, LOOKUP_LAYERS, config.image_token_id)
    names = [p.name for p in phases]
    for i in range(names.index(state["phase"]), len(phases)):
        step = train_text(args, phases[i], model, processor, optimizer, val, state, stop, checkpoint, probe)
        checkpoint(optimizer, phases[i].name, step)
        if step < phases[i].steps:
            logger.info("stopped at %s step %d; rerun the same command to resume", phases[i].name, step)
            break
        if i + 1 < len(phases):
            state.update(phase=names[i + 1], step=0)
    with open(args.out / "train_log.jsonl", "w") as f:
        for entry in state["log"]:
            f.write(json.dumps(entry) + "\n")
    if not stop["now"]:
        export(model, tokenizer, processor, args.out / "model", getattr(torch, args.export_dtype))
        logger.info("done: exported to %s", args.out / "model")


def train_vision(args, model, head, processor, optimizer, state, stop, checkpoint) -> int:
    import torch.nn.functional as F

    loader = torch.utils.data.DataLoader(CellBatches(processor, args.seed, state["step"], args.vision_batch_size,
                                                     args.vision_steps),
                                         batch_size=None, num_workers=1, prefetch_factor=4)
    model.train()
    last_save, t0, start = time.time(), time.time(), state["step"]
    step = start
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cells = token_cells()
    directions_right = None
    for step, kind, pixels, grid, labels in loader:
        if step >= args.vision_steps or stop["now"]:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.vision_steps, args.vision_lr, 50)
        with mixed_precision(args.bf16):
            out = head(model, kind, pixels, grid)
        entry = {"phase": "vision", "step": step + 1, "kind": kind}
        if kind == "video":
            loss = F.cross_entropy(out.float(), labels)
            directions_right = entry["directions_right"] = round((out.argmax(-1) == labels).float().mean().item(), 3)
        else:
            logits, places = out
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
            loss = loss + 0.2 * F.cross_entropy(places.float().reshape(-1, 9), cells.repeat(len(labels)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        entry.update(loss=round(loss.item(), 4), time=round(time.time() - t0, 1))
        if kind == "image" and (step + 1) % 20 == 0:
            entry["pictures_right"] = round((logits.argmax(-1) == labels).all(-1).float().mean().item(), 3)
            logger.info("vision step %d loss %.3f pictures right %.2f, clips right %s (%.2fs/step)", step + 1,
                        loss.item(), entry["pictures_right"], directions_right, (time.time() - t0) / (step + 1 - start))
        state["log"].append(entry)
        if time.time() - last_save > args.save_minutes * 60:
            checkpoint(optimizer, "vision", step + 1)
            last_save = time.time()
        step += 1
    return step


@dataclasses.dataclass(frozen=True)
class TextPhase:
    """A phase that trains the language model (and merger) on question-answer batches."""

    name: str
    steps: int
    lr: float
    warmup: int
    mix: dict[str, float]  # batch kind -> share of batches


def train_text(args, phase: TextPhase, model, processor, optimizer, val, state, stop, checkpoint,
               probe: LookupProbe | None) -> int:
    # the first text phase keeps the plain seed, so its batches are those of the runs before
    # phases had names (the shipped model's); later phases draw their own
    seed = str(args.seed) if phase.name == "vlm" else f"{args.seed}-{phase.name}"
    loader = torch.utils.data.DataLoader(BatchStream(processor, seed, state["step"], args.batch_size, phase.mix),
                                         batch_size=None, num_workers=1, prefetch_factor=4)
    model.train()
    last_save, t0, start, ema = time.time(), time.time(), state["step"], {}
    step = start
    for step, kind, inputs, _ in loader:
        if step >= phase.steps or stop["now"]:
            break
        lr = lr_at(step, phase.steps, phase.lr, phase.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["scale"]
        targets = inputs.pop("lookup")
        with mixed_precision(args.bf16):
            loss = model(**inputs).loss
        losses = {kind: loss}
        if probe is not None and len(targets):  # video batches have none
            losses["lookup"] = probe.loss(inputs["input_ids"], targets)
            loss = loss + args.lookup_weight * losses["lookup"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
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
            checkpoint(optimizer, phase.name, step + 1)
            last_save = time.time()
        step += 1
    return step


if __name__ == "__main__":
    main()
