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
# video captions: clips of 1 to 3 moving shapes, described; the direction question also on
# such clips; the picture skills kept in the mix
VIDEO_CAPTION_BATCH_KINDS = {"video_caption": 0.40, "video_moving": 0.10, "video": 0.10, "caption": 0.15,
                             "short": 0.15, "json": 0.10}
VIDEO_KINDS = ("video", "video_moving", "video_caption")
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


def sample_video(rng: random.Random, moving: bool = False) -> tuple[torch.Tensor, object, shapes.Video]:
    """A clip as the processor takes it (frames, 2-fps metadata), half of them through
    an MP4 (H.264, 4:2:0) as an uploaded file would arrive. moving: 1 to 3 shapes moving
    (else the one shape of the direction question)."""
    import numpy as np
    from transformers.video_utils import VideoMetadata

    video = shapes.random_moving_video(rng) if moving else shapes.random_video(rng)
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
        if kind in VIDEO_KINDS:
            pixels, meta, video = sample_video(rng, moving=kind != "video")
            videos.append(pixels)
            metas.append(meta)
            tokens = clip_view(video, meta.total_num_frames).tokens
            if kind == "video_caption":
                qa = dataclasses.replace(video.caption, cells=tuple(t for move in tokens for t in move))
            else:
                i = rng.randrange(len(video.moves)) if kind == "video_moving" else 0
                qa = dataclasses.replace(video.direction_question(i), cells=tokens[i])
            qas, part = [qa], {"type": "video"}
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


@dataclasses.dataclass
class ClipView:
    """What each of a clip's recipe.VIDEO_SLOTS x 9 tokens (slot: the frames of one patch,
    cell) shows, as the tower is taught to read it: per token, the shape covering most of
    its cell over the slot's frames (0: none; else 1 + its class) and that shape's centre
    at the slot's mean time relative to the cell's centre, in cells; per moving shape, its
    main token in each slot (comparing them is how the model tells which way it moves)."""

    content: list[list[int]]  # [slot][cell]
    offsets: list[list[tuple[float, float]]]  # [slot][cell]
    tokens: list[tuple[int, ...]]  # per move: slot s's token + 9 s, for each slot


MIN_COVER = 0.2  # share of a shape's area (over the slot's frames) that makes it what a token shows


def clip_view(video: shapes.Video, num_frames: int) -> ClipView:
    import numpy as np

    times = np.linspace(0, num_frames - 1, recipe.VIDEO_FRAMES).round() / (num_frames - 1)
    per = recipe.FRAMES_PER_TOKEN
    slots = [times[k : k + per] for k in range(0, len(times), per)]
    content = [[0] * 9 for _ in slots]
    offsets = [[(0.0, 0.0)] * 9 for _ in slots]
    best = [[0.0] * 9 for _ in slots]
    tokens = []
    for move in video.moves:
        cell_px = move._cell_px
        label = 1 + CELL_CLASSES.index((move.shape.kind, move.shape.color, move.shape.size))
        main = []
        for p, frame_times in enumerate(slots):
            cover = [0.0] * 9
            for t in frame_times:
                x, y, side = move.at(float(t)).box
                for cell in range(9):
                    r, c = divmod(cell, 3)
                    w = max(0.0, min(x + side, (c + 1) * cell_px) - max(x, c * cell_px))
                    h = max(0.0, min(y + side, (r + 1) * cell_px) - max(y, r * cell_px))
                    cover[cell] += w * h / (side * side * len(frame_times))
            x, y, side = move.at(float(frame_times.mean())).box
            for cell in range(9):
                if cover[cell] >= MIN_COVER and cover[cell] > best[p][cell]:
                    r, c = divmod(cell, 3)
                    best[p][cell], content[p][cell] = cover[cell], label
                    offsets[p][cell] = ((x + side / 2) / cell_px - c - 0.5, (y + side / 2) / cell_px - r - 0.5)
            main.append(p * 9 + max(range(9), key=cover.__getitem__))
        tokens.append(tuple(main))
    return ClipView(content, offsets, tokens)


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
    targets, (row, query position, visual token: a picture's cell, or a clip's slot x 9 +
    cell): for an answer about one object, the position that predicts the answer's first
    token; for a caption, each position that predicts an object's size word ("a| small red
    circle ..."), with that object's cell; for a clip, the shape's token in each slot,
    from the positions that predict its direction (and in a caption its size word too)."""
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
            elif qa.kind == "video_caption":
                sizes = [i for i in range(start, end) if ids[i] in size_words]
                moves = positions_after(tokenizer, ids, start, end, "moving ")
                slots = recipe.VIDEO_SLOTS
                assert len(sizes) == len(moves) == len(qa.cells) // slots
                for k, (size, move) in enumerate(zip(sizes, moves)):
                    targets += [(row, at - 1, token) for at in (size, move)
                                for token in qa.cells[slots * k : slots * (k + 1)]]
            elif qa.kind == "direction":
                targets += [(row, start - 1, token) for token in qa.cells]
            elif qa.kind == "json":
                targets += [(row, i - 1, cell) for i, cell in json_value_positions(tokenizer, ids, start, end, qa.cells)]
            elif qa.cells:
                targets.append((row, start - 1, qa.cells[0]))
    return labels, torch.tensor(targets, dtype=torch.long).reshape(-1, 3)


def json_value_positions(tokenizer, ids: list[int], start: int, end: int,
                         cells: tuple[int, ...]) -> list[tuple[int, int]]:
    """In a JSON description, the first token of each shape's colour and shape value, with
    that shape's cell: where the model has to look at the picture."""
    return [(token, cell) for key in ('"color":"', '"shape":"')
            for token, cell in zip(positions_after(tokenizer, ids, start, end, key), cells)]


