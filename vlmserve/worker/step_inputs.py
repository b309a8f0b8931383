"""A step's model inputs, built from the scheduler's decision and the persistent batch:
token ids and M-RoPE positions in execution order, the pictures' embeddings merged in,
and per layer the metadata the kernels read (block tables, slot mappings, recurrent-state
slots). The runner builds the target model's inputs with it; a draft model builds its own
from the same pieces.

What comes from the host's batch is read when the step is prepared (`prepare`,
`forward_context`, `merge_plan`): the batch changes under the next step while this one
runs. A token the host does not know yet — the one the step in flight is sampling, with
asynchronous scheduling — is a placeholder: its place among the step's token ids and its
index among that step's sampled tokens, filled on the device (`fill_placeholders`)."""

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
class MergePiece:
    """A run of a medium's embeddings that this step's tokens take: rows [lo, hi) of the
    encoder output of mm_hash, at the step's tokens from `dest` on."""

    mm_hash: str
    lo: int
    hi: int
    dest: int


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
    input_ids: torch.Tensor  # [tokens]; a placeholder's is 0 until fill_placeholders
    positions: torch.Tensor  # [3, tokens]
    # tokens the host does not know yet: (their places among input_ids, their indices among
    # the previous step's sampled tokens); None: none
    placeholders: tuple[torch.Tensor, torch.Tensor] | None = None
    rows_array: np.ndarray | None = None  # rows, as an array


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

    def prepare(self, so: SchedulerOutput, sampled_before: dict[str, int] | None = None) -> StepInputs:
        """sampled_before: request id -> index among the previous step's sampled tokens, for
        the requests whose last token is still on the device (asynchronous scheduling)."""
        batch = self.batch
        drafted = so.scheduled_draft_tokens
        for rid, drafts in drafted.items():  # after the last token, not counted in it
            row = batch.index_of[rid]
            batch.token_ids[row, batch.num_tokens[row] : batch.num_tokens[row] + len(drafts)] = drafts
        rids = list(so.num_scheduled_tokens)
        n = len(rids)
        rows = np.fromiter((batch.index_of[rid] for rid in rids), np.int64, n)
        query_lens = np.fromiter(so.num_scheduled_tokens.values(), np.int64, n)
        num_computed = batch.num_computed[rows]
        prefill = num_computed < batch.num_prompt[rows]
        has_drafts = np.fromiter((rid in drafted for rid in rids), np.bool_, n) if drafted else np.zeros(n, np.bool_)
        # one-token queries first, generated-token decodes (the bulk of most steps) before
        # prompt chunks: the attention kernel batches them; queries with drafts last: the
        # recurrent layers take them apart (a stable sort: ties keep the scheduler's order)
        index = np.lexsort((prefill, query_lens != 1, has_drafts))
        order = [rids[i] for i in index.tolist()]
        rows, query_lens, num_computed = rows[index], query_lens[index], num_computed[index]
        n_fast = int(np.count_nonzero((query_lens == 1) & ~prefill & ~has_drafts))
        # the generated-token decodes in one vectorized gather
        fast_rows, fast_pos = rows[:n_fast], num_computed[:n_fast]
        ids = [batch.token_ids[fast_rows, fast_pos]]
        pending = np.flatnonzero(fast_pos >= batch.num_tokens[fast_rows])  # sampled by the step in flight
        ids[0][pending] = 0
        pos = [self.staging.upload("decode_positions", fast_pos + batch.mrope_delta[fast_rows]).expand(3, -1)]
        token_start = n_fast
        for rid, row, c, q in zip(order[n_fast:], rows[n_fast:].tolist(), num_computed[n_fast:].tolist(),
                                  query_lens[n_fast:].tolist()):
            ids.append(batch.token_ids[row, c : c + q].copy())
            known = int(batch.num_tokens[row]) + len(drafted.get(rid, ()))
            if c + q > known:  # its last token is sampled by the step in flight
                ids[-1][known - c :] = 0
                pending = np.append(pending, token_start + known - c)
            pos.append(self.positions(batch.states[row], c, c + q))
            token_start += q
        placeholders = None
        if pending.size:
            owner = np.searchsorted(np.cumsum(query_lens) - query_lens, pending, side="right") - 1
            sources = np.asarray([sampled_before[order[i]] for i in owner.tolist()], dtype=np.int64)
            placeholders = (self.staging.upload("placeholder_dest", pending), self.staging.upload("placeholder_src", sources))
        self.sync_block_tables()
        return StepInputs(
            req_ids=order,
            rows=rows.tolist(),
            num_computed=num_computed.tolist(),
            query_lens=query_lens.tolist(),
            num_drafts=[len(drafted.get(rid, ())) for rid in order] if drafted else [0] * n,
            checkpoints=[so.draft_checkpoints.get(rid, []) for rid in order] if so.draft_checkpoints else [[]] * n,
            propose_drafts=so.propose_drafts,
            input_ids=self.staging.upload("input_ids", np.concatenate(ids)),
            positions=torch.cat(pos, dim=1) if len(pos) > 1 else pos[0],
            placeholders=placeholders,
            rows_array=rows,
        )

    @staticmethod
    def fill_placeholders(step: StepInputs, sampled_before: torch.Tensor | None) -> None:
        """The placeholders' token ids, from the previous step's sampled tokens on the device."""
        if step.placeholders is not None:
            dest, src = step.placeholders
            step.input_ids[dest] = sampled_before[src]

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
        ctx = self.forward_context(step, plan, output_rows=output_rows)
        return self.embed(model, step, ctx, self.merge_plan(step), encoder_cache), ctx

    def embed(self, model: torch.nn.Module, step: StepInputs, ctx: ForwardContext, merge: list[MergePiece],
              encoder_cache: dict[str, torch.Tensor]) -> torch.Tensor:
        """The step's input embeddings, the media's merged in (on the device, in order)."""
        embeds = model.embed_input_ids(step.input_ids)
        if merge:
            dest, src = [], []
            for piece in merge:
                out = encoder_cache.get(piece.mm_hash)
                if out is None:
                    raise RuntimeError(f"encoder output for {piece.mm_hash} is not in the encoder cache")
                src.append(out[piece.lo : piece.hi])
                dest.append(torch.arange(piece.dest, piece.dest + piece.hi - piece.lo))
            ctx.deepstack = model.merge_multimodal(embeds, torch.cat(dest).to(self.device), torch.cat(src).to(self.device))
        return embeds

    def forward_context(self, step: StepInputs, plan: LayerPlan, state_slots: list[int] | None = None,
                        name: str | None = None, output_rows: list[int] | None = None) -> ForwardContext:
        """The metadata of the plan's layers for a step; state_slots: the recurrent layers'
        slots if not the requests' own. `name` names the staged inputs (default: the plan's);
        output_rows: the rows whose hidden states are read (None: all; see ForwardContext)."""
        batch = self.batch
        name = name or plan.name
        attn, recurrent = {}, {}
        rows = step.rows_array if step.rows_array is not None else np.asarray(step.rows, dtype=np.int64)
        if plan.recurrent_layers:
            slots = state_slots or [batch.states[r].state_slot for r in step.rows]
            upload = lambda key, array: self.staging.upload(f"{name}.{key}", array)
            meta = build_recurrent_metadata(slots, step.num_computed, step.query_lens, upload, step.checkpoints)
            recurrent = {layer: meta for layer in plan.recurrent_layers}
        # the block tables: on the CPU gathered from the host's arrays, on a GPU from its copy
        rows_t = None if self.device.type == "cpu" else self.staging.upload(f"{name}.rows", rows)
        key_ends = self._key_ends(step)
        for j, (layers, a, window) in enumerate(plan.attention):
            width = int(batch.num_blocks[a][rows].max())
            upload = lambda key, array, j=j: self.staging.upload(f"{name}.attn{j}.{key}", array)
            tables = batch.block_tables[a][rows, :width] if rows_t is None else self.device_tables[a][rows_t, :width]
            meta = build_attention_metadata(tables, step.num_computed, step.query_lens, self.block_size, window,
                                            upload, key_ends)
            attn.update({layer: meta for layer in layers})
        ctx = ForwardContext(kv_caches=plan.kv_caches, attn_metadata=attn, layer_state=recurrent)
        if output_rows is not None:
            ctx.output_rows = self.staging.upload(f"{name}.output_rows", np.asarray(output_rows, dtype=np.int64))
        return ctx

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

    def merge_plan(self, step: StepInputs) -> list[MergePiece]:
        """Where this step's media tokens are among its tokens, and which rows of which
        encoder outputs they take (exactly the tokens computed this step)."""
        pieces = []
        token_start = 0
        for row, c, q in zip(step.rows, step.num_computed, step.query_lens):
            if c < self.batch.states[row].num_prompt_tokens:  # a decode computes no media token
                for f in self.batch.states[row].mm_features:
                    lo, hi = max(c, f.offset), min(c + q, f.end)
                    if lo < hi:
                        pieces.append(MergePiece(f.mm_hash, lo - f.offset, hi - f.offset, token_start + lo - c))
            token_start += q
        return pieces

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
