"""Executes one scheduled step: applies the scheduler's deltas to the persistent batch,
runs the encoder for the media it was told to, builds the model inputs, runs the model,
samples. It makes no scheduling decision: it does what the SchedulerOutput says."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from vlmserve.config import SchedulerConfig, SpeculativeConfig
from vlmserve.core.kv_cache_spec import AttentionSpec, FullAttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec
from vlmserve.core.sched_output import LogprobsEntry, ModelRunnerOutput, SchedulerOutput
from vlmserve.engine.phase_timer import PhaseTimer
from vlmserve.kernels.attention import build_attention_metadata, kv_cache_shapes
from vlmserve.kernels.gdn import build_recurrent_metadata
from vlmserve.models.context import ForwardContext
from vlmserve.spec_decode.ngram_proposer import NgramProposer
from vlmserve.worker.input_batch import CachedRequestState, InputBatch
from vlmserve.structured_output.manager import GrammarBitmask
from vlmserve.worker.rejection_sampler import can_verify, verify
from vlmserve.worker.sampler import Penalties, SamplingBatch, logprobs_entry, sample, token_histories
from vlmserve.worker.staging import Staging

logger = logging.getLogger(__name__)


@dataclass
class LayerPlan:
    """How one model's layers read the KV memory: attention layers in sets that share one
    of the batch's block tables (and a sliding window), recurrent layers by state slot."""

    name: str  # names the step's staged inputs of this model
    kv_caches: dict[int, tuple[torch.Tensor, torch.Tensor]]
    attention: list[tuple[tuple[int, ...], int, int | None]]  # (layer ids, block table index, window)
    recurrent_layers: list[int]


