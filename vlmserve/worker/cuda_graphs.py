"""CUDA graphs for decode-only steps.

A decode step launches a few kernels per layer on a handful of tokens: on a GPU the
launches, not the math, are most of its time. At engine start the runner captures the
model's forward (embedding lookup included) for batches of 1, 2, 4, 8, 16, 32, ... up to
max_num_seqs, each over static input buffers: token ids, positions, and the kernels'
metadata (per attention group: slot mapping, block tables, query starts, sequence lengths;
for the recurrent layers: state slots). A step whose every request decodes one generated
token (no prompt token, no draft) is rounded up to the nearest captured size: its inputs
are copied into the buffers, the padding rows made inert (KV slot -1 and sequence length
0: nothing written or read; state slot -1: no state touched), and the graph replayed.
Every other step runs eagerly, as does everything with `--enforce-eager`.

A model whose forward reads a value back to the host (the MoE layers count tokens per
expert) cannot be captured: the runner then logs why and stays eager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from vlmserve.kernels.attention import AttentionMetadata
from vlmserve.kernels.gdn import RecurrentMetadata
from vlmserve.models.context import ForwardContext

if TYPE_CHECKING:
    from vlmserve.kernels import KernelTable
    from vlmserve.worker.input_batch import InputBatch
    from vlmserve.worker.step_inputs import LayerPlan, StepInputBuilder, StepInputs

logger = logging.getLogger(__name__)

MAX_CAPTURED = 512  # batches above this run eagerly (their launches are a small share)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: powers of two below max_num_seqs, then max_num_seqs itself
    (at most MAX_CAPTURED)."""
    top = min(max_num_seqs, MAX_CAPTURED)
    sizes = []
    size = 1
    while size < top:
        sizes.append(size)
        size *= 2
    return sizes + [top]


def padded_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds the batch (None: larger than every one)."""
    return next((size for size in sizes if size >= batch), None)


def is_decode_only(query_lens: list[int], num_drafts: list[int], num_computed: list[int],
                   num_prompt_tokens: list[int]) -> bool:
    """Whether a step can replay a graph: every request computes one token, a generated one
    (a prompt's last token may be a picture's placeholder, with embeddings merged in), and
    checks no draft."""
    return (all(q == 1 for q in query_lens) and not any(num_drafts)
            and all(c >= p for c, p in zip(num_computed, num_prompt_tokens)))


@dataclass
class _Buffers:
    """One captured size's static inputs and output."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [3, B]
    slot_mappings: list[torch.Tensor]  # per attention group [B] int64 (-1: padding)
    block_tables: list[torch.Tensor]  # per attention group [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32 (0: padding)
    state_slots: torch.Tensor  # [B] int64 (-1: padding)
    ctx: ForwardContext
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None


@dataclass
class GraphStep:
    """What a replay reads of the host's batch, taken when the step is prepared."""

    size: int  # the captured size it pads to
    seq_lens: np.ndarray  # [n] int32
    slot_mappings: list[np.ndarray]  # per attention group [n] int64
    rows: torch.Tensor  # the batch rows, for the device block tables
    state_slots: np.ndarray | None  # [n] int64 (models with recurrent layers)


@dataclass
class GraphInputs:
    """What capturing and replaying read of the runner: its model and kernels, its layer
    plan (KV caches, attention groups, recurrent layers), its batch and input builder."""

    model: torch.nn.Module
    kernels: KernelTable
    plan: LayerPlan
    input_batch: InputBatch
    inputs: StepInputBuilder
    block_size: int
    device: torch.device


