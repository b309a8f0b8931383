"""Decides, every step, which requests compute how many tokens, and which media go
through the encoder. It never touches a tensor: everything it decides is in a
SchedulerOutput; everything it learns comes back in a ModelRunnerOutput."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from vlmserve.config import SchedulerConfig
from vlmserve.core.encoder_cache_manager import EncoderCacheManager
from vlmserve.core.kv_cache_manager import KVCacheManager
from vlmserve.core.request_queue import WaitingQueue
from vlmserve.core.sched_output import (
    CachedRequestData,
    DraftCounts,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from vlmserve.core.step_plan import StepPlan
from vlmserve.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from vlmserve.structured_output.manager import RequestGrammar

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        encoder_cache_manager: EncoderCacheManager,
    ) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.encoder_cache_manager = encoder_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # to tell the runner next step
        self.num_preemptions = 0
        self.num_needing_last_token = 0  # requests held whose next token reads their last
        self.drafts_seen = False  # a proposer has given drafts (speculative decoding)
        self.drafts = DraftCounts()

    # -- requests in and out --------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.num_needing_last_token += request.needs_its_last_token
        self.waiting.add(request)

    def finish_requests(self, request_ids: str | list[str], status: RequestStatus) -> None:
        """Ends requests from outside the step loop (abort, stop string, error)."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def has_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def end_scheduled(self, request_ids: list[str], status: RequestStatus,
                      errors: dict[str, str] | None = None) -> list[EngineCoreOutput]:
        """Ends requests of the step about to run (their grammar is complete, or cannot
        follow their answer): the final output of each; the step's result for them is
        dropped."""
        outputs = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            self.finish_requests(rid, status)
            outputs.append(EngineCoreOutput(
                rid, [], status.finish_reason(), error=(errors or {}).get(rid),
                num_cached_tokens=max(request.num_cached_tokens, 0), media_stats=request.media_stats(),
                first_scheduled_time=request.first_scheduled_time))
        return outputs

    def grammars_sampling(self, scheduler_output: SchedulerOutput) -> list[tuple[str, RequestGrammar]]:
        """The requests of a step that sample a token under a grammar (one that has started:
        a thinking model's starts after its reasoning), in step order."""
        found = []
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests[rid]
            if request.grammar is not None and request.num_computed_tokens >= request.num_tokens \
                    and request.grammar.masks_next():
                found.append((rid, request.grammar))
        return found

    def reset_caches(self) -> None:
        """Forgets the prefix and encoder caches (no request may be running)."""
        self.kv_cache_manager.reset_prefix_cache()
        self.encoder_cache_manager.reset()
        self.encoder_cache_manager.get_freed_mm_hashes()  # the runner clears all of its outputs

    # -- the step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(self.config.max_num_batched_tokens, self.config.encoder_compute_budget)
        self._schedule_running(plan)
        if not plan.preempted:  # no new request while memory runs out
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Running requests first, in order: decodes and the next chunks of prefills."""
        for request in list(self.running):
            if plan.token_budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new, to_encode, cost = self._plan_tokens(request, request.num_computed_tokens, plan)
            if num_new == 0:
                self._cancel_encoder_inputs(request, to_encode, plan)
                continue
            drafts = self._drafts_that_fit(request, num_new, plan.token_budget)
            if drafts and self.kv_cache_manager.take_draft_checkpoints(request, len(drafts)) is None:
                drafts = []  # no state slot free for them: decode one token
            blocks = self._allocate_or_preempt(request, num_new + len(drafts), to_encode, plan)
            if blocks is None:  # the request preempted itself: nothing more fits
                break
            plan.add(request, num_new + len(drafts), to_encode, cost, blocks)
            if drafts:
                plan.drafts[request.request_id] = drafts

    def _drafts_that_fit(self, request: Request, num_new: int, token_budget: int) -> list[int]:
        """The request's drafts this step checks: only when it decodes its last token and
        not too many requests run, and only as many as the token budget, the context and
        max_tokens leave room for (a step emits at most one token more than it checks)."""
        if not request.draft_token_ids or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        if not self._drafting():
            return []
        room = min(token_budget - 1, self.config.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return request.draft_token_ids[: max(room, 0)]

    def _drafting(self) -> bool:
        """Drafts are checked unless more requests run than max_running_for_drafts."""
        limit = self.config.max_running_for_drafts
        return limit is None or len(self.running) <= limit

    def _allocate_or_preempt(self, request: Request, num_new: int, to_encode: list[int],
                             plan: StepPlan) -> list[list[int]] | None:
        """KV slots for num_new more tokens, preempting the least important running
        request (the latest of the lowest priority) until they fit; None if that was
        the request itself."""
        while True:
            blocks = self.kv_cache_manager.allocate_slots(request, num_new,
                                                          num_lookahead_tokens=self.config.num_lookahead_tokens)
            if blocks is not None:
                return blocks
            victim = max(self.running, key=lambda r: r.scheduling_key)
            self._preempt_during_step(victim, plan)
            if victim is request:
                self._cancel_encoder_inputs(request, to_encode, plan)
                return None

    def _preempt_during_step(self, victim: Request, plan: StepPlan) -> None:
        """Preempts a running request; if this step had scheduled it already, its tokens,
        encoder budget and encoder inputs are given back."""
        if victim.request_id in plan.num_scheduled:
            self._cancel_encoder_inputs(victim, plan.remove(victim), plan)
            # its blocks were registered for tokens this step no longer computes
            self.kv_cache_manager.forget_uncomputed(victim)
        self.running.remove(victim)
        self._preempt(victim)
        plan.preempted.append(victim)

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Waiting requests, by priority then arrival, each after a prefix-cache lookup. A
        request whose LoRA adapter would be one more than the slots hold waits (the
        others go ahead of it) until a running adapter's requests are done; so does, for a
        step, one whose prefix another request computes in this step (a hybrid model's
        state is shared only once the step ends: computing it twice would waste a prompt)."""
        held_back = []
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self._lora_fits(request):
                held_back.append(self.waiting.pop())
                continue
            hit = self.kv_cache_manager.find_prefix_hit(request)
            if self.kv_cache_manager.longer_hit_next_step(request, hit):
                held_back.append(self.waiting.pop())
                continue
            num_new, to_encode, cost = self._plan_tokens(request, hit.num_tokens, plan)
            blocks = self.kv_cache_manager.allocate_slots(request, num_new, hit, self.config.num_lookahead_tokens) \
                if num_new else None
            if blocks is None:
                self._cancel_encoder_inputs(request, to_encode, plan)
                break
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.time()
            request.num_computed_tokens = hit.num_tokens
            if request.num_cached_tokens < 0:  # its first time: a preempted request counts once
                request.num_cached_tokens = hit.num_tokens
                self.kv_cache_manager.record_hit(request, hit)
            plan.add(request, num_new, to_encode, cost, blocks, new=True)
        for request in held_back:
            self.waiting.add(request)

    def _lora_fits(self, request: Request) -> bool:
        lora = request.lora_request
        if lora is None:
            return True
        running = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return lora.lora_int_id in running or len(running) < self.config.max_loras

    def _plan_tokens(self, request: Request, num_computed: int, plan: StepPlan) -> tuple[int, list[int], int]:
        """How many tokens the request computes this step, which of its media go through
        the encoder for them, and the encoder budget that takes."""
        if num_computed >= request.num_prompt_tokens and \
                request.num_tokens + request.num_output_placeholders - num_computed == 1:
            # a decode (its media are all behind it): one token, unless the one in flight is its
            # last (or, pipelined, one is in flight at all)
            if request.num_output_placeholders and (self.config.sit_out_in_flight or
                                                    self._ends_with_placeholder(request)):
                return 0, [], 0
            return (1 if plan.token_budget > 0 and num_computed < self.config.max_model_len else 0), [], 0
        num_new = self._num_new_tokens(request, num_computed, plan.token_budget)
        if num_new == 0 or not request.has_encoder_inputs:
            return num_new, [], 0
        return self._schedule_encoder_inputs(request, num_computed, num_new, plan)

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        kv = self.kv_cache_manager
        total = sum(plan.num_scheduled.values())
        assert total <= self.config.max_num_batched_tokens
        state_restores, state_saves = kv.take_state_copies()
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                mm_features=r.mm_features,
                sampling_params=r.sampling_params,
                block_ids=kv.block_ids(r.request_id),
                state_slot=kv.state_slot(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
                mrope_positions=r.mrope_positions,
                mrope_delta=r.mrope_delta,
                output_token_ids=list(r.output_token_ids),
                lora_request=r.lora_request,
                pooling_params=r.pooling_params,
            )
            for r in plan.new
        ]
        cached = CachedRequestData()
        for r in plan.running:
            cached.req_ids.append(r.request_id)
            cached.new_block_ids.append(plan.new_block_ids[r.request_id])
            cached.num_computed_tokens.append(r.num_computed_tokens)
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=total,
            scheduled_encoder_inputs=plan.encoder_inputs,
            encoder_outputs_loaded=plan.encoder_loads,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in plan.preempted},
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            state_restores=state_restores,
            state_saves=state_saves,
            scheduled_draft_tokens=plan.drafts,
            draft_checkpoints=kv.draft_checkpoints(),
            propose_drafts=self._drafting(),
            kv_transfers=kv.take_kv_transfers(),
        )
        self.finished_req_ids = set()
        # progress is counted at schedule time, so the next step can be planned at once; a
        # request whose known tokens (and placeholders) are all computed now samples one
        for rid, n in plan.num_scheduled.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            if request.pooling_params is None and \
                    request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
                output.sampling_req_ids.add(rid)
        return output

    def _num_new_tokens(self, request: Request, num_computed: int, token_budget: int) -> int:
        if request.num_output_placeholders and self._ends_with_placeholder(request):
            return 0  # the token in flight is its last: no step for it
        num_new = request.num_tokens + request.num_output_placeholders - num_computed
        if not self.config.enable_chunked_prefill and num_new > token_budget:
            return 0
        # the last position fed to the model must stay inside the context
        chunk = self.config.max_chunk_tokens or num_new
        num_new = max(min(num_new, token_budget, chunk, self.config.max_model_len - num_computed), 0)
        end = self.kv_cache_manager.chunk_end(request, num_computed, num_computed + num_new)
        for f in request.mm_features:
            if f.bidirectional and f.offset < end < f.end:
                # its first tokens would need keys of its last ones: stop before it (or, when
                # a prefix hit ended inside it, wait for a budget that takes the rest at once)
                end = max(f.offset, num_computed)
                break
        return end - num_computed

    def _ends_with_placeholder(self, request: Request) -> bool:
        """Whether the request's token in flight is its last by length (max_tokens, the
        context): known before the token is."""
        produced = request.num_output_tokens + request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        return (max_tokens is not None and produced >= max_tokens) or \
            request.num_tokens + request.num_output_placeholders >= self.config.max_model_len

    def can_schedule_ahead(self) -> bool:
        """Whether the next step can be scheduled while the last one is still sampling: not
        while a request's next token depends on the one in flight (see
        Request.needs_its_last_token; counted over every request held, running or not)."""
        return not self.num_needing_last_token

    def _schedule_encoder_inputs(
        self, request: Request, num_computed: int, num_new: int, plan: StepPlan
    ) -> tuple[list[int], int, int]:
        """Media whose placeholders this step's token range reaches and whose encoder
        output is not cached, and the encoder budget they take. If one does not fit the
        budget or the cache, the step stops just before its placeholder."""
        to_encode: list[int] = []
        cost = 0
        end = num_computed + num_new
        for i, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.end <= num_computed:
                continue  # already in the KV cache
            if any(request.mm_features[j].mm_hash == feature.mm_hash for j in to_encode):
                continue  # the same picture twice in one request is encoded once
            if feature.mm_hash in plan.encoding:
                # another request of this step sends it to the encoder; this one names
                # that run too, so it still happens if the other one leaves the step
                self.encoder_cache_manager.allocate(request, i)
                to_encode.append(i)
                request.media_sources.setdefault(i, "encoder_cache")
                continue
            if self.encoder_cache_manager.check_and_update_cache(request, i):
                request.media_sources.setdefault(i, "encoder_cache")
                continue
            shared = self._shared_encoder_output(request, i)
            if shared is None and not self.encoder_cache_manager.can_allocate(request, i, plan.encoder_budget - cost):
                num_new = max(feature.offset - num_computed, 0)
                break
            self.encoder_cache_manager.allocate(request, i)
            plan.encoding.add(feature.mm_hash)
            to_encode.append(i)
            if shared is not None:  # another engine encoded it: loaded, not encoded (no encoder budget)
                plan.encoder_loads[feature.mm_hash] = shared
                request.media_sources[i] = "encoder_cache"
            else:
                cost += feature.length
                request.media_sources[i] = "encoded"
        return num_new, to_encode, cost

    def _shared_encoder_output(self, request: Request, input_id: int) -> bytes | None:
        """A medium's encoder output from the KV connector's store, where the encoder cache has
        room for it."""
        feature = request.mm_features[input_id]
        shared = self.kv_cache_manager.shared_encoder_output(feature.mm_hash)
        if shared is None or not self.encoder_cache_manager.can_allocate(request, input_id, feature.length):
            return None
        return shared

    def _cancel_encoder_inputs(self, request: Request, input_ids: list[int], plan: StepPlan) -> None:
        """Undoes _schedule_encoder_inputs for a request that did not make it into the step."""
        for j in input_ids:
            if self.encoder_cache_manager.deallocate(request, j):
                plan.encoding.discard(request.mm_features[j].mm_hash)
                plan.encoder_loads.pop(request.mm_features[j].mm_hash, None)
        self.encoder_cache_manager.free(request)  # references taken on cache hits

    def discard_step(self, scheduler_output: SchedulerOutput) -> None:
        """After a step whose execution failed: its requests end with an error, and
        nothing it was to compute (KV blocks, recurrent-state snapshots, encoder outputs)
        can be hit by a later request."""
        computed_before, encoded = {}, set()
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None:
                continue
            computed_before[rid] = request.num_computed_tokens - n
            encoded |= {request.mm_features[j].mm_hash for j in scheduler_output.scheduled_encoder_inputs.get(rid, [])}
        self.kv_cache_manager.discard_step(computed_before)
        self.finish_requests(list(scheduler_output.num_scheduled_tokens), RequestStatus.FINISHED_ERROR)
        for mm_hash in encoded:
            self.encoder_cache_manager.discard(mm_hash)

    def requeue_step(self, scheduler_output: SchedulerOutput, failing: set[str]) -> None:
        """After the step before this one failed (asynchronous scheduling: this one was
        queued behind it and ran on what it left): this step's progress is taken back, and
        its requests that are not `failing` with the earlier step start again (preempted);
        nothing it computed (KV blocks, encoder outputs) can be hit later."""
        computed_before, encoded = {}, set()
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                request.num_computed_tokens -= n
            if rid in scheduler_output.sampling_req_ids and request.num_output_placeholders:
                request.num_output_placeholders -= 1
            computed_before[rid] = request.num_computed_tokens
            encoded |= {request.mm_features[j].mm_hash for j in scheduler_output.scheduled_encoder_inputs.get(rid, [])}
        self.kv_cache_manager.discard_step(computed_before)
        for rid in computed_before:
            request = self.requests[rid]
            if rid not in failing and request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._preempt(request)
        for mm_hash in encoded:
            self.encoder_cache_manager.discard(mm_hash)

    def _preempt(self, request: Request) -> None:
        logger.debug("preempting %s", request.request_id)
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        if request.grammar is not None:
            request.grammar.release()  # a fresh matcher replays the tokens on resumption
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight still comes back, and is kept
        request.draft_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request)

    # -- results ----------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        self.kv_cache_manager.commit_step()
        # drafts to settle: once any have come, every step (a request's old ones are replaced)
        self.drafts_seen = self.drafts_seen or bool(runner_output.draft_token_ids)
        drafting = self.drafts_seen
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue  # aborted while the step ran
            if rid in scheduler_output.sampling_req_ids and request.num_output_placeholders:
                request.num_output_placeholders -= 1
            try:
                if drafting:
                    self._settle_drafts(request, scheduler_output, runner_output)
                output = self._update_request(request, runner_output)
            except Exception as e:  # a bug in one request's bookkeeping fails that request only
                logger.exception("request %s failed while its step was recorded", rid)
                self.finish_requests(rid, RequestStatus.FINISHED_ERROR)
                output = EngineCoreOutput(rid, [], FinishReason.ERROR, error=f"internal error: {type(e).__name__}: {e}")
            if output is not None:
                outputs.append(output)
        return outputs

    def _settle_drafts(self, request: Request, scheduler_output: SchedulerOutput,
                       runner_output: ModelRunnerOutput) -> None:
        """Progress was counted for every draft at schedule time: the refused ones are
        taken back (their KV slots are written again by the next step). The proposer's
        new drafts replace the old ones."""
        rid = request.request_id
        drafts = scheduler_output.scheduled_draft_tokens.get(rid)
        if drafts:
            emitted = len(runner_output.sampled_token_ids[runner_output.req_id_to_index[rid]])
            request.num_computed_tokens -= len(drafts) + 1 - emitted
            self.drafts.add(len(drafts), emitted - 1)
        request.draft_token_ids = runner_output.draft_token_ids.get(rid, [])

    def _update_request(self, request: Request, runner_output: ModelRunnerOutput) -> EngineCoreOutput | None:
        rid = request.request_id
        if request.mm_features:
            self._free_finished_encoder_inputs(request)
        index = runner_output.req_id_to_index[rid]
        new_token_ids = runner_output.sampled_token_ids[index]
        prompt_logprobs = runner_output.prompt_logprobs.get(rid)
        pooled = runner_output.pooler_output.get(rid)
        if pooled is not None:  # an embedding request is done with its prompt
            request.status = RequestStatus.FINISHED_STOPPED
        elif not new_token_ids and prompt_logprobs is None:
            return None  # a prefill chunk that ended inside the prompt
        kept: list[int] = []
        for token_id in new_token_ids:
            request.append_output_token_ids(token_id)
            kept.append(token_id)
            if request.grammar is not None and not request.grammar.accept(token_id):
                raise RuntimeError(f"the grammar refused token {token_id} that its own mask allowed")
            if self._check_stop(request):
                break
        logprobs = runner_output.logprobs.get(rid)
        output = EngineCoreOutput(
            request_id=rid,
            new_token_ids=kept,
            finish_reason=request.get_finished_reason(),
            stop_reason=request.stop_reason,
            new_logprobs=logprobs[: len(kept)] if logprobs is not None else [],
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_time=request.first_scheduled_time,
            pooled=pooled,
        )
        if request.is_finished():
            output.media_stats = request.media_stats()
            if request in self.running:
                self.running.remove(request)
            else:  # preempted while its last step ran (asynchronous scheduling): it waits
                self.waiting.remove(request)
            self._free_request(request)
        return output

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        num_output = request.num_output_tokens
        if token in request.stop_token_set and num_output >= params.min_tokens:
            request.status = RequestStatus.FINISHED_STOPPED
            if token != request.eos_token_id or params.ignore_eos:
                request.stop_reason = token
            return True
        if params.max_tokens is not None and num_output >= params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if request.num_tokens >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if request.grammar is not None and request.grammar.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED  # the grammar took a stop token
            return True
        return False

    def _free_finished_encoder_inputs(self, request: Request) -> None:
        """Drops the request's reference on media now wholly in its KV cache."""
        done = request.num_computed_tokens
        needed_later = {f.mm_hash for f in request.mm_features if f.end > done}
        for i, feature in enumerate(request.mm_features):
            if feature.end <= done and feature.mm_hash not in needed_later:
                self.encoder_cache_manager.free_encoder_input(request, i)

    def _free_request(self, request: Request) -> None:
        if request.grammar is not None:
            request.grammar.release()
        self.encoder_cache_manager.free(request)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        self.num_needing_last_token -= request.needs_its_last_token
        del self.requests[request.request_id]

    # -- views ---------------------------------------------------------------------------
    def describe_waiting(self) -> str:
        head = self.waiting.peek() if self.waiting else None
        return (f"{len(self.running)} running, {len(self.waiting)} waiting, {self.kv_cache_manager.num_free_blocks} "
                f"free KV blocks; first waiting: {head!r}")

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        enc = self.encoder_cache_manager.stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            group_kinds=kv.group_kinds(),
            blocks_in_use=kv.blocks_in_use(),
            num_free_blocks=kv.num_free_blocks,
            kv_usage=kv.usage,
            prefix_cache_queries=list(kv.stats.queries),
            prefix_cache_hits=list(kv.stats.hits),
            state_slots_in_use=kv.state_slots_in_use(),
            state_snapshots=kv.num_state_snapshots(),
            encoder_cache_hits=enc.hits,
            encoder_cache_misses=enc.misses,
            encoder_cache_entries=self.encoder_cache_manager.num_entries,
            encoder_cache_entries_in_use=self.encoder_cache_manager.num_referenced(),
            encoder_cache_tokens=self.encoder_cache_manager.num_tokens,
            num_preemptions=self.num_preemptions,
            num_drafts=self.drafts.checks,
            num_draft_tokens=self.drafts.tokens,
            num_accepted_tokens=sum(self.drafts.kept_at),
            num_accepted_per_position=list(self.drafts.kept_at),
            **kv.connector_stats(),
        )
