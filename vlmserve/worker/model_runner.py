"""Executes one scheduled step: applies the scheduler's deltas to the persistent batch,
runs the encoder for the media it was told to, builds the model inputs, runs the model,
samples. It makes no scheduling decision: it does what the SchedulerOutput says."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlmserve.config import SchedulerConfig
from vlmserve.core.kv_cache_spec import AttentionSpec, KVCacheConfig, MambaSpec, SlidingWindowSpec
from vlmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vlmserve.kernels import KernelTable, use_kernels
from vlmserve.kernels.attention import kv_cache_shapes
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.outputs import LogprobsEntry
from vlmserve.phase_timer import PhaseTimer
from vlmserve.pooling_params import PoolingParams
from vlmserve.structured_output.manager import GrammarBitmask
from vlmserve.worker.cuda_graphs import CudaGraphs, GraphInputs
from vlmserve.worker.input_batch import CachedRequestState, InputBatch
from vlmserve.worker.lora_slots import LoRASlots
from vlmserve.worker.proposer import Proposer
from vlmserve.worker.rejection_sampler import can_verify, verify
from vlmserve.worker.sampler import build_sampling_batch, logprobs_entry, sample
from vlmserve.worker.staging import Staging
from vlmserve.worker.step_inputs import LayerPlan, StepInputBuilder, StepInputs


# Embedding tokens of media one call of the vision tower takes (an item larger than this
# alone): a step's encoder budget (8,192 by default) in one call held every block's
# activations for up to 32k patches at once, 0.76 GB of temporaries at Qwen2.5-VL-3B's
# widths that the process keeps (allocator.py); at 2,048 (8,192 patches) its
# matmuls still take hundreds of rows a pass and run as fast.
ENCODER_CALL_TOKENS = 2048


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


@dataclass
class SamplingPositions:
    """The requests of a step that sample a token, those that check drafts, and where the
    tokens they read are among the step's (the samplers' first, in order)."""

    sample_idx: list[int]
    verify_idx: list[int]
    positions: list[int]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kernels: KernelTable,
        kv_cache_config: KVCacheConfig,
        scheduler_config: SchedulerConfig,
        eos_token_id: int | None,
        device: str = "cpu",
        seed: int = 0,
        timer: PhaseTimer | None = None,
        proposer: Proposer | None = None,
        lora: LoRASlots | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        self.model = model
        self.lora = lora  # the adapters' slots, where LoRA is on
        self.kernels = kernels  # every op the model calls in this runner's steps
        self.timer = timer or PhaseTimer()
        self.eos_token_id = eos_token_id
        self.kv_cache_config = kv_cache_config
        self.device = torch.device(device)
        self.max_model_len = scheduler_config.max_model_len
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.groups = kv_cache_config.groups
        self.block_size = self.groups[0].spec.block_size
        self.kv_caches = self._allocate_kv_caches()
        # the attention groups hold block tables (in the order the scheduler lists them);
        # recurrent groups use each request's one state slot
        attention_groups = [g for g in self.groups if isinstance(g.spec, AttentionSpec)]
        max_blocks = [-(-self.max_model_len // self.block_size)] * len(attention_groups)
        self.input_batch = InputBatch(scheduler_config.max_num_seqs, self.max_model_len, max_blocks)
        self.inputs = StepInputBuilder(self.input_batch, Staging(self.device), self.block_size, self.device,
                                       model.bidirectional_media)
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.encoder_runs = 0  # media items encoded, for tests and stats
        self.plan = LayerPlan("target", self.kv_caches, [
            (g.layer_ids, a, g.spec.sliding_window if isinstance(g.spec, SlidingWindowSpec) else None)
            for a, g in enumerate(attention_groups)],
            [layer for g in self.groups if isinstance(g.spec, MambaSpec) for layer in g.layer_ids])
        self.proposer = proposer  # speculative decoding's drafts, where it is on
        if proposer is not None:
            proposer.bind(self.input_batch, self.inputs)
        # on CUDA decode-only steps replay graphs captured now (LoRA's per-token adapters are not captured)
        self.cuda_graphs = CudaGraphs.capture(
            GraphInputs(model, kernels, self.plan, self.input_batch, self.inputs, self.block_size, self.device),
            scheduler_config.max_num_seqs) if cuda_graphs and self.device.type == "cuda" and lora is None else None

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
            # zero-filled (attention reads whole blocks, masked past each sequence's end); on
            # the CPU by the kernel as each page is first used, not all at start
            slots.append(tuple(self.kernels.zeros_streamed(shape, dtype, self.device) for shape in (k_shape, v_shape)))
        slot_of = self.kv_cache_config.tensor_slot_of_layer()
        for g in self.groups:
            if isinstance(g.spec, AttentionSpec):
                caches.update({layer: slots[slot_of[layer]] for layer in g.layer_ids})
        return caches

    def load_lora(self, lora: LoRARequest) -> None:
        """Reads an adapter into memory ahead of its first step (LoRAError if it cannot)."""
        if self.lora is None:
            raise RuntimeError("a LoRA request reached an engine without LoRA")
        self.lora.load(lora)

    def clear_encoder_cache(self) -> None:
        self.encoder_cache.clear()
        if self.proposer:
            self.proposer.clear_encoder_cache()

    # -- the step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        with use_kernels(self.kernels):
            return self._execute(so, grammar)

    def _execute(self, so: SchedulerOutput, grammar: GrammarBitmask | None) -> ModelRunnerOutput:
        timer = self.timer
        with timer.phase("runner: inputs"):
            self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput([], {}, [])
        with timer.phase("runner: encoder"):
            self._run_encoder(so)
        with timer.phase("runner: inputs"):
            step = self.inputs.prepare(so)
            read = self._sampling_positions(step)
            graphed = self.cuda_graphs is not None and self.cuda_graphs.fits(step)
            output_rows = None if graphed else self._output_rows(step, read.positions)
            if not graphed:
                embeds, ctx = self.inputs.model_inputs(self.model, self.plan, step, self.encoder_cache, output_rows)
        with timer.phase("runner: forward"):
            self.inputs.copy_states(so.state_restores, self.plan)
            if self.lora:
                states = self.input_batch.states
                self.lora.set_tokens([states[row].lora_request for row in step.rows], step.query_lens)
            try:
                hidden = self.cuda_graphs.replay(step) if graphed else self.model.forward(embeds, step.positions, ctx)
            finally:
                if self.lora:
                    self.lora.clear()
            self.inputs.copy_states(so.state_saves, self.plan)
        with timer.phase("runner: sample"):
            pooled = self._pool(step, hidden)
            # the forward gave only the rows read where output_rows said so
            read_hidden = None if not read.positions else hidden if output_rows is not None else hidden[read.positions]
            sampled, logprobs, prompt_logprobs = self._sample(step, read, read_hidden, hidden, grammar)
            kept = self._record(step, sampled)
        drafts = {}
        if self.proposer:
            with timer.phase("runner: drafts"):
                proposing = [i for i, tokens in enumerate(sampled) if self._proposes(step, i, tokens)]
                drafts = self.proposer.propose(so, step, kept, proposing)
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(step.req_ids)},
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            draft_token_ids=drafts,
            pooler_output=pooled,
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for rid in so.finished_req_ids | so.preempted_req_ids:
            batch.remove(rid)
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        if self.proposer:
            self.proposer.free_encoder_outputs(so.free_encoder_mm_hashes)
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
                lora_request=new.lora_request,
                pooling_params=new.pooling_params,
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
            # an adapter of the vision tower encodes the request's media its own way (their
            # hashes say so, the front end tagged them)
            lora = state.lora_request if self.lora and state.lora_request and \
                self.lora.touches_vision(state.lora_request) else None
            for i in input_ids:
                feature = state.mm_features[i]
                todo.setdefault(feature.mm_hash, (feature, lora))
        by_adapter: dict[LoRARequest | None, list[MultiModalFeature]] = {}
        for feature, lora in todo.values():
            by_adapter.setdefault(lora, []).append(feature)
        for lora, features in by_adapter.items():
            self._encode(features, lora)

    def _encode(self, features: list[MultiModalFeature], lora: LoRARequest | None) -> None:
        if self.lora:
            self.lora.set_all(lora)
        try:
            outputs = [out for group in encoder_calls(features, ENCODER_CALL_TOKENS)
                       for out in self.model.embed_multimodal(group)]
        finally:
            if self.lora:
                self.lora.clear()
        for feature, out in zip(features, outputs):
            if out.shape[0] != feature.length:
                raise RuntimeError(
                    f"encoder gave {out.shape[0]} embeddings for {feature.length} placeholders of {feature.mm_hash}"
                )
            self.encoder_cache[feature.mm_hash] = out
        if self.proposer:  # a draft model reads the same pictures with its own encoder
            for group in encoder_calls(features, ENCODER_CALL_TOKENS):
                self.proposer.encode(group)
        self.encoder_runs += len(features)

    # -- sampling -------------------------------------------------------------------------
    def _sample(self, step: StepInputs, read: SamplingPositions, read_hidden: torch.Tensor | None,
                hidden: torch.Tensor, grammar: GrammarBitmask | None
                ) -> tuple[list[list[int]], dict[str, list[LogprobsEntry]], dict[str, list[LogprobsEntry]]]:
        """The tokens of each request of the step (none for a prompt chunk that ends inside
        the prompt; one, or the kept drafts and one more, for the others), their logprobs,
        and the prompt logprobs of the requests whose prompt is done. read_hidden: the
        final hidden states at read.positions; hidden: every row's, when the forward gave
        them all."""
        sample_idx, verify_idx = read.sample_idx, read.verify_idx
        prompt_logprobs = self._prompt_logprobs(step, hidden, sample_idx)
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: dict[str, list[LogprobsEntry]] = {}
        logits = self.model.compute_logits(read_hidden) if read_hidden is not None else None
        if sample_idx:
            rows = [step.rows[i] for i in sample_idx]
            sampling = build_sampling_batch(self.input_batch, rows, logits.shape[-1], grammar, self.eos_token_id,
                                            self.generator)
            tokens, entries = sample(logits[: len(sample_idx)], sampling)
            for i, token, entry in zip(sample_idx, tokens, entries):
                sampled[i] = [token]
                if entry is not None:
                    logprobs[step.req_ids[i]] = [entry]
        if verify_idx:
            self._verify_drafts(step, logits[len(sample_idx) :], verify_idx, sampled, logprobs)
        return sampled, logprobs, prompt_logprobs

    def _sampling_positions(self, step: StepInputs) -> SamplingPositions:
        """Which requests sample (their last token does) and which check drafts (their last
        1 + drafts tokens do), with the positions of those tokens in the step."""
        sample_idx, sample_pos, verify_idx, verify_pos = [], [], [], []
        token_start = 0
        for i, (row, c, q, d) in enumerate(zip(step.rows, step.num_computed, step.query_lens, step.num_drafts)):
            if self.input_batch.states[row].pooling_params is not None:
                pass  # an embedding request: pooled, never sampled
            elif d:
                verify_idx.append(i)
                verify_pos.extend(range(token_start + q - 1 - d, token_start + q))
            elif c + q >= self.input_batch.num_tokens[row]:
                sample_idx.append(i)
                sample_pos.append(token_start + q - 1)
            token_start += q
        return SamplingPositions(sample_idx, verify_idx, sample_pos + verify_pos)

    def _output_rows(self, step: StepInputs, positions: list[int]) -> list[int] | None:
        """The rows of the step whose final hidden state is read, where the others can be
        left out: not when an embedding request pools them or prompt logprobs read them, nor
        under an adapter (its token mapping covers every row); None: all rows."""
        if len(positions) == len(step.input_ids):
            return None
        for row, c in zip(step.rows, step.num_computed):
            state = self.input_batch.states[row]
            if state.pooling_params is not None or state.lora_request is not None:
                return None
            if state.sampling_params.prompt_logprobs is not None and c < state.num_prompt_tokens - 1:
                return None
        return positions

    def _pool(self, step: StepInputs, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Embedding requests: this step's hidden states of each one's prompt go into its
        pooled vector (across prompt chunks); the vectors of those whose prompt is done."""
        pooled: dict[str, torch.Tensor] = {}
        token_start = 0
        for rid, row, c, q in zip(step.req_ids, step.rows, step.num_computed, step.query_lens):
            state = self.input_batch.states[row]
            params = state.pooling_params
            if params is not None:
                rows = hidden[token_start : token_start + q].float()
                if params.pooling_type == "MEAN":
                    total = rows.sum(0)
                    state.pooled_sum = total if state.pooled_sum is None else state.pooled_sum + total
                elif params.pooling_type == "CLS" and c == 0:
                    state.pooled_first = rows[0]
                if c + q >= state.num_prompt_tokens and params.score_token_ids:
                    pooled[rid] = self._relevance(hidden[token_start + q - 1], params).cpu()
                elif c + q >= state.num_prompt_tokens:
                    vector = {"MEAN": lambda: state.pooled_sum / state.num_prompt_tokens,
                              "CLS": lambda: state.pooled_first, "LAST": lambda: rows[-1]}[params.pooling_type]()
                    vector = vector[: params.dimensions]  # Matryoshka: the first dimensions
                    if params.normalize:
                        vector = torch.nn.functional.normalize(vector, dim=-1)
                    pooled[rid] = vector.cpu()
            token_start += q
        return pooled

    def _relevance(self, last_hidden: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """A reranker's score, [1]: the "yes" logit minus the "no" logit at the prompt's last
        token (vLLM's from_2_way_softmax), through a sigmoid if asked (= P(yes) of the two)."""
        no, yes = self.model.compute_logits(last_hidden[None])[0, list(params.score_token_ids)].float()
        score = (yes - no)[None]
        return torch.sigmoid(score) if params.normalize else score

    def _prompt_logprobs(self, step: StepInputs, hidden: torch.Tensor,
                         sample_idx: list[int]) -> dict[str, list[LogprobsEntry]]:
        """Gathers the prompt logprobs of this step's prompt tokens (position p predicts
        prompt token p + 1); hands them over for the requests whose prompt is done."""
        batch = self.input_batch
        token_start = 0
        for row, c, q in zip(step.rows, step.num_computed, step.query_lens):
            state = batch.states[row]
            last = min(c + q, state.num_prompt_tokens - 1)
            if state.sampling_params.prompt_logprobs is not None and last > c:
                count = last - c
                lp = torch.log_softmax(self.model.compute_logits(hidden[token_start : token_start + count]).float(),
                                       dim=-1)
                targets = batch.token_ids[row, c + 1 : c + 1 + count]
                n = state.sampling_params.prompt_logprobs
                state.prompt_logprobs.extend(logprobs_entry(lp[j], int(targets[j]), n) for j in range(count))
            token_start += q
        done = {}
        for i in sample_idx:
            state = batch.states[step.rows[i]]
            if state.sampling_params.prompt_logprobs is not None and state.num_output_tokens == 0:
                done[step.req_ids[i]] = state.prompt_logprobs
        return done

    def _verify_drafts(self, step: StepInputs, logits: torch.Tensor, verify_idx: list[int],
                       sampled: list[list[int]], logprobs: dict[str, list[LogprobsEntry]]) -> None:
        """The tokens of the requests that checked drafts (logits: 1 + drafts rows each);
        recurrent layers are put back to their state after the last kept token."""
        batch = self.input_batch
        rows = [step.rows[i] for i in verify_idx]
        drafts = [batch.token_ids[r, batch.num_tokens[r] : batch.num_tokens[r] + step.num_drafts[i]].tolist()
                  for r, i in zip(rows, verify_idx)]
        row_of_logits = [r for r, d in zip(rows, drafts) for _ in range(len(d) + 1)]
        sampling = build_sampling_batch(batch, row_of_logits, logits.shape[-1], None, self.eos_token_id,
                                        self.generator)
        verified = verify(logits, drafts, sampling)
        restores = []
        for i, row, tokens, entries in zip(verify_idx, rows, verified.token_ids, verified.logprobs):
            sampled[i] = tokens
            if entries:
                logprobs[step.req_ids[i]] = entries
            if step.checkpoints[i] and len(tokens) <= step.num_drafts[i]:  # a draft was refused
                restores.append((step.checkpoints[i][len(tokens) - 1], batch.states[row].state_slot))
        self.inputs.copy_states(restores, self.plan)

    def _record(self, step: StepInputs, sampled: list[list[int]]) -> list[int]:
        """Appends the new tokens to the batch; returns how many of each request's query
        tokens are now in the cache (its query less the refused drafts)."""
        batch = self.input_batch
        kept = []
        for i, (row, c, tokens) in enumerate(zip(step.rows, step.num_computed, sampled)):
            state = batch.states[row]
            kept.append(step.query_lens[i] - (step.num_drafts[i] + 1 - len(tokens) if tokens else 0))
            state.num_computed_tokens = c + kept[-1]
            for token in tokens:
                batch.append_token(row, token)
            state.num_output_tokens += len(tokens)
        return kept

    def _proposes(self, step: StepInputs, i: int, tokens: list[int]) -> bool:
        """Whether the i-th request, which got `tokens` this step, gets drafts for the next."""
        state = self.input_batch.states[step.rows[i]]
        return bool(tokens) and step.propose_drafts and can_verify(state.sampling_params, state.num_output_tokens)