@dataclass
class Drafter:
    """A draft model as the runner drives it (see vlmserve/spec_decode/draft_model.py)."""

    model: torch.nn.Module
    plan: LayerPlan
    encoder_cache: dict[str, torch.Tensor]
    num_tokens: int  # drafts proposed per request and step
    scratch_slot_base: int  # recurrent layers: batch row r guesses in state slot base + r


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


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache_config: KVCacheConfig,
        scheduler_config: SchedulerConfig,
        eos_token_id: int | None,
        device: str = "cpu",
        seed: int = 0,
        timer: PhaseTimer | None = None,
        speculative: SpeculativeConfig | None = None,
        draft_model: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        # per-request proposers (prompt lookup); a draft model proposes for the whole batch
        self.proposer = NgramProposer(speculative) if speculative and draft_model is None else None
        self.timer = timer or PhaseTimer()
        self.eos_token_id = eos_token_id
        self.kv_cache_config = kv_cache_config
        self.device = torch.device(device)
        self.max_model_len = scheduler_config.max_model_len
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.groups = kv_cache_config.groups
        self.block_size = self.groups[0].spec.block_size
        self.kv_caches = self._allocate_kv_caches()
        self.recurrent_layers = [l for g in self.groups if isinstance(g.spec, MambaSpec) for l in g.layer_ids]
        # the attention groups hold block tables (in the order the scheduler lists them);
        # recurrent groups use each request's one state slot
        self.attention_groups = [g for g in self.groups if isinstance(g.spec, AttentionSpec)]
        max_blocks = [-(-self.max_model_len // self.block_size)] * len(self.attention_groups)
        self.input_batch = InputBatch(scheduler_config.max_num_seqs, self.max_model_len, max_blocks)
        self.staging = Staging(self.device)
        # block tables as the kernels read them: on the CPU a view of the batch's arrays;
        # on a GPU a device copy whose changed rows are uploaded before each step
        self.device_tables = [torch.from_numpy(t).to(self.device) for t in self.input_batch.block_tables]
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.encoder_runs = 0  # media items encoded, for tests and stats
        self.plan = LayerPlan("target", self.kv_caches, [
            (g.layer_ids, a, g.spec.sliding_window if isinstance(g.spec, SlidingWindowSpec) else None)
            for a, g in enumerate(self.attention_groups)], self.recurrent_layers)
        self.drafter = None
        if draft_model is not None:
            self.drafter = self._make_drafter(draft_model, speculative.num_speculative_tokens,
                                              scheduler_config.max_num_seqs)

    # -- memory ---------------------------------------------------------------------------
    def _allocate_kv_caches(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Attention layers: one (keys, values) pair per tensor slot, shared by the j-th
        layer of every attention group. Recurrent layers: (conv window, delta-rule state)
        per state slot."""
        caches = {}
        n_slots = self.kv_cache_config.num_state_slots
        for g in self.groups:
            if isinstance(g.spec, MambaSpec):
                for layer in g.layer_ids:
                    conv = torch.zeros(n_slots, *g.spec.conv_shape, dtype=g.spec.dtype, device=self.device)
                    caches[layer] = (conv, torch.zeros(n_slots, *g.spec.ssm_shape, dtype=torch.float32, device=self.device))
        specs = {g.spec for g in self.groups if isinstance(g.spec, AttentionSpec)}
        if not specs:
            return caches
        shapes = {(s.block_size, s.num_kv_heads, s.head_size, s.dtype) for s in specs}
        if len(shapes) != 1:
            raise ValueError(f"attention groups must share one page layout, got {shapes}")
        block_size, heads, head_size, dtype = shapes.pop()
        k_shape, v_shape = kv_cache_shapes(self.kv_cache_config.num_blocks, block_size, heads, head_size)
        slots = []
        for _ in range(self.kv_cache_config.num_tensor_slots):
            # zeroed: attention reads whole blocks, masked past each sequence's end, and a
            # masked position must still hold a finite number (0 * NaN is NaN)
            slots.append((torch.zeros(k_shape, dtype=dtype, device=self.device),
                          torch.zeros(v_shape, dtype=dtype, device=self.device)))
        slot_of = self.kv_cache_config.tensor_slot_of_layer()
        for g in self.groups:
            if isinstance(g.spec, AttentionSpec):
                caches.update({layer: slots[slot_of[layer]] for layer in g.layer_ids})
        return caches

    def _make_drafter(self, model: torch.nn.Module, num_tokens: int, max_num_seqs: int) -> Drafter:
        """The draft model's own KV tensors, on the block ids of the target's first
        full-attention group, and its recurrent states on the target's state slots plus a
        scratch slot per batch row."""
        full = [a for a, g in enumerate(self.attention_groups) if type(g.spec) is FullAttentionSpec]
        scratch_base = self.kv_cache_config.num_state_slots
        caches, attention, recurrent = {}, {}, []
        for layer, spec in model.kv_cache_specs(self.block_size, next(model.parameters()).dtype).items():
            if isinstance(spec, MambaSpec):
                n = scratch_base + max_num_seqs
                caches[layer] = (torch.zeros(n, *spec.conv_shape, dtype=spec.dtype, device=self.device),
                                 torch.zeros(n, *spec.ssm_shape, dtype=torch.float32, device=self.device))
                recurrent.append(layer)
                continue
            shapes = kv_cache_shapes(self.kv_cache_config.num_blocks, self.block_size, spec.num_kv_heads, spec.head_size)
            caches[layer] = tuple(torch.zeros(shape, dtype=spec.dtype, device=self.device) for shape in shapes)
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            attention.setdefault(window, []).append(layer)
        plan = LayerPlan("draft", caches, [(tuple(ids), full[0], w) for w, ids in attention.items()], recurrent)
        return Drafter(model, plan, {}, num_tokens, scratch_base)

    def clear_encoder_cache(self) -> None:
        self.encoder_cache.clear()
        if self.drafter:
            self.drafter.encoder_cache.clear()

    # -- the step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        timer = self.timer
        with timer.phase("runner: inputs"):
            self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {}, [])
        with timer.phase("runner: encoder"):
            self._run_encoder(so)
        with timer.phase("runner: inputs"):
            step = self._prepare_inputs(so)
            self._sync_block_tables()
            embeds, ctx = self._model_inputs(self.model, self.plan, step, self.encoder_cache)
        with timer.phase("runner: forward"):
            self._copy_states(so.state_restores, self.plan)
            hidden = self.model.forward(embeds, step.positions, ctx)
            self._copy_states(so.state_saves, self.plan)
        with timer.phase("runner: sample"):
            output = self._sample(step, hidden, grammar)
        if self.drafter:
            with timer.phase("runner: draft model"):
                self._draft_catch_up(so, step, output)
                self._draft_guesses(step, output)
        return output

    def _model_inputs(self, model: torch.nn.Module, plan: LayerPlan, step: StepInputs,
                      encoder_cache: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ForwardContext]:
        """The input embeddings (pictures merged in) and the forward context of a step."""
        embeds = model.embed_input_ids(step.input_ids)
        ctx = self._forward_context(step, plan)
        mm = self._step_multimodal_embeddings(step, encoder_cache)
        if mm is not None:
            ctx.deepstack = model.merge_multimodal(embeds, *mm)
        return embeds, ctx

    def _copy_states(self, copies: list[tuple[int, int]], plan: LayerPlan) -> None:
        """Recurrent-state slot copies in the plan's recurrent layers: the scheduler's
        prefix-cache restores before a model's forward and snapshots after it, and the
        restores of refused drafts."""
        for src, dst in copies:
            for layer in plan.recurrent_layers:
                for tensor in plan.kv_caches[layer]:
                    tensor[dst] = tensor[src]

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for rid in so.finished_req_ids | so.preempted_req_ids:
            batch.remove(rid)
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
            if self.drafter:
                self.drafter.encoder_cache.pop(mm_hash, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                num_prompt_tokens=len(new.prompt_token_ids),
                mm_features=new.mm_features,
                sampling_params=params,
                generator=gen,
                mrope_positions=None if new.mrope_positions is None else new.mrope_positions.to(self.device),
                mrope_delta=new.mrope_delta,
                num_computed_tokens=new.num_computed_tokens,
                num_output_tokens=len(new.output_token_ids),
                state_slot=new.state_slot,
            )
            batch.add(state, new.prompt_token_ids + new.output_token_ids, new.block_ids)
        cached = so.scheduled_cached_reqs
        for rid, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            row = batch.index_of[rid]
            batch.states[row].num_computed_tokens = num_computed
            for a, ids in enumerate(block_ids):
                if ids:
                    batch.append_blocks(row, a, ids)

    def _run_encoder(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        todo = {}
        for rid, input_ids in so.scheduled_encoder_inputs.items():
            state = batch.states[batch.index_of[rid]]
            for i in input_ids:
                feature = state.mm_features[i]
                todo.setdefault(feature.mm_hash, feature)
        if not todo:
            return
        features = list(todo.values())
        encoders = [(self.model, self.encoder_cache)]
        if self.drafter:  # the draft model reads the same pictures with its own encoder
            encoders.append((self.drafter.model, self.drafter.encoder_cache))
        for model, cache in encoders:
            for feature, out in zip(features, model.embed_multimodal(features)):
                if out.shape[0] != feature.length:
                    raise RuntimeError(
                        f"encoder gave {out.shape[0]} embeddings for {feature.length} placeholders of {feature.mm_hash}"
                    )
                cache[feature.mm_hash] = out
        self.encoder_runs += len(features)

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch = self.input_batch
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
            pos.append(self._positions(state, c, c + q))
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

    def _positions(self, state: CachedRequestState, start: int, end: int) -> torch.Tensor:
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

    def _step_multimodal_embeddings(self, step: StepInputs,
                                    encoder_cache: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where this step's placeholder tokens are among its tokens, and their rows of
        the encoder outputs (exactly the tokens computed this step); None without any."""
        dest, src = [], []
        token_start = 0
        for row, c, q in zip(step.rows, step.num_computed, step.query_lens):
            for f in self.input_batch.states[row].mm_features:
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

    def _forward_context(self, step: StepInputs, plan: LayerPlan, state_slots: list[int] | None = None,
                         name: str | None = None) -> ForwardContext:
        """The metadata of the plan's layers for a step; state_slots: the recurrent layers'
        slots if not the requests' own. `name` names the staged inputs (default: the plan's)."""
        batch = self.input_batch
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

    def _key_ends(self, step: StepInputs) -> np.ndarray | None:
        """The last key each query token sees, where the step holds media whose tokens
        attend to each other both ways (the scheduler never cuts one); None: causal."""
        if not self.model.bidirectional_media:
            return None
        ends, token_start = None, 0
        for row, c, q in zip(step.rows, step.num_computed, step.query_lens):
            state = self.input_batch.states[row]
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

    def _sync_block_tables(self) -> None:
        rows = self.input_batch.take_dirty_rows()
        if self.device.type == "cpu" or not rows:
            return  # the CPU tables are views of the batch's arrays
        rows_np = np.asarray(rows, dtype=np.int64)
        rows_t = self.staging.upload("dirty_rows", rows_np)
        for a, table in enumerate(self.input_batch.block_tables):
            self.device_tables[a][rows_t] = self.staging.upload(f"dirty_table{a}", table[rows_np])

    def _sample(self, step: StepInputs, hidden: torch.Tensor, grammar: GrammarBitmask | None) -> ModelRunnerOutput:
        batch = self.input_batch
        sample_idx, sample_pos = [], []  # which requests sample, and the token that does
        verify_idx, verify_pos = [], []  # which requests check drafts: their last 1 + drafts tokens sample
        prompt_lp_rows: list[tuple[int, int, int, int]] = []  # (i, hidden start, count, first pos)
        token_start = 0
        for i, (row, c, q, d) in enumerate(zip(step.rows, step.num_computed, step.query_lens, step.num_drafts)):
            state = batch.states[row]
            if d:
                verify_idx.append(i)
                verify_pos.extend(range(token_start + q - 1 - d, token_start + q))
            elif c + q >= batch.num_tokens[row]:
                sample_idx.append(i)
                sample_pos.append(token_start + q - 1)
            if state.sampling_params.prompt_logprobs is not None:
                # position p predicts prompt token p + 1
                last = min(c + q, state.num_prompt_tokens - 1)
                if last > c:
                    prompt_lp_rows.append((i, token_start, last - c, c))
            token_start += q

        for i, start, count, first in prompt_lp_rows:
            row = step.rows[i]
            state = batch.states[row]
            lp = torch.log_softmax(self.model.compute_logits(hidden[start : start + count]).float(), dim=-1)
            targets = batch.token_ids[row, first + 1 : first + 1 + count]
            n = state.sampling_params.prompt_logprobs
            state.prompt_logprobs.extend(logprobs_entry(lp[j], int(targets[j]), n) for j in range(count))
        # the prompt is done for every request that samples: hand its prompt logprobs over
        prompt_logprobs: dict[str, list[LogprobsEntry]] = {}
        for i in sample_idx:
            state = batch.states[step.rows[i]]
            if state.sampling_params.prompt_logprobs is not None and state.num_output_tokens == 0:
                prompt_logprobs[step.req_ids[i]] = state.prompt_logprobs

        sampled: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: dict[str, list[LogprobsEntry]] = {}
        positions = sample_pos + verify_pos
        logits = self.model.compute_logits(hidden[positions]) if positions else None
        if sample_idx:
            batch_rows = [step.rows[i] for i in sample_idx]
            sampling = self._sampling_batch(batch_rows, logits.shape[-1], grammar)
            tokens, entries = sample(logits[: len(sample_idx)], sampling)
            for i, token, entry in zip(sample_idx, tokens, entries):
                sampled[i] = [token]
                if entry is not None:
                    logprobs[step.req_ids[i]] = [entry]
        if verify_idx:
            self._verify_drafts(step, logits[len(sample_idx) :], verify_idx, sampled, logprobs)
        draft_token_ids = {}
        for i, (row, c, tokens) in enumerate(zip(step.rows, step.num_computed, sampled)):
            state = batch.states[row]
            state.num_computed_tokens = c + self._kept_tokens(step, i, tokens)
            for token in tokens:
                batch.append_token(row, token)
            state.num_output_tokens += len(tokens)
            if self.proposer and self._proposes(step, state, tokens):
                draft_token_ids[step.req_ids[i]] = self.proposer.propose(batch.token_ids[row, : batch.num_tokens[row]])
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(step.req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            draft_token_ids=draft_token_ids,
        )

    @staticmethod
    def _kept_tokens(step: StepInputs, i: int, tokens: list[int]) -> int:
        """Of the i-th request's query, the tokens now in the cache: less the refused drafts."""
        return step.query_lens[i] - (step.num_drafts[i] + 1 - len(tokens) if tokens else 0)

    @staticmethod
    def _proposes(step: StepInputs, state: CachedRequestState, tokens: list[int]) -> bool:
        """Whether a request that got `tokens` this step gets drafts for the next one."""
        return bool(tokens) and step.propose_drafts and can_verify(state.sampling_params, state.num_output_tokens)

    def _draft_catch_up(self, so: SchedulerOutput, step: StepInputs, output: ModelRunnerOutput) -> None:
        """The draft model computes the tokens the target kept this step, so its cache
        holds what the target's holds (with the same prefix-cache restores and snapshots)."""
        drafter = self.drafter
        kept = [self._kept_tokens(step, i, tokens) for i, tokens in enumerate(output.sampled_token_ids)]
        starts = np.cumsum([0] + step.query_lens[:-1])
        order = sorted(range(len(kept)), key=lambda i: kept[i] != 1)  # one-token queries first
        index = np.concatenate([np.arange(starts[i], starts[i] + kept[i]) for i in order])
        index_t = torch.from_numpy(index).to(self.device)
        catch_up = StepInputs(
            req_ids=[step.req_ids[i] for i in order],
            rows=[step.rows[i] for i in order],
            num_computed=[step.num_computed[i] for i in order],
            query_lens=[kept[i] for i in order],
            num_drafts=[0] * len(order),
            checkpoints=[[] for _ in order],
            propose_drafts=False,
            input_ids=step.input_ids[index_t],
            positions=step.positions[:, index_t],
        )
        embeds, ctx = self._model_inputs(drafter.model, drafter.plan, catch_up, drafter.encoder_cache)
        self._copy_states(so.state_restores, drafter.plan)
        drafter.model.forward(embeds, catch_up.positions, ctx)
        self._copy_states(so.state_saves, drafter.plan)

    def _draft_guesses(self, step: StepInputs, output: ModelRunnerOutput) -> None:
        """k greedy guesses of the draft model after each new token of the requests that
        take drafts, one batched one-token forward per guess."""
        drafter, batch = self.drafter, self.input_batch
        proposing = [i for i, tokens in enumerate(output.sampled_token_ids)
                     if self._proposes(step, batch.states[step.rows[i]], tokens)]
        if not proposing:
            return
        rows = [step.rows[i] for i in proposing]
        rows_np = np.asarray(rows, dtype=np.int64)
        first = batch.num_tokens[rows_np] - 1  # each request's new token, guessed from
        deltas = np.asarray([batch.states[r].mrope_delta for r in rows], dtype=np.int64)
        scratch = [drafter.scratch_slot_base + r for r in rows]
        # the guesses move the recurrent state: they start from a copy of it
        self._copy_states([(batch.states[r].state_slot, s) for r, s in zip(rows, scratch)], drafter.plan)
        tokens = batch.token_ids[rows_np, first]
        drafts: list[list[int]] = [[] for _ in rows]
        for j in range(drafter.num_tokens):
            sel = np.flatnonzero(first + j < self.max_model_len)  # a guess needs a KV slot inside the context
            if not sel.size:
                break
            pos = first[sel] + j
            guess_step = StepInputs(
                req_ids=[step.req_ids[proposing[s]] for s in sel], rows=[rows[s] for s in sel],
                num_computed=pos.tolist(), query_lens=[1] * len(sel), num_drafts=[0] * len(sel),
                checkpoints=[[] for _ in sel], propose_drafts=False,
                input_ids=self.staging.upload(f"draft{j}.input_ids", tokens[sel]),
                positions=self.staging.upload(f"draft{j}.positions", pos + deltas[sel]).expand(3, -1),
            )
            ctx = self._forward_context(guess_step, drafter.plan, [scratch[s] for s in sel], name=f"draft{j}")
            embeds = drafter.model.embed_input_ids(guess_step.input_ids)
            hidden = drafter.model.forward(embeds, guess_step.positions, ctx)
            new = drafter.model.compute_logits(hidden).argmax(dim=-1).cpu().numpy()
            tokens[sel] = new
            for s, token in zip(sel, new.tolist()):
                drafts[s].append(token)
        for s, i in enumerate(proposing):
            output.draft_token_ids[step.req_ids[i]] = drafts[s]

    def _verify_drafts(self, step: StepInputs, logits: torch.Tensor, verify_idx: list[int],
                       sampled: list[list[int]], logprobs: dict[str, list[LogprobsEntry]]) -> None:
        """The tokens of the requests that checked drafts (logits: 1 + drafts rows each);
        recurrent layers are put back to their state after the last kept token."""
        batch = self.input_batch
        rows = [step.rows[i] for i in verify_idx]
        drafts = [batch.token_ids[r, batch.num_tokens[r] : batch.num_tokens[r] + step.num_drafts[i]].tolist()
                  for r, i in zip(rows, verify_idx)]
        row_of_logits = [r for r, d in zip(rows, drafts) for _ in range(len(d) + 1)]
        verified = verify(logits, drafts, self._sampling_batch(row_of_logits, logits.shape[-1], None))
        restores = []
        for i, row, tokens, entries in zip(verify_idx, rows, verified.token_ids, verified.logprobs):
            sampled[i] = tokens
            if entries:
                logprobs[step.req_ids[i]] = entries
            if step.checkpoints[i] and len(tokens) <= step.num_drafts[i]:  # a draft was refused
                restores.append((step.checkpoints[i][len(tokens) - 1], batch.states[row].state_slot))
        self._copy_states(restores, self.plan)

    def _sampling_batch(self, rows: list[int], vocab: int, grammar: GrammarBitmask | None) -> SamplingBatch:
        """The sampling settings of these batch rows, as tensors over the rows."""
        batch = self.input_batch
        states = [batch.states[r] for r in rows]
        params = [s.sampling_params for s in states]
        dev = self.device
        sampling = SamplingBatch(
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in params], device=dev),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
            top_p=torch.tensor([p.top_p for p in params], device=dev),
            min_p=torch.tensor([p.min_p for p in params], device=dev),
            generators=[s.generator or self.generator for s in states],
            num_logprobs=[p.logprobs for p in params],
        )
        mask_index = {rid: i for i, rid in enumerate(grammar.req_ids)} if grammar is not None else {}
        banned = [(i, t) for i, (row, s) in enumerate(zip(rows, states))
                  for t in self._banned_tokens(row, s, grammar.bitmask[mask_index[s.req_id]]
                                               if s.req_id in mask_index else None)]
        if banned:
            sampling.banned = tuple(torch.tensor(list(x), dtype=torch.long, device=dev) for x in zip(*banned))
        bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias.items()]
        if bias:
            i, t, b = zip(*bias)
            sampling.logit_bias = (torch.tensor(i, device=dev), torch.tensor(t, device=dev),
                                   torch.tensor(b, dtype=torch.float32, device=dev))
        if any(p.has_penalties for p in params):
            sampling.penalties = self._penalties(rows, params, vocab)
        if grammar is not None:
            pairs = [(i, mask_index[s.req_id]) for i, s in enumerate(states) if s.req_id in mask_index]
            if pairs:
                sample_rows, mask_rows = zip(*pairs)
                sampling.grammar = (torch.tensor(sample_rows, device=dev),
                                    grammar.bitmask[list(mask_rows)].to(dev))
        return sampling

    def _banned_tokens(self, row: int, state: CachedRequestState, grammar_mask: torch.Tensor | None) -> list[int]:
        """EOS and stop tokens while below min_tokens, unless the request's grammar admits
        nothing else (its answer is complete: the grammar wins); bad words: a one-token word
        always, a longer one's last token when the output ends with the rest of it."""
        p = state.sampling_params
        banned = []
        if state.num_output_tokens < p.min_tokens:
            stops = ([] if self.eos_token_id is None or p.ignore_eos else [self.eos_token_id]) + p.stop_token_ids
            if grammar_mask is None or _allows_other_than(grammar_mask, stops):
                banned += stops
        n_prompt, n_tokens = state.num_prompt_tokens, int(self.input_batch.num_tokens[row])
        for word in p.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) <= n_tokens - n_prompt and (
                    not prefix or self.input_batch.token_ids[row, n_tokens - len(prefix) : n_tokens].tolist() == prefix):
                banned.append(word[-1])
        return banned

    def _penalties(self, rows: list[int], params: list, vocab: int) -> Penalties:
        batch = self.input_batch
        rows_np = np.asarray(rows, dtype=np.int64)
        num_tokens = batch.num_tokens[rows_np]
        history = torch.from_numpy(batch.token_ids[rows_np, : int(num_tokens.max())]).to(self.device)
        num_prompt = torch.tensor([batch.states[r].num_prompt_tokens for r in rows], device=self.device)
        counts, in_prompt = token_histories(history, num_prompt, torch.from_numpy(num_tokens).to(self.device), vocab)
        return Penalties(
            repetition=torch.tensor([p.repetition_penalty for p in params], device=self.device),
            frequency=torch.tensor([p.frequency_penalty for p in params], device=self.device),
            presence=torch.tensor([p.presence_penalty for p in params], device=self.device),
            output_counts=counts,
            in_prompt=in_prompt,
        )


def _allows_other_than(bitmask_row: torch.Tensor, token_ids: list[int]) -> bool:
    """Whether a grammar's bitmask row (int32 words) admits a token outside token_ids."""
    words = bitmask_row.cpu().numpy().view(np.uint32).copy()
    for t in token_ids:
        if t // 32 < len(words):
            words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
    return bool(words.any())