def positions_after(tokenizer, ids: list[int], start: int, end: int, key: str) -> list[int]:
    """The first token of the text right after each occurrence of key in the answer
    ids[start:end] (the small vocabulary splits words, so this goes by characters)."""
    text, ends = "", []
    for i in range(start, end):  # the text's length after each token
        text = tokenizer.decode(ids[start : i + 1])
        ends.append(len(text))
    found, at = [], text.find(key)
    while at >= 0:
        found.append(start + next(i for i, n in enumerate(ends) if n > at + len(key)))
        at = text.find(key, at + 1)
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


def picture_cell_batch(processor, rng: random.Random, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n pictures' pixels, grids, and the content of each cell (the tower's dense labels)."""
    images, labels = [], []
    for _ in range(n):
        scene = shapes.random_scene(rng)
        images.append(shapes.through_file(shapes.render(scene, rng), rng))
        labels.append(cell_labels(scene))
    out = processor.image_processor(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"], torch.tensor(labels)


def clip_pixels(processor, clips: list) -> dict:
    """The video processor's output for sampled clips ((frames, metadata, video) each)."""
    return processor.video_processor(videos=[c[0] for c in clips], video_metadata=[c[1] for c in clips],
                                     return_tensors="pt", **VIDEO_KWARGS)


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
                out = clip_pixels(self.processor, clips)
                labels = [shapes.DIRECTIONS.index(c[2].moves[0].direction) for c in clips]
                yield step, "video", out["pixel_values_videos"], out["video_grid_thw"], torch.tensor(labels)
            else:
                yield step, "image", *picture_cell_batch(self.processor, rng, self.batch_size)
            step += 1


