"""What every training phase's loop shares: the run (settings, model, state, the Ctrl-C
flag) and its checkpoints, the learning-rate schedule, and autocast."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import multiprocessing
import os
from pathlib import Path

import torch


@dataclasses.dataclass
class Run:
    """A training run as its phases see it. state: the phase and step to go on from, the log
    so far, and (resumed) the saved weights and optimizer; stop["now"]: Ctrl-C or SIGTERM
    came, the phase saves and returns."""

    args: argparse.Namespace
    model: torch.nn.Module
    head: torch.nn.Module  # the tower's read-out heads (vision_phase.VisionHeads)
    processor: object
    state: dict
    stop: dict = dataclasses.field(default_factory=lambda: {"now": False})

    @property
    def state_path(self) -> Path:
        return self.args.out / "train_state.pt"

    def checkpoint(self, optimizer: torch.optim.Optimizer, phase: str, step: int) -> None:
        save_state(self.state_path, {"phase": phase, "step": step, "log": self.state["log"],
                                     "model": self.model.state_dict(), "head": self.head.state_dict(),
                                     "optimizer": optimizer.state_dict()})


def batch_loader(batches: torch.utils.data.IterableDataset, processor) -> torch.utils.data.DataLoader:
    """Batches made ahead in a worker process. The worker starts from a fork server (a clean
    process), not from this one: a phase starts its worker after the last one's ended, and
    a fork of a process with live threads can hang the child (CI saw one phase's worker
    never answer). The server imports what makes the batches once (the processor's parts
    take seconds), so each phase's worker starts at once."""
    parts = [processor, processor.tokenizer, processor.image_processor, getattr(processor, "video_processor", None)]
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([type(batches).__module__] + [type(p).__module__ for p in parts if p is not None])
    return torch.utils.data.DataLoader(batches, batch_size=None, num_workers=1, prefetch_factor=4,
                                       multiprocessing_context=context)


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash mid-save leaves the previous state intact


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def mixed_precision(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
