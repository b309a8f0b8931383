"""Engine-core outputs -> RequestOutputs: incremental detokenization, stop strings,
gathering the n samples of a request, timing."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from vlmserve.core.sched_output import EngineCoreOutput
from vlmserve.outputs import CompletionOutput, LogprobsEntry, RequestMetrics, RequestOutput
from vlmserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# prompt tokens decoded with the first output tokens, so that tokenizers which drop a
# leading space at the start of a decode (SentencePiece) get it right
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Decodes token by token; text is released only once it is complete (a byte-level
    token that ends inside a UTF-8 character shows up as U+FFFD until the rest comes).
    Any tokenizer: two decodes of a short window a token."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def append(self, token_ids: list[int]) -> str:
        out = []
        for token_id in token_ids:
            self.ids.append(token_id)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                out.append(full[len(prefix) :])
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        return "".join(out)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)


class StreamDetokenizer:
    """The same for a fast tokenizer, by the tokenizers library's own streaming decoder
    (`DecodeStream`, in Rust, primed with the prompt's last tokens): the two Python-level
    decodes a token cost 3% of an offline run on the small models."""

    def __init__(self, backend, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.backend = backend
        self.stream = DecodeStream(ids=list(prompt_token_ids[-_CONTEXT_TOKENS:]), skip_special_tokens=skip_special_tokens)

    def append(self, token_ids: list[int]) -> str:
        out = []
        for token_id in token_ids:
            text = self.stream.step(self.backend, token_id)
            if text is not None:
                out.append(text)
        return "".join(out)


def make_detokenizer(tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool
                     ) -> IncrementalDetokenizer | StreamDetokenizer:
    """The streaming decoder where the tokenizer has a Rust backend and decodes nothing
    more than it (transformers' clean-up of spaces around punctuation is not in it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return StreamDetokenizer(backend, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)


@dataclass
class _Sample:
    """One of the n completions of a request (one engine-core request)."""

    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | StreamDetokenizer
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # what the last output gave (RequestOutputKind.DELTA: the next gives what came after)
    sent_text: int = 0
    sent_tokens: int = 0

    def visible_text(self) -> str:
        """While running, text that may still turn out to be the start of a stop string
        is held back, so streamed text never has to be taken back."""
        if self.finish_reason is not None or not self.params.stop:
            return self.text
        hold = max(len(s) for s in self.params.stop) - 1
        return self.text[: max(len(self.text) - hold, 0)]

    def completion(self) -> CompletionOutput:
        text, start = self.visible_text(), 0
        if self.params.output_kind == RequestOutputKind.DELTA:
            text, start = text[self.sent_text :], self.sent_tokens
            self.sent_text, self.sent_tokens = self.sent_text + len(text), len(self.token_ids)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[start:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else self.logprobs[start:],
        )


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[LogprobsEntry] | None = None
    error: str | None = None
    media_stats: dict[str, int] | None = None
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def streams(self) -> bool:
        """Whether its caller takes an output every step (not only the last)."""
        return self.samples[0].params.output_kind != RequestOutputKind.FINAL_ONLY

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion() for s in self.samples],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            error=self.error,
            metrics=self.metrics,
            media_stats=self.media_stats,
            embedding=self.embedding,
        )


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> list[str]:
        """Registers a request; returns the ids of its engine-core requests (one per sample)."""
        samples = []
        child_ids = []
        for i in range(params.n):
            child_params = params.for_child(i)
            detok = make_detokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
            samples.append(_Sample(i, child_params, detok, logprobs=[] if params.logprobs is not None else None))
            cid = child_request_id(request_id, i, params.n)
            self.child_to_parent[cid] = (request_id, i)
            child_ids.append(cid)
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, samples, RequestMetrics(arrival_time)
        )
        return child_ids

    def child_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        if state is None:
            return []
        n = len(state.samples)
        return [child_request_id(request_id, i, n) for i in range(n)]

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated requests' outputs, and engine-core requests to abort:
        ended by a stop string, or failed here. A request whose output cannot be
        processed (a detokenizer fault) fails alone, with an error."""
        now = time.time()
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in core_outputs:
            parent = self.child_to_parent.get(out.request_id)
            if parent is None:
                continue
            state = self.requests[parent[0]]
            try:
                self._process_one(out, state, state.samples[parent[1]], now, to_abort)
            except Exception as e:
                logger.exception("request %s failed in output processing", state.request_id)
                state.error = f"internal error: {type(e).__name__}: {e}"
                for sample in state.samples:
                    sample.finish_reason = sample.finish_reason or "error"
                to_abort += self.child_ids(state.request_id)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                self._forget(state.request_id)
                outputs.append(state.output())
            elif state.streams:
                outputs.append(state.output())
        return outputs, to_abort

    def _process_one(self, out: EngineCoreOutput, state: _RequestState, sample: _Sample, now: float,
                     to_abort: list[str]) -> None:
        if sample.finish_reason is not None:
            return
        if sample.index == 0:
            state.num_cached_tokens = out.num_cached_tokens
            if out.media_stats is not None:
                state.media_stats = out.media_stats
        if out.first_scheduled_time is not None and state.metrics.first_scheduled_time is None:
            state.metrics.first_scheduled_time = out.first_scheduled_time
        if out.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = out.prompt_logprobs
        if out.pooled is not None:
            state.embedding = out.pooled.tolist()
        if out.new_token_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            self._append_tokens(sample, out)
        if out.error is not None:
            state.error = out.error
        if sample.finish_reason is None and out.finish_reason is not None:
            sample.finish_reason = out.finish_reason.value
            sample.stop_reason = out.stop_reason
        elif sample.finish_reason is not None and out.finish_reason is None:
            to_abort.append(out.request_id)  # ended by a stop string

    def _append_tokens(self, sample: _Sample, out: EngineCoreOutput) -> None:
        """With stop strings, one token at a time: a step can bring several (speculative
        decoding), and those after the one that completes a stop string are not output."""
        if not sample.params.stop:
            self._extend(sample, out.new_token_ids, out.new_logprobs)
            return
        for j, token in enumerate(out.new_token_ids):
            if self._extend(sample, [token], out.new_logprobs[j : j + 1]):
                return

    def _extend(self, sample: _Sample, token_ids: list[int], logprobs: list) -> bool:
        """Appends tokens and their text; True if a stop string ended the sample."""
        sample.token_ids.extend(token_ids)
        if sample.logprobs is not None:
            sample.logprobs.extend(logprobs)
        previous_len = len(sample.text)
        sample.text += sample.detokenizer.append(token_ids)
        stops = sample.params.stop
        if not stops:
            return False
        # a stop string can start up to len(stop) - 1 characters before the new text
        search_from = max(previous_len - max(len(s) for s in stops) + 1, 0)
        hits = [(sample.text.find(s, search_from), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        end = index + len(stop) if sample.params.include_stop_str_in_output else index
        sample.text = sample.text[:end]
        sample.finish_reason = "stop"
        sample.stop_reason = stop
        return True

    def abort_request(self, request_id: str, reason: str = "abort", error: str | None = None) -> RequestOutput | None:
        state = self.requests.get(request_id)
        if state is None:
            return None
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = reason
        state.error = error
        state.metrics.finished_time = time.time()
        self._forget(request_id)
        return state.output()

    def _forget(self, request_id: str) -> None:
        state = self.requests.pop(request_id)
        for i in range(len(state.samples)):
            self.child_to_parent.pop(child_request_id(request_id, i, len(state.samples)), None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)
