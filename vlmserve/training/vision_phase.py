"""The phases that train the vision tower, with dense labels the generator gives for free.
Phase 1 ("vision"): a linear head names, from each cell's token, what is in the cell and
which cell it is (so place is in the features too); in its last third every 4th batch is of
clips, and a head names from the clip tokens which way the shape moves. The clips phase
("clips", off by default): the tower learns what each token of a clip of 1 to 3 moving
shapes shows (visual_labels.clip_view), beside pictures as in phase 1."""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import torch

from vlmserve.training import recipe, shapes
from vlmserve.training.loop import Run, batch_loader, lr_at, mixed_precision
from vlmserve.training.visual_labels import (CELL_CLASSES, cell_labels, clip_pixels, clip_view, sample_video,
                                             token_cells)

logger = logging.getLogger(__name__)

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


def run_vision_phases(run: Run) -> bool:
    """Phase 1 and the clips phase, from where the state is; False if stopped (saved)."""
    args, state = run.args, run.state
    phases = [VisionPhase("vision", args.vision_steps, args.vision_lr, 50, 1.0),
              VisionPhase("clips", args.clip_steps, args.clip_lr, 30, 4.0)]
    names = [p.name for p in phases]
    for phase in phases[names.index(state["phase"]):] if state["phase"] in names else []:
        if phase.steps:
            # the clips phase's heads are new (phase 1's are not in an exported model)
            optimizer = torch.optim.AdamW([{"params": list(run.model.model.visual.parameters()), "scale": 1.0},
                                           {"params": list(run.head.parameters()), "scale": phase.head_scale}],
                                          lr=phase.lr, weight_decay=0.01)
            if "optimizer" in state:
                optimizer.load_state_dict(state["optimizer"])
            step = train_vision(run, phase, optimizer)
            if run.stop["now"]:
                run.checkpoint(optimizer, phase.name, step)
                logger.info("stopped at %s step %d; rerun the same command to resume", phase.name, step)
                return False
        # after phase 1 the text phases from the first; after an exported model's clips, from JSON
        state.update(phase="clips" if phase.name == "vision" else ("json" if args.init_from else "vlm"), step=0)
        state.pop("optimizer", None)
    return True


def train_vision(run: Run, phase: VisionPhase, optimizer: torch.optim.Optimizer) -> int:
    args, state = run.args, run.state
    batches = (CellBatches(run.processor, args.seed, state["step"], args.vision_batch_size, phase.steps)
               if phase.name == "vision"
               else ClipBatches(run.processor, args.seed, state["step"], args.vision_batch_size))
    loader = batch_loader(batches, run.processor)
    run.model.train()
    last_save, t0, start = time.time(), time.time(), state["step"]
    step = start
    params = [p for group in optimizer.param_groups for p in group["params"]]
    cells = token_cells()
    pictures_right = clips_right = None
    for step, kind, pixels, grid, labels in loader:
        if step >= phase.steps or run.stop["now"]:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, phase.steps, phase.lr, phase.warmup) * group["scale"]
        with mixed_precision(args.bf16):
            out = run.head(run.model, kind, pixels, grid)
        entry = {"phase": phase.name, "step": step + 1, "kind": kind}
        loss = vision_loss(out, kind, labels, cells, entry)
        if kind != "image":
            clips_right = entry["directions_right" if kind == "video" else "tokens_right"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        entry.update(loss=round(loss.item(), 4), time=round(time.time() - t0, 1))
        if kind == "image":
            pictures_right = entry["pictures_right"] = round((out[0].argmax(-1) == labels).all(-1).float().mean().item(), 3)
        if (step + 1) % 20 == 0:
            logger.info("%s step %d loss %.3f pictures right %s, clips right %s (%.2fs/step)", phase.name, step + 1,
                        loss.item(), pictures_right, clips_right, (time.time() - t0) / (step + 1 - start))
        state["log"].append(entry)
        if time.time() - last_save > args.save_minutes * 60:
            run.checkpoint(optimizer, phase.name, step + 1)
            last_save = time.time()
        step += 1
    return step


def vision_loss(out, kind: str, labels, cells: torch.Tensor, entry: dict) -> torch.Tensor:
    """One batch's loss from the heads' output (VisionHeads.forward); for clips, the share
    read right goes into entry."""
    import torch.nn.functional as F

    if kind == "video":
        entry["directions_right"] = round((out.argmax(-1) == labels).float().mean().item(), 3)
        return F.cross_entropy(out.float(), labels)
    logits, places = out[:2]
    if kind == "clip":
        labels, offsets = labels
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss = loss + 0.2 * F.cross_entropy(places.float().reshape(-1, 9), cells.repeat(labels.numel() // 9))
    if kind == "clip":  # where each shape is, and the share of tokens read right
        shown = labels > 0
        loss = loss + 4.0 * F.mse_loss(out[2].float()[shown], offsets[shown])
        entry["tokens_right"] = round((logits.argmax(-1) == labels).float().mean().item(), 3)
    return loss
