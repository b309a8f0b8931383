"""Executes one scheduled step: applies the scheduler's deltas to the persistent batch,
runs the encoder for the media it was told to, builds the model inputs, runs the model,
samples. It makes no scheduling decision: it does what the SchedulerOutput says."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from vlmserve.config import SchedulerConfig
from vlmserve.core.kv_cache_spec import AttentionSpec, KVCacheConfig, KVCacheGroup, MambaSpec, SlidingWindowSpec
from vlmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vlmserve.kernels import KernelTable, use_kernels
from vlmserve.kernels.attention import kv_cache_shapes
from vlmserve.lora.adapter import LoRAAdapter
from vlmserve.lora.request import LoRARequest
from vlmserve.phase_timer import PhaseTimer
from vlmserve.structured_output.manager import GrammarBitmask
from vlmserve.worker.cuda_graphs import CudaGraphs, GraphInputs
from vlmserve.worker.device_queue import DeviceQueue
from vlmserve.worker.encoder_runner import EncoderRunner
from vlmserve.worker.kv_connector_worker import KVConnectorWorker, make_connector_worker
from vlmserve.worker.input_batch import CachedRequestState, InputBatch
from vlmserve.worker.lora_slots import LoRASlots
from vlmserve.worker.pooler import pool
from vlmserve.worker.prepared_step import DeviceOutput, PreparedStep, SamplingPositions, VerifyInputs
from vlmserve.worker.prompt_logprobs import gather_prompt_logprobs, prompt_logprob_rows
from vlmserve.worker.proposer import Proposer
from vlmserve.worker.rejection_sampler import can_verify, verify
from vlmserve.worker.sampler import build_sampling_batch, sample
from vlmserve.worker.staging import Staging
from vlmserve.worker.step_inputs import LayerPlan, StepInputBuilder, StepInputs


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
        queue: DeviceQueue | None = None,
    ) -> None:
        """queue: where the steps' device work runs (default: where they are submitted)."""
        self.model = model
        self.queue = queue or DeviceQueue()
        self.lora = lora  # the adapters' slots, where LoRA is on
        self.kernels = kernels  # every op the model calls in this runner's steps
        self.timer = timer or PhaseTimer()
        self.eos_token_id = eos_token_id
        self.kv_cache_config = kv_cache_config
        self.device = torch.device(device)
        self.max_model_len = scheduler_config.max_model_len
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.vocab_size = model.text_config.vocab_size
        self.block_size = kv_cache_config.groups[0].spec.block_size
        # the layers this rank holds (split into pipeline stages: its stage's), in the scheduler's groups
        held = model.layers_held()
        self.groups = [KVCacheGroup(g.spec, tuple(i for i in g.layer_ids if i in held)) for g in kv_cache_config.groups]
        self.kv_caches = self._allocate_kv_caches()
        self.kv_connector = self._kv_connector()
        self._device_failed = False  # the last step's device work raised: the next one keeps nothing
        # the attention groups hold block tables (in the order the scheduler lists them);
        # recurrent groups use each request's one state slot
        attention_groups = [g for g in self.groups if isinstance(g.spec, AttentionSpec)]
        max_blocks = [-(-self.max_model_len // self.block_size)] * len(attention_groups)
        self.input_batch = InputBatch(scheduler_config.max_num_seqs, self.max_model_len, max_blocks)
        self.inputs = StepInputBuilder(self.input_batch, Staging(self.device), self.block_size, self.device,
                                       model.bidirectional_media)
        # the last step's sampled tokens, on the device (read by the device work of the
        # next step), and each sampling request's index among them (read by its host prep)
        self._sampled_on_device: torch.Tensor | None = None
        self._sampled_index: dict[str, int] = {}
        self.plan = LayerPlan("target", self.kv_caches, [
            (g.layer_ids, a, g.spec.sliding_window if isinstance(g.spec, SlidingWindowSpec) else None)
            for a, g in enumerate(attention_groups)],
            [layer for g in self.groups if isinstance(g.spec, MambaSpec) for layer in g.layer_ids])
        self.proposer = proposer  # speculative decoding's drafts, where it is on
        if proposer is not None:
            proposer.bind(self.input_batch, self.inputs)
        self.encoder = EncoderRunner(model, lora, proposer)
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
        slot_of = self.kv_cache_config.tensor_slot_of_layer()
        layers = [layer for g in self.groups if isinstance(g.spec, AttentionSpec) for layer in g.layer_ids]
        slots = {}
        for j in sorted({slot_of[layer] for layer in layers}):  # those of the layers held here
            # zero-filled (attention reads whole blocks, masked past each sequence's end); on
            # the CPU by the kernel as each page is first used, not all at start
            slots[j] = tuple(self.kernels.zeros_streamed(shape, dtype, self.device) for shape in (k_shape, v_shape))
        caches.update({layer: slots[slot_of[layer]] for layer in layers})
        return caches

    def _kv_connector(self) -> KVConnectorWorker | None:
        """The KV connector's side here (a host tier, a shared pool), over every attention cache."""
        layers = [layer for g in self.groups if isinstance(g.spec, AttentionSpec) for layer in g.layer_ids]
        tensors = list({id(t): t for layer in layers for t in self.kv_caches[layer]}.values())
        return make_connector_worker(self.kv_cache_config, tensors) if tensors else None

    def kv_connector_seconds(self) -> dict[str, float]:
        """Seconds the KV connector's copies took here: save, load (cumulative)."""
        return dict(self.kv_connector.seconds) if self.kv_connector else {"save": 0.0, "load": 0.0}

    def shutdown(self) -> None:
        self.queue.close()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def load_lora(self, lora: LoRARequest) -> LoRAAdapter:
        """Reads an adapter into memory ahead of its first step (LoRAError if it cannot), in
        order with the device work (which fills the slots from what it reads)."""
        if self.lora is None:
            raise RuntimeError("a LoRA request reached an engine without LoRA")
        return self.queue.call(lambda: self.lora.load(lora))

    def add_lora(self, lora: LoRARequest, adapter: LoRAAdapter) -> None:
        """Keeps an adapter another rank read, in order with the device work."""
        self.queue.call(lambda: self.lora.add(lora, adapter))

    def clear_encoder_cache(self) -> None:
        self.queue.call(self.encoder.clear)

    @property
    def encoder_runs(self) -> int:
        """Media items encoded so far."""
        return self.encoder.runs

    # -- the step -----------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput, grammar: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Runs a step and waits for it."""
        return self.submit(so, grammar).result()

    def submit(self, so: SchedulerOutput, grammar: GrammarBitmask | None = None) -> PendingStep:
        """Prepares a step on the host (the batch's bookkeeping, the inputs, the sampling
        settings) and queues its device work behind the step in flight, if any: the host
        may prepare the next one while it runs. Its tokens come back by `result()`."""
        with self.timer.phase("runner: inputs"), torch.inference_mode():
            self._update_states(so)
            if so.total_num_scheduled_tokens == 0:
                if so.kv_transfers:  # blocks evicted by a request preempted in the same step: still kept
                    self.queue.submit(lambda: self.kv_connector.before_forward(so.kv_transfers))
                return PendingStep(self, None, None)
            prepared = self._prepare(so, grammar)
        if not self.queue.threaded:  # the device work runs here and now: timed as such
            return PendingStep(self, prepared, self.queue.submit(lambda: self._run_on_device(prepared)))
        with self.timer.phase("runner: launch"):
            return PendingStep(self, prepared, self.queue.submit(lambda: self._run_on_device(prepared)))

    def _prepare(self, so: SchedulerOutput, grammar: GrammarBitmask | None) -> PreparedStep:
        """Everything the step's device work reads of the host's batch, taken now."""
        self.inputs.staging.next_step()
        batch = self.input_batch
        step = self.inputs.prepare(so, self._sampled_index)
        rows = step.rows_array
        read = self._sampling_positions(step)
        graph = self.cuda_graphs.prepare(step) if self.cuda_graphs is not None and self.cuda_graphs.fits(step) \
            else None
        output_rows = None if graph is not None else self._output_rows(step, read.positions)
        pooled = np.flatnonzero(batch.pooling[rows]).tolist()
        prepared = PreparedStep(
            so=so, step=step, read=read, graph=graph,
            ctx=None if graph is not None else self.inputs.forward_context(step, self.plan, output_rows=output_rows),
            merge=[] if graph is not None else self.inputs.merge_plan(step),
            encode=self.encoder.plan(so, batch),
            encode_loads=self._encoder_loads(so, batch),
            loras=[batch.states[row].lora_request for row in step.rows] if self.lora else None,
            sample_req_ids=[step.req_ids[i] for i in read.sample_idx],
            pooling=[(i, batch.states[step.rows[i]]) for i in pooled],
            prompt_logprobs=prompt_logprob_rows(batch, step, read),
        )
        if read.sample_idx:
            prepared.sampling = build_sampling_batch(batch, rows[read.sample_idx], self.vocab_size, grammar,
                                                     self.eos_token_id, self.generator, self.inputs.staging.upload)
        if read.verify_idx:
            prepared.verify = self._verify_inputs(step, read.verify_idx)
        # the next step's placeholders: where this step's tokens will be among its sampled ones
        self._sampled_index = {rid: j for j, rid in enumerate(prepared.sample_req_ids)}
        return prepared

    def _encoder_loads(self, so: SchedulerOutput, batch: InputBatch) -> dict[str, tuple[bytes, int]]:
        """The media outputs the step loads from the KV connector, each with its rows."""
        if not so.encoder_outputs_loaded:
            return {}
        features = [batch.states[batch.index_of[rid]].mm_features[i]
                    for rid, ids in so.scheduled_encoder_inputs.items() for i in ids]
        rows = {f.mm_hash: f.length for f in features}
        return {h: (data, rows[h]) for h, data in so.encoder_outputs_loaded.items()}

    def _run_on_device(self, p: PreparedStep) -> DeviceOutput:
        """The step's device work, in order after the steps before it: the encoder, the
        forward, sampling; the sampled tokens stay on the device for the next step."""
        failed_before, self._device_failed = self._device_failed, True  # until this step's work is done
        out = self._device_work(p, failed_before)
        self._device_failed = False
        return out

    def _device_work(self, p: PreparedStep, failed_before: bool) -> DeviceOutput:
        timer = PhaseTimer(self.timer.enabled)  # this thread's: merged in by the host with the output
        with use_kernels(self.kernels), torch.inference_mode():
            so, step = p.so, p.step
            if so.kv_transfers:
                with timer.phase("device: KV connector copies"):
                    self.kv_connector.before_forward(so.kv_transfers)
            with timer.phase("device: encoder"):
                loaded = self.kv_connector.encoder_outputs(p.encode_loads) if p.encode_loads else None
                made = self.encoder.run(p.encode, so.free_encoder_mm_hashes, loaded)
                if made and self.kv_connector is not None and not failed_before:
                    self.kv_connector.encoder_outputs_made(made)
            with timer.phase("device: forward"):
                self.inputs.fill_placeholders(step, self._sampled_on_device)
                hidden = self._forward(p)
            if so.kv_transfers.saves_after and not failed_before:  # a step after a failed one ran on what it left
                with timer.phase("device: KV connector copies"):
                    self.kv_connector.after_forward(so.kv_transfers)
        out = DeviceOutput(pooled={}, phases=timer.seconds, hidden=hidden)
        if self.model.stage.size > 1:
            # split into pipeline stages: the last one's output is on its way here; the step
            # is sampled when its result is taken, and this stage may take the next meanwhile
            return out
        self._sample_on_device(p, out)
        return out

    def _sample_on_device(self, p: PreparedStep, out: DeviceOutput) -> None:
        """The step's pooled outputs, tokens and logprobs from its final hidden states."""
        timer = PhaseTimer(self.timer.enabled)
        with use_kernels(self.kernels), torch.inference_mode(), timer.phase("device: sample"):
            self.model.stage.wait_oldest()  # the last stage's output (where split into stages)
            hidden, out.hidden = out.hidden, None
            out.pooled = pool(self.model, p, hidden)
            # the forward gave only the rows read where output_rows said so
            read = p.read
            read_hidden = None if not read.positions else \
                hidden if p.ctx is None or p.ctx.output_rows is not None else hidden[read.positions]
            self._sample(p, read_hidden, hidden, out)
            self._sampled_on_device = out.sampled
            if out.sampled is not None and self.device.type == "cuda":
                out.sampled_host = out.sampled.to("cpu", non_blocking=True)
                out.ready = torch.cuda.Event()
                out.ready.record()
        for phase, seconds in timer.seconds.items():
            out.phases[phase] = out.phases.get(phase, 0.0) + seconds

    def _forward(self, p: PreparedStep) -> torch.Tensor:
        so, step = p.so, p.step
        self.inputs.copy_states(so.state_restores, self.plan)
        if self.lora:
            self.lora.set_tokens(p.loras, step.query_lens)
        try:
            if p.graph is not None:
                hidden = self.cuda_graphs.replay(p.graph, step)
            else:  # split into pipeline stages, the first one's embeddings reach the others as hidden states
                embeds = self.inputs.embed(self.model, step, p.ctx, p.merge, self.encoder.cache) \
                    if self.model.stage.is_first else None
                hidden = self.model.forward(embeds, step.positions, p.ctx)
        finally:
            if self.lora:
                self.lora.clear()
        self.inputs.copy_states(so.state_saves, self.plan)
        return hidden

    def _result(self, p: PreparedStep | None, out: DeviceOutput | None) -> ModelRunnerOutput:
        """The step's tokens on the host: recorded in the batch (by request: rows may have
        moved since), drafts proposed for the next step (speculative decoding)."""
        if p is None:
            return ModelRunnerOutput([], {}, [])
        self.timer.merge(out.phases)
        step, read = p.step, p.read
        tokens: list[int] = []
        if out.sampled is not None:
            if out.ready is not None:
                out.ready.synchronize()
            tokens = (out.sampled_host if out.sampled_host is not None else out.sampled).tolist()
        self._record(p, tokens, out.verified)
        sampled: list[list[int]] = [[] for _ in step.req_ids]
        for i, token in zip(read.sample_idx, tokens):
            sampled[i] = [token]
        for i, accepted in out.verified.items():
            sampled[i] = accepted
        drafts = {}
        if self.proposer:
            with self.timer.phase("runner: drafts"):
                proposing = [i for i, accepted in enumerate(sampled) if self._proposes(step, i, accepted)]
                kept = self._kept(step, sampled)
                # on the device's thread: a draft model runs its forwards there
                drafts = self.queue.call(lambda: self.proposer.propose(p.so, step, kept, proposing))
        return ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(step.req_ids)},
            sampled_token_ids=sampled,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            draft_token_ids=drafts,
            pooler_output=out.pooled,
        )

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for rid in so.finished_req_ids | so.preempted_req_ids:
            batch.remove(rid)
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
                state_slot=new.state_slot,
                lora_request=new.lora_request,
                pooling_params=new.pooling_params,
            )
            batch.add(state, new.prompt_token_ids + new.output_token_ids, new.block_ids, new.num_computed_tokens,
                      len(new.output_token_ids))
        cached = so.scheduled_cached_reqs
        if not cached.req_ids:
            return
        rows = np.fromiter((batch.index_of[rid] for rid in cached.req_ids), np.int64, len(cached.req_ids))
        batch.num_computed[rows] = cached.num_computed_tokens
        for row, block_ids in zip(rows.tolist(), cached.new_block_ids):
            for a, ids in enumerate(block_ids):
                if ids:
                    batch.append_blocks(row, a, ids)

    # -- sampling -------------------------------------------------------------------------
    def _sample(self, p: PreparedStep, read_hidden: torch.Tensor | None, hidden: torch.Tensor,
                out: DeviceOutput) -> None:
        """The tokens of the requests that sample (one each, kept on the device) and of those
        that checked drafts (the kept drafts and one more), their logprobs, and the prompt
        logprobs of the requests whose prompt is done. read_hidden: the final hidden states
        at read.positions; hidden: every row's, when the forward gave them all."""
        read = p.read
        out.prompt_logprobs = gather_prompt_logprobs(self.model, p, hidden)
        logits = self.model.compute_logits(read_hidden) if read_hidden is not None else None
        if read.sample_idx:
            tokens, entries = sample(logits[: len(read.sample_idx)], p.sampling)
            out.sampled = tokens
            for rid, entry in zip(p.sample_req_ids, entries):
                if entry is not None:
                    out.logprobs[rid] = [entry]
        if read.verify_idx:
            self._verify_drafts(p, logits[len(read.sample_idx) :], out)

    def _sampling_positions(self, step: StepInputs) -> SamplingPositions:
        """Which requests sample (their last token does) and which check drafts (their last
        1 + drafts tokens do), with the positions of those tokens in the step."""
        batch, rows = self.input_batch, step.rows_array
        query_lens, drafts = np.asarray(step.query_lens), np.asarray(step.num_drafts)
        ends = np.cumsum(query_lens)
        pooled = batch.pooling[rows]  # an embedding request: pooled, never sampled
        samples = ~pooled & (drafts == 0) & (np.asarray(step.num_computed) + query_lens >= batch.num_tokens[rows])
        sample_idx = np.flatnonzero(samples)
        verify_idx = np.flatnonzero(~pooled & (drafts > 0)).tolist()
        verify_pos = [p for i in verify_idx for p in range(ends[i] - 1 - drafts[i], ends[i])]
        return SamplingPositions(sample_idx.tolist(), verify_idx, (ends[sample_idx] - 1).tolist() + verify_pos)

    def _output_rows(self, step: StepInputs, positions: list[int]) -> list[int] | None:
        """The rows of the step whose final hidden state is read, where the others can be
        left out: not when an embedding request pools them or prompt logprobs read them, nor
        under an adapter (its token mapping covers every row); None: all rows."""
        if len(positions) == len(step.input_ids):
            return None
        batch, rows = self.input_batch, step.rows_array
        reads_prompt = batch.prompt_logprobs[rows] & (np.asarray(step.num_computed) < batch.num_prompt[rows] - 1)
        if (batch.pooling[rows] | reads_prompt).any():
            return None
        if self.lora and any(batch.states[row].lora_request is not None for row in step.rows):
            return None
        return positions

    def _verify_inputs(self, step: StepInputs, verify_idx: list[int]) -> VerifyInputs:
        batch = self.input_batch
        rows = [step.rows[i] for i in verify_idx]
        drafts = [batch.token_ids[r, batch.num_tokens[r] : batch.num_tokens[r] + step.num_drafts[i]].tolist()
                  for r, i in zip(rows, verify_idx)]
        row_of_logits = [r for r, d in zip(rows, drafts) for _ in range(len(d) + 1)]
        sampling = build_sampling_batch(batch, row_of_logits, self.vocab_size, None, self.eos_token_id,
                                        self.generator)
        return VerifyInputs(drafts, sampling, [batch.states[r].state_slot for r in rows])

    def _verify_drafts(self, p: PreparedStep, logits: torch.Tensor, out: DeviceOutput) -> None:
        """The tokens of the requests that checked drafts (logits: 1 + drafts rows each);
        recurrent layers are put back to their state after the last kept token."""
        step, v = p.step, p.verify
        verified = verify(logits, v.drafts, v.sampling)
        restores = []
        for i, slot, tokens, entries in zip(p.read.verify_idx, v.state_slots, verified.token_ids, verified.logprobs):
            out.verified[i] = tokens
            if entries:
                out.logprobs[step.req_ids[i]] = entries
            if step.checkpoints[i] and len(tokens) <= step.num_drafts[i]:  # a draft was refused
                restores.append((step.checkpoints[i][len(tokens) - 1], slot))
        self.inputs.copy_states(restores, self.plan)

    def _record(self, p: PreparedStep, tokens: list[int], verified: dict[int, list[int]]) -> None:
        """Appends the new tokens to the batch, each in its request's row wherever it is now
        (gone if the request finished or was preempted since)."""
        batch = self.input_batch
        if tokens:
            rows = np.fromiter((batch.index_of.get(rid, -1) for rid in p.sample_req_ids), np.int64, len(tokens))
            live = rows >= 0
            batch.append_tokens(rows[live], np.asarray(tokens, dtype=np.int64)[live])
        step = p.step
        for i, accepted in verified.items():  # checked drafts (synchronous steps): the row is there
            row = batch.index_of[step.req_ids[i]]
            batch.num_computed[row] = step.num_computed[i] + step.query_lens[i] - (step.num_drafts[i] + 1 - len(accepted))
            for token in accepted:
                batch.append_token(row, token)
            batch.num_output[row] += len(accepted)

    def _kept(self, step: StepInputs, sampled: list[list[int]]) -> list[int]:
        """How many of each request's query tokens are now in the cache (its query less the
        refused drafts)."""
        return [q - (d + 1 - len(tokens) if tokens else 0)
                for q, d, tokens in zip(step.query_lens, step.num_drafts, sampled)]

    def _proposes(self, step: StepInputs, i: int, tokens: list[int]) -> bool:
        """Whether the i-th request, which got `tokens` this step, gets drafts for the next."""
        row = step.rows[i]
        return bool(tokens) and step.propose_drafts and \
            can_verify(self.input_batch.states[row].sampling_params, int(self.input_batch.num_output[row]))


class PendingStep:
    """A submitted step; `result()` waits for its device work (the time the host waits for
    the device) and returns its output."""

    def __init__(self, runner: ModelRunner, prepared: PreparedStep | None, future: Future | None) -> None:
        self.runner, self.prepared, self.future = runner, prepared, future

    def raise_failure(self) -> None:
        """Raises what the device work raised, if it is done and failed."""
        if self.future is not None and self.future.done() and self.future.exception() is not None:
            raise self.future.exception()

    def result(self) -> ModelRunnerOutput:
        timer = self.runner.timer
        with timer.phase("runner: wait for the device"):
            out = self.future.result() if self.future is not None else None
            if out is not None and out.hidden is not None:  # pipeline stages: sampled now, in order
                self.runner.queue.call(lambda: self.runner._sample_on_device(self.prepared, out))
        with timer.phase("runner: outputs"):
            return self.runner._result(self.prepared, out)
