"""What the model's visual tokens show, as training teaches the tower to read them: a
picture's 3 x 3 cells (one token each), and a clip's tokens (recipe.VIDEO_SLOTS x 9: the
frames of one patch, cell), sampled as the processor takes them."""

from __future__ import annotations

import dataclasses
import random

import torch

from vlmserve.training import recipe, shapes

# a cell's classes past 0 (empty): one per (shape, colour, size)
CELL_CLASSES = [(k, c, z) for k in shapes.SHAPES for c in shapes.COLORS for z in shapes.SIZES]
# the processor samples the clip's frames as at inference (recipe.VIDEO_FRAMES of them)
VIDEO_KWARGS = {"do_sample_frames": True, "cap_pixels_per_frame": False}
MIN_COVER = 0.2  # share of a shape's area (over the slot's frames) that makes it what a token shows


def cell_labels(scene: shapes.Scene) -> list[int]:
    """Per grid cell: 0 if empty, else 1 + the index of (shape, colour, size)."""
    labels = [0] * 9
    for s in scene.shapes:
        labels[s.cell] = 1 + CELL_CLASSES.index((s.kind, s.color, s.size))
    return labels


def token_cells() -> torch.Tensor:
    """The cell (0..8) of each of a picture's merged tokens, row by row: one per cell."""
    return torch.arange(9)


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


def clip_pixels(processor, clips: list) -> dict:
    """The video processor's output for sampled clips ((frames, metadata, video) each)."""
    return processor.video_processor(videos=[c[0] for c in clips], video_metadata=[c[1] for c in clips],
                                     return_tensors="pt", **VIDEO_KWARGS)


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