class CudaGraphs:
    """The captured decode steps of one runner's model."""

    def __init__(self, runner: GraphInputs, max_num_seqs: int) -> None:
        self.runner = runner
        self.sizes = capture_sizes(max_num_seqs)
        self.replays = 0  # steps served from a graph (for tests and stats)
        self.buffers: dict[int, _Buffers] = {}

    @classmethod
    def capture(cls, runner: GraphInputs, max_num_seqs: int) -> CudaGraphs | None:
        """The graphs of every size, largest first (sharing one memory pool); None (eager
        steps), with the reason logged, where the model cannot be captured."""
        from vlmserve.kernels import use_kernels
        from vlmserve.models.moe import Experts

        if any(isinstance(module, Experts) for module in runner.model.modules()):
            logger.info("CUDA graphs off: the MoE layers read their expert counts back to the host")
            return None
        if runner.model.tp.size > 1 or runner.model.stage.size > 1:
            # a capture that failed on one rank alone would leave its peers waiting in a
            # collective; NCCL inside captured graphs has not been run here yet
            logger.info("CUDA graphs off: the model is split across ranks (eager steps until tested on GPUs)")
            return None
        graphs = cls(runner, max_num_seqs)
        pool = torch.cuda.graph_pool_handle()
        try:
            with use_kernels(runner.kernels), torch.inference_mode():
                for size in reversed(graphs.sizes):
                    graphs._capture(size, pool)
        except RuntimeError as e:  # a host read in the forward, say: capture is refused
            logger.warning("CUDA graphs off (decode steps run eagerly): capturing the forward failed: %s", e)
            torch.cuda.synchronize()
            return None
        logger.info("CUDA graphs captured for decode batches of %s", ", ".join(map(str, graphs.sizes)))
        return graphs

    def fits(self, step: StepInputs) -> bool:
        states = self.runner.input_batch.states
        return (len(step.rows) <= self.sizes[-1]
                and is_decode_only(step.query_lens, step.num_drafts, step.num_computed,
                                   [states[row].num_prompt_tokens for row in step.rows]))

    def _buffers(self, size: int) -> _Buffers:
        runner = self.runner
        device = runner.device
        attention = runner.plan.attention
        tables = runner.input_batch.block_tables
        query_start = torch.arange(size + 1, dtype=torch.int32, device=device)
        seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        slot_mappings = [torch.full((size,), -1, dtype=torch.int64, device=device) for _ in attention]
        block_tables = [torch.zeros(size, tables[a].shape[1], dtype=torch.int32, device=device)
                        for _, a, _ in attention]
        attn = {}
        for (layers, _, window), slots, table in zip(attention, slot_mappings, block_tables):
            meta = AttentionMetadata(slot_mapping=slots, block_tables=table, query_start=query_start,
                                     seq_lens=seq_lens, sliding_window=int(window or 0),
                                     query_start_host=list(range(size + 1)), seq_lens_host=[1] * size)
            attn.update({layer: meta for layer in layers})
        state_slots = torch.full((size,), -1, dtype=torch.int64, device=device)
        recurrent = {}
        if runner.plan.recurrent_layers:
            meta = RecurrentMetadata(
                query_start=query_start, slots=state_slots, has_state=torch.ones(size, dtype=torch.bool, device=device),
                checkpoints=torch.zeros(size, 0, dtype=torch.int64, device=device), num_decodes=size,
                decode_slots=state_slots, prefill_groups=[], draft_groups=[])
            recurrent = {layer: meta for layer in runner.plan.recurrent_layers}
        ctx = ForwardContext(kv_caches=runner.plan.kv_caches, attn_metadata=attn, layer_state=recurrent)
        return _Buffers(torch.zeros(size, dtype=torch.int64, device=device),
                        torch.zeros(3, size, dtype=torch.int64, device=device), slot_mappings, block_tables, seq_lens,
                        state_slots, ctx)

    def _forward(self, buffers: _Buffers) -> torch.Tensor:
        model = self.runner.model
        return model.forward(model.embed_input_ids(buffers.input_ids), buffers.positions, buffers.ctx)

    def _capture(self, size: int, pool) -> None:
        """Runs the forward once on a side stream (Triton compiles, the allocator warms up),
        then captures it; every row is padding meanwhile, so nothing is written."""
        buffers = self._buffers(size)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(buffers)
        torch.cuda.current_stream().wait_stream(stream)
        buffers.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(buffers.graph, pool=pool):
            buffers.hidden = self._forward(buffers)
        self.buffers[size] = buffers

    def prepare(self, step: StepInputs) -> GraphStep:
        """What the step's replay reads of the host's batch (block tables, state slots)."""
        runner = self.runner
        rows = np.asarray(step.rows, dtype=np.int64)
        pos = np.asarray(step.num_computed, dtype=np.int64)
        block_size = runner.block_size
        slot_mappings = [runner.input_batch.block_tables[a][rows, pos // block_size].astype(np.int64) * block_size
                         + pos % block_size for _, a, _ in runner.plan.attention]
        state_slots = None
        if runner.plan.recurrent_layers:
            states = runner.input_batch.states
            state_slots = np.asarray([states[row].state_slot for row in step.rows], dtype=np.int64)
        return GraphStep(padded_size(len(rows), self.sizes), (pos + 1).astype(np.int32), slot_mappings,
                         runner.inputs.staging.upload("graph.rows", rows), state_slots)

    def replay(self, graph_step: GraphStep, step: StepInputs) -> torch.Tensor:
        """The step's hidden states [n, hidden] from the graph of the nearest size (valid
        until the next replay)."""
        runner = self.runner
        n = len(step.rows)
        buffers = self.buffers[graph_step.size]
        staging = runner.inputs.staging
        buffers.input_ids[:n].copy_(step.input_ids)
        buffers.input_ids[n:].zero_()
        buffers.positions[:, :n].copy_(step.positions)
        buffers.seq_lens[:n].copy_(staging.upload("graph.seq_lens", graph_step.seq_lens))
        buffers.seq_lens[n:].zero_()
        for j, (_, a, _) in enumerate(runner.plan.attention):
            buffers.slot_mappings[j][:n].copy_(staging.upload(f"graph.slots{j}", graph_step.slot_mappings[j]))
            buffers.slot_mappings[j][n:].fill_(-1)
            buffers.block_tables[j][:n].copy_(runner.inputs.device_tables[a][graph_step.rows])
        if graph_step.state_slots is not None:
            buffers.state_slots[:n].copy_(staging.upload("graph.state_slots", graph_step.state_slots))
            buffers.state_slots[n:].fill_(-1)
        buffers.graph.replay()
        self.replays += 1
        return buffers.hidden[:n]
