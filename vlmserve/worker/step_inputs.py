"""A step's model inputs, built from the scheduler's decision and the persistent batch:
token ids and M-RoPE positions in execution order, the pictures' embeddings merged in,
and per layer the metadata the kernels read (block tables, slot mappings, recurrent-state
slots). The runner builds the target model's inputs with it; a draft model builds its own
from the same pieces."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vlmserve.core.sched_output import SchedulerOutput
from vlmserve.kernels.attention import build_attention_metadata
from vlmserve.kernels.gdn import build_recurrent_metadata
from vlmserve.models.context import ForwardContext
from vlmserve.worker.input_batch import CachedRequestState, InputBatch
from vlmserve.worker.staging import Staging


@dataclass
class LayerPlan:
    """How one model's layers read the KV memory: attention layers in sets that share one
    of the batch's block tables (and a sliding window), recurrent layers by state slot."""

    name: str  # names the step's staged inputs of this model
    kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]
    attention: list[tuple[tuple[int, ...], int, int | None]]  # (layer ids, block table index, window)
    recurrent_layers: list[int]


@dataclass
class StepInputs:
    """The flattened inputs of one step, requests in execution order."""

    req_ids: list[str]
    rows: list[int]
    num_computed: list[int]
    query_lens: list[int]
    num_drafts: list[int]  # draft tokens at the end of each request's query
    checkpoints: list[list[int]]  # hybrid models: each request's state checkpoint slots (with drafts)
    propose_drafts: bool  # the scheduler could check drafts proposed now
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [3, tokens]