class ClipBatches(torch.utils.data.IterableDataset):
    """Batches of the clips phase, (step, kind, pixels, grid, labels): clips of 1 to 3
    moving shapes with, per slot and cell, what the token shows and where (clip_view:
    content [B, slots, 9], offsets [B, slots, 9, 2]), and pictures with the content of each
    cell, as in phase 1."""

    def __init__(self, processor, seed: int, start: int, batch_size: int) -> None:
        self.processor, self.seed, self.start, self.batch_size = processor, seed, start, batch_size

    def __iter__(self):
        step = self.start
        while True:
            rng = random.Random(f"{self.seed}-clips-{step}")
            if step % 2:
                clips = [sample_video(rng, moving=True) for _ in range(max(1, self.batch_size // 2))]
                out = clip_pixels(self.processor, clips)
                views = [clip_view(c[2], c[1].total_num_frames) for c in clips]
                labels = (torch.tensor([v.content for v in views]), torch.tensor([v.offsets for v in views]))
                yield step, "clip", out["pixel_values_videos"], out["video_grid_thw"], labels
            else:
                yield step, "image", *picture_cell_batch(self.processor, rng, self.batch_size)
            step += 1


class VisionHeads(torch.nn.Module):
    """Phase 1 read-outs of the merged tokens, one per grid cell: what is in the cell and
    which cell the token is (so place is in the features, for "where" and for ordering
    captions); for a clip, from its slots pooled, which way the shape moves
    (so motion is in the features)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.cell = torch.nn.Linear(dim, len(CELL_CLASSES) + 1 + 9)
        self.direction = torch.nn.Linear(recipe.VIDEO_SLOTS * dim, len(shapes.DIRECTIONS))
        self.offset = torch.nn.Linear(dim, 2)  # clips: where the shape is within the token's cell

    def forward(self, model, kind: str, pixels: torch.Tensor, grid: torch.Tensor):
        """Pictures: ([B, 9, classes], [B, 9, 9]); clips, per slot ("clip"): the same
        with a slot dimension, [B, slots, 9, ...], and offsets [B, slots, 9, 2]; or their
        direction ("video"): [B, 4]."""
        tokens = model.model.visual(pixels, grid_thw=grid).pooler_output.float()
        if kind == "video":
            slots = tokens.view(len(grid), -1, 9, tokens.shape[-1]).mean(2)  # [B, slots, dim]
            return self.direction(slots.flatten(1))
        if kind == "clip":
            tokens = tokens.view(len(grid), -1, 9, tokens.shape[-1])
            logits = self.cell(tokens)
            return logits[..., : len(CELL_CLASSES) + 1], logits[..., len(CELL_CLASSES) + 1 :], self.offset(tokens)
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

    def __init__(self, model, layers: tuple[int, ...], visual_token_ids: tuple[int, ...]) -> None:
        self.maps: dict[int, torch.Tensor] = {}
        self.visual_token_ids = visual_token_ids
        for i in layers:
            attn = model.model.language_model.layers[i].self_attn
            attn.register_forward_hook(lambda _m, _a, out, i=i: self.maps.__setitem__(i, out[1]))

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lookup_loss(list(self.maps.values()), input_ids, targets, self.visual_token_ids)


def lookup_loss(maps: list[torch.Tensor], input_ids: torch.Tensor, targets: torch.Tensor,
                visual_token_ids: tuple[int, ...]) -> torch.Tensor:
    """Mean over targets (row, query, visual token) and maps [B, heads, L, L] of -log(head
    0's attention mass from the query on that token. A row holds one picture or clip, so
    its n-th visual token is the picture's cell n, or the clip's slot n // 9, cell n % 9."""
    rows, queries, tokens = targets.unbind(1)
    is_visual = torch.isin(input_ids, torch.tensor(visual_token_ids))
    ordinal = torch.where(is_visual, is_visual.long().cumsum(1) - 1, -1)
    mask = (ordinal[rows] == tokens[:, None]).float()  # [targets, positions]
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

        weights = recipe.one_frame_patches(load_file(str(args.init_from / "model.safetensors")))
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        tied = {"lm_head.weight"} if config.get_text_config().tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise ValueError(f"{args.init_from} does not fit this recipe: missing {missing}, unexpected {unexpected}")
        state.update(phase="clips" if args.clip_steps else "json", step=0)
        logger.info("starting from %s at the %s phase", args.init_from, state["phase"])
    (args.out / "run.json").write_text(json.dumps(vars(args), default=str, indent=1))
    logger.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)

    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    def checkpoint(optimizer, phase: str, step: int) -> None:
        save_state(state_path, {"phase": phase, "step": step, "log": state["log"], "model": model.state_dict(),
                                "head": head.state_dict(), "optimizer": optimizer.state_dict()})

    vision_phases = [VisionPhase("vision", args.vision_steps, args.vision_lr, 50, 1.0),
                     VisionPhase("clips", args.clip_steps, args.clip_lr, 30, 4.0)]
    for phase in vision_phases[[p.name for p in vision_phases].index(state["phase"]):] \
            if state["phase"] in ("vision", "clips") else []:
        if phase.steps:
            # the clips phase's heads are new (phase 1's are not in an exported model)
            optimizer = torch.optim.AdamW([{"params": list(model.model.visual.parameters()), "scale": 1.0},
                                           {"params": list(head.parameters()), "scale": phase.head_scale}],
                                          lr=phase.lr, weight_decay=0.01)
            if "optimizer" in state:
                optimizer.load_state_dict(state["optimizer"])
            step = train_vision(args, phase, model, head, processor, optimizer, state, stop, checkpoint)
            if stop["now"]:
                checkpoint(optimizer, phase.name, step)
                logger.info("stopped at %s step %d; rerun the same command to resume", phase.name, step)
                return
        # after phase 1 the text phases from the first; after an exported model's clips, from JSON
        state.update(phase="clips" if phase.name == "vision" else ("json" if args.init_from else "vlm"), step=0)
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
              TextPhase("json", args.json_steps, args.json_lr, 50, JSON_BATCH_KINDS),
              TextPhase("video_caption", args.video_caption_steps, args.video_caption_lr, 50,
                        VIDEO_CAPTION_BATCH_KINDS)]
    # a fixed validation set from a seed training never uses
    val_rng = random.Random(f"validation-{args.seed}")
    val = [make_batch(processor, val_rng, kind, args.val_size) for kind in ("caption", "short", "short", "short", "video")]
    for kind, steps in (("json", args.json_steps), ("video_caption", args.video_caption_steps)):
        if steps:  # its own seed: the other batches stay those of earlier runs
            val.append(make_batch(processor, random.Random(f"validation-{kind}-{args.seed}"), kind, args.val_size))
    probe = None
    if args.lookup_weight > 0:
        # the probe reads attention probabilities; the (frozen) tower keeps sdpa
        model.set_attn_implementation({"text_config": "eager"})
        probe = LookupProbe(model, LOOKUP_LAYERS, (config.image_token_id, config.video_token_id))
    names = [p.name for p in phases]
    for i in range(names.index(state["phase"]), len(phases)):
        if not phases[i].steps:
            continue
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


@dataclasses.dataclass(frozen=True)
class VisionPhase:
    """A phase that trains the tower (and the read-out heads) on what each token shows:
    phase 1 ("vision": pictures, then clips' direction too) or the clips phase ("clips":
    clips' content per slot and cell, beside pictures)."""

    name: str
    steps: int
    lr: float
    warmup: int
    head_scale: float  # the heads' learning rate over the tower's


def train_vision(args, phase: VisionPhase, model, head, processor, optimizer, state, stop, checkpoint) -> int:
    import torch.nn.functional as F

    batches = (CellBatches(processor, args.seed, state["step"], args.vision_batch_size, phase.steps)
               if phase.name == "vision" else ClipBatches(processor, args.seed, state["step"], args.vision_batch_size))
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=1, prefetch_factor=4)
    model.train()
    last_save, t0, start = time.time(), time.time(), state["step"]
    step = start
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cells = token_cells()
    pictures_right = clips_right = None
    for step, kind, pixels, grid, labels in loader:
        if step >= phase.steps or stop["now"]:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, phase.steps, phase.lr, phase.warmup) * group["scale"]
        with mixed_precision(args.bf16):
            out = head(model, kind, pixels, grid)
        entry = {"phase": phase.name, "step": step + 1, "kind": kind}
        if kind == "video":
            loss = F.cross_entropy(out.float(), labels)
            clips_right = entry["directions_right"] = round((out.argmax(-1) == labels).float().mean().item(), 3)
        else:
            logits, places = out[:2]
            if kind == "clip":
                labels, offsets = labels
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
            loss = loss + 0.2 * F.cross_entropy(places.float().reshape(-1, 9), cells.repeat(labels.numel() // 9))
            if kind == "clip":  # where each shape is, and the share of tokens read right
                shown = labels > 0
                loss = loss + 4.0 * F.mse_loss(out[2].float()[shown], offsets[shown])
                clips_right = entry["tokens_right"] = round((logits.argmax(-1) == labels).float().mean().item(), 3)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        entry.update(loss=round(loss.item(), 4), time=round(time.time() - t0, 1))
        if kind == "image":
            pictures_right = entry["pictures_right"] = round((logits.argmax(-1) == labels).all(-1).float().mean().item(), 3)
        if (step + 1) % 20 == 0:
            logger.info("%s step %d loss %.3f pictures right %s, clips right %s (%.2fs/step)", phase.name, step + 1,
                        loss.item(), pictures_right, clips_right, (time.time() - t0) / (step + 1 - start))
        state["log"].append(entry)
        if time.time() - last_save > args.save_minutes * 60:
            checkpoint(optimizer, phase.name, step + 1)
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
        if probe is not None and len(targets):
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
