"""The vision encoder's side of the runner: which media a step encodes (read from the
batch when the step is prepared), running the vision tower on them in calls of a bounded
size (on the device, in order), and the encoder cache of their outputs by mm_hash, whose
entries the scheduler tells the runner to drop.

A model split across ranks encodes data-parallel (vLLM's `--mm-encoder-tp-mode data`):
every rank holds the whole tower, encodes a share of the step's media, and the outputs are
gathered, so every rank's cache holds them all."""

from __future__ import annotations

import torch

from vlmserve.core.sched_output import SchedulerOutput
from vlmserve.distributed import TensorParallel
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.worker.input_batch import InputBatch
from vlmserve.worker.lora_slots import LoRASlots
from vlmserve.worker.proposer import Proposer

# Embedding tokens of media one call of the vision tower takes (an item larger than this
# alone): a step's encoder budget (8,192 by default) in one call held every block's
# activations for up to 32k patches at once, 0.76 GB of temporaries at Qwen2.5-VL-3B's
# widths that the process keeps (allocator.py); at 2,048 (8,192 patches) its
# matmuls still take hundreds of rows a pass and run as fast.
ENCODER_CALL_TOKENS = 2048

EncoderWork = list[tuple[LoRARequest | None, list[MultiModalFeature]]]


def encoder_calls(features: list[MultiModalFeature], limit: int) -> list[list[MultiModalFeature]]:
    """The items in order, in groups of at most `limit` embedding tokens (an item larger
    than that in a group of its own)."""
    groups: list[list[MultiModalFeature]] = []
    size = 0
    for feature in features:
        if not groups or size + feature.length > limit:
            groups.append([])
            size = 0
        groups[-1].append(feature)
        size += feature.length
    return groups


def share_of_rank(features: list[MultiModalFeature], tp: TensorParallel) -> list[int]:
    """The items (indices) a rank encodes: the largest first, each to the rank with the
    fewest tokens so far (every rank computes the same split)."""
    loads = [0] * tp.size
    mine = []
    for i in sorted(range(len(features)), key=lambda i: (-features[i].length, i)):
        rank = loads.index(min(loads))
        loads[rank] += features[i].length
        if rank == tp.rank:
            mine.append(i)
    return sorted(mine)


def gather_outputs(features: list[MultiModalFeature], tp: TensorParallel, outputs: list[torch.Tensor],
                   like: torch.Tensor) -> list[torch.Tensor]:
    """Every item's output on every rank, from each rank's own (`like`: the dtype and
    device): the ranks' rows padded to the longest share and gathered."""
    owners = [share_of_rank(features, TensorParallel(rank, tp.size)) for rank in range(tp.size)]
    rows = [sum(features[i].length for i in share) for share in owners]
    width = tp.all_gather(like.new_tensor([outputs[0].shape[1] if outputs else 0], dtype=torch.long), 0).max()
    block = like.new_zeros(max(rows), int(width))
    if outputs:
        block[: rows[tp.rank]] = torch.cat(outputs)
    blocks = tp.all_gather(block, 0).split(max(rows))
    gathered: list[torch.Tensor] = [like] * len(features)
    for share, rank_block in zip(owners, blocks):
        start = 0
        for i in share:  # copies: the cache frees each item on its own
            gathered[i] = rank_block[start : start + features[i].length].clone()
            start += features[i].length
    return gathered


class EncoderRunner:
    def __init__(self, model: torch.nn.Module, lora: LoRASlots | None, proposer: Proposer | None) -> None:
        self.model = model
        self.lora = lora
        self.proposer = proposer  # a draft model reads the same pictures with its own encoder
        self.cache: dict[str, torch.Tensor] = {}  # mm_hash -> the encoder's output
        self.runs = 0  # media items this rank encoded, for tests and stats

    def plan(self, so: SchedulerOutput, batch: InputBatch) -> EncoderWork:
        """The media the step encodes, once each, grouped by the adapter they are encoded
        under (an adapter of the vision tower encodes a request's media its own way: their
        hashes say so, the front end tagged them). Split into pipeline stages, the first
        one's ranks alone encode: the others take its hidden states."""
        if not self.model.stage.is_first:
            return []
        todo = {}
        for rid, input_ids in so.scheduled_encoder_inputs.items():
            state = batch.states[batch.index_of[rid]]
            lora = state.lora_request if self.lora and state.lora_request and \
                self.lora.touches_vision(state.lora_request) else None
            for i in input_ids:
                feature = state.mm_features[i]
                if feature.mm_hash not in so.encoder_outputs_loaded:  # another engine encoded it
                    todo.setdefault(feature.mm_hash, (feature, lora))
        by_adapter: dict[LoRARequest | None, list[MultiModalFeature]] = {}
        for feature, lora in todo.values():
            by_adapter.setdefault(lora, []).append(feature)
        return list(by_adapter.items())

    def run(self, work: EncoderWork, freed: list[str], loaded: dict[str, torch.Tensor] | None = None
            ) -> dict[str, torch.Tensor]:
        """Drops the outputs the scheduler let go, takes those another engine made (loaded),
        then encodes the step's media (device work); returns the outputs it made."""
        for mm_hash in freed:
            self.cache.pop(mm_hash, None)
        if self.proposer:
            self.proposer.free_encoder_outputs(freed)
        self.cache.update(loaded or {})
        made: dict[str, torch.Tensor] = {}
        for lora, features in work:
            made.update(self._encode(features, lora))
        return made

    def clear(self) -> None:
        self.cache.clear()
        if self.proposer:
            self.proposer.clear_encoder_cache()

    def _encode(self, features: list[MultiModalFeature], lora: LoRARequest | None) -> dict[str, torch.Tensor]:
        if self.lora:
            self.lora.set_all(lora)
        tp = self.model.tp
        mine = share_of_rank(features, tp) if tp.size > 1 else list(range(len(features)))
        try:
            outputs = [out for group in encoder_calls([features[i] for i in mine], ENCODER_CALL_TOKENS)
                       for out in self.model.embed_multimodal(group)]
        finally:
            if self.lora:
                self.lora.clear()
        if tp.size > 1:
            like = self.model.model.language_model.embed_tokens.weight
            outputs = gather_outputs(features, tp, outputs, like)
        for feature, out in zip(features, outputs):
            if out.shape[0] != feature.length:
                raise RuntimeError(
                    f"encoder gave {out.shape[0]} embeddings for {feature.length} placeholders of {feature.mm_hash}"
                )
            self.cache[feature.mm_hash] = out
        if self.proposer:
            for group in encoder_calls(features, ENCODER_CALL_TOKENS):
                self.proposer.encode(group)
        self.runs += len(mine)
        return {f.mm_hash: self.cache[f.mm_hash] for f in features}