class StepInputBuilder:
    def __init__(self, batch: InputBatch, staging: Staging, block_size: int, device: torch.device,
                 bidirectional_media: bool) -> None:
        self.batch = batch
        self.staging = staging
        self.block_size = block_size
        self.device = device
        self.bidirectional_media = bidirectional_media
        # block tables as the kernels read them: on the CPU a view of the batch's arrays;
        # on a GPU a device copy whose changed rows are uploaded before each step
        self.device_tables = [torch.from_numpy(t).to(device) for t in batch.block_tables]

    def prepare(self, so: SchedulerOutput) -> StepInputs:
        batch = self.batch
        for rid, drafts in so.scheduled_draft_tokens.items():  # after the last token, not counted in it
            row = batch.index_of[rid]
            batch.token_ids[row, batch.num_tokens[row] : batch.num_tokens[row] + len(drafts)] = drafts
        # decodes (one token) first: the attention kernel batches them; queries with drafts
        # last: the recurrent layers take them apart
        order = sorted(so.num_scheduled_tokens,
                       key=lambda rid: (so.num_scheduled_tokens[rid] != 1, rid in so.scheduled_draft_tokens))
        rows = [batch.index_of[rid] for rid in order]
        query_lens = [so.num_scheduled_tokens[rid] for rid in order]
        states = [batch.states[r] for r in rows]
        num_computed = [s.num_computed_tokens for s in states]
        # generated-token decodes, the bulk of most steps, in one vectorized gather
        n_fast = 0
        while n_fast < len(rows) and query_lens[n_fast] == 1 and num_computed[n_fast] >= states[n_fast].num_prompt_tokens:
            n_fast += 1
        fast_rows = np.asarray(rows[:n_fast], dtype=np.int64)
        fast_pos = np.asarray(num_computed[:n_fast], dtype=np.int64)
        ids = [batch.token_ids[fast_rows, fast_pos]]
        deltas = np.asarray([s.mrope_delta for s in states[:n_fast]], dtype=np.int64)
        pos = [self.staging.upload("decode_positions", fast_pos + deltas).expand(3, -1)]
        for state, row, c, q in zip(states[n_fast:], rows[n_fast:], num_computed[n_fast:], query_lens[n_fast:]):
            ids.append(batch.token_ids[row, c : c + q])
            pos.append(self.positions(state, c, c + q))
        self.sync_block_tables()
        return StepInputs(
            req_ids=order,
            rows=rows,
            num_computed=num_computed,
            query_lens=query_lens,
            num_drafts=[len(so.scheduled_draft_tokens.get(rid, ())) for rid in order],
            checkpoints=[so.draft_checkpoints.get(rid, []) for rid in order],
            propose_drafts=so.propose_drafts,
            input_ids=self.staging.upload("input_ids", np.concatenate(ids)),
            positions=torch.cat(pos, dim=1) if len(pos) > 1 else pos[0],
        )

    def positions(self, state: CachedRequestState, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions of tokens [start, end): the prompt's were computed once at
        input processing (and are on the device since the request came); generated
        tokens continue them by a constant delta."""
        n_prompt = state.num_prompt_tokens
        parts = []
        if start < n_prompt:
            stop = min(end, n_prompt)
            if state.mrope_positions is not None:
                parts.append(state.mrope_positions[:, start:stop])
            else:
                parts.append(torch.arange(start, stop, device=self.device).expand(3, -1))
        if end > n_prompt:
            gen = torch.arange(max(start, n_prompt), end, device=self.device) + state.mrope_delta
            parts.append(gen.expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def model_inputs(self, model: torch.nn.Module, plan: LayerPlan, step: StepInputs,
                     encoder_cache: dict[str, torch.Tensor], output_rows: list[int] | None = None
                     ) -> tuple[torch.Tensor, ForwardContext]:
        """The input embeddings (pictures merged in) and the forward context of a step
        whose output_rows are read (None: all; see ForwardContext)."""
        embeds = model.embed_input_ids(step.input_ids)
        ctx = self.forward_context(step, plan)
        if output_rows is not None:
            ctx.output_rows = self.staging.upload(f"{plan.name}.output_rows", np.asarray(output_rows, dtype=np.int64))
        mm = self._multimodal_embeddings(step, encoder_cache)
        if mm is not None:
            ctx.deepstack = model.merge_multimodal(embeds, *mm)
        return embeds, ctx

    def forward_context(self, step: StepInputs, plan: LayerPlan, state_slots: list[int] | None = None,
                        name: str | None = None) -> ForwardContext:
        """The metadata of the plan's layers for a step; state_slots: the recurrent layers'
        slots if not the requests' own. `name` names the staged inputs (default: the plan's)."""
        batch = self.batch
        name = name or plan.name
        attn, recurrent = {}, {}
        rows = np.asarray(step.rows, dtype=np.int64)
        if plan.recurrent_layers:
            slots = state_slots or [batch.states[r].state_slot for r in step.rows]
            upload = lambda key, array: self.staging.upload(f"{name}.{key}", array)
            meta = build_recurrent_metadata(slots, step.num_computed, step.query_lens, upload, step.checkpoints)
            recurrent = {layer: meta for layer in plan.recurrent_layers}
        rows_t = self.staging.upload(f"{name}.rows", rows)
        key_ends = self._key_ends(step)
        for j, (layers, a, window) in enumerate(plan.attention):
            width = int(batch.num_blocks[a][rows].max())
            upload = lambda key, array, j=j: self.staging.upload(f"{name}.attn{j}.{key}", array)
            meta = build_attention_metadata(self.device_tables[a][rows_t, :width], step.num_computed,
                                            step.query_lens, self.block_size, window, upload, key_ends)
            attn.update({layer: meta for layer in layers})
        return ForwardContext(kv_caches=plan.kv_caches, attn_metadata=attn, layer_state=recurrent)

    @staticmethod
    def copy_states(copies: list[tuple[int, int]], plan: LayerPlan) -> None:
        """Recurrent-state slot copies (source, destination) in the plan's recurrent layers:
        prefix-cache restores and snapshots, and the restores of refused drafts."""
        for src, dst in copies:
            for layer in plan.recurrent_layers:
                for tensor in plan.kv_caches[layer]:
                    tensor[dst] = tensor[src]

    def sync_block_tables(self) -> None:
        rows = self.batch.take_dirty_rows()
        if self.device.type == "cpu" or not rows:
            return  # the CPU tables are views of the batch's arrays
        rows_np = np.asarray(rows, dtype=np.int64)
        rows_t = self.staging.upload("dirty_rows", rows_np)
        for a, table in enumerate(self.batch.block_tables):
            self.device_tables[a][rows_t] = self.staging.upload(f"dirty_table{a}", table[rows_np])

    def _multimodal_embeddings(self, step: StepInputs,
                               encoder_cache: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where this step's placeholder tokens are among its tokens, and their rows of
        the encoder outputs (exactly the tokens computed this step); None without any."""
        dest, src = [], []
        token_start = 0
        for row, c, q in zip(step.rows, step.num_computed, step.query_lens):
            for f in self.batch.states[row].mm_features:
                lo, hi = max(c, f.offset), min(c + q, f.end)
                if lo >= hi:
                    continue
                out = encoder_cache.get(f.mm_hash)
                if out is None:
                    raise RuntimeError(f"encoder output for {f.mm_hash} is not in the encoder cache")
                src.append(out[lo - f.offset : hi - f.offset])
                dest.append(torch.arange(token_start + lo - c, token_start + hi - c))
            token_start += q
        if not dest:
            return None
        return torch.cat(dest).to(self.device), torch.cat(src).to(self.device)

    def _key_ends(self, step: StepInputs) -> np.ndarray | None:
        """The last key each query token sees, where the step holds media whose tokens
        attend to each other both ways (the scheduler never cuts one); None: causal."""
        if not self.bidirectional_media:
            return None
        ends, token_start = None, 0
        for row, c, q in zip(step.rows, step.num_computed, step.query_lens):
            state = self.batch.states[row]
            if c >= state.num_prompt_tokens:  # a decode: past every picture
                token_start += q
                continue
            for f in state.mm_features:
                lo, hi = max(c, f.offset), min(c + q, f.end)
                if not f.bidirectional or lo >= hi:
                    continue
                if ends is None:  # every token's own position first
                    starts = np.repeat(np.asarray(step.num_computed) - np.cumsum([0] + step.query_lens[:-1]),
                                       step.query_lens)
                    ends = np.arange(len(starts)) + starts
                ends[token_start + lo - c : token_start + hi - c] = f.end - 1
            token_start += q
        return ends
