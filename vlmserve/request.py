"""The engine's view of one request: tokens, media, sampling, status, progress."""

from __future__ import annotations

import enum
import functools
import time
from typing import TYPE_CHECKING, Any, Callable

from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.pooling_params import PoolingParams
from vlmserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vlmserve.reasoning.bounds import ReasoningBounds
    from vlmserve.structured_output.compiler import CompiledSpec
    from vlmserve.structured_output.manager import RequestGrammar


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestStatus(enum.IntEnum):
    # waiting states
    WAITING = enum.auto()
    # running states
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # finished states: everything after PREEMPTED
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}

BlockHasher = Callable[["Request"], list[bytes]]


class Request:
    # a thinking model's: where its reasoning ends (its grammar starts there) and its budget
    reasoning: ReasoningBounds | None = None

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        mm_features: list[MultiModalFeature] | None = None,
        mrope_positions: Any = None,  # (3, num_prompt_tokens) tensor, opaque to the scheduler
        mrope_delta: int = 0,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        block_hasher: BlockHasher | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # the adapter it runs under (None: the base model)
        self.pooling_params = pooling_params  # an embedding request's: its prompt is pooled, nothing sampled

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None

        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0  # tokens of a step in flight, not yet on the host
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 = not looked up
        self.num_preemptions = 0

        self.mm_features = sorted(mm_features or [], key=lambda f: f.offset)
        self.mrope_positions = mrope_positions
        self.mrope_delta = mrope_delta
        # token counts after which a later request is likely to diverge (end of a media
        # item, a message, the prompt): where recurrent-state snapshots are worth taking
        self.cache_points: list[int] = []
        # where each media item's embeddings came from: "encoded" or "encoder_cache"
        # (items wholly inside the prefix-cache hit never needed them)
        self.media_sources: dict[int, str] = {}

        # structured output: the grammar, compiled by the front end before the request is
        # queued; the engine core's matcher over it, which the scheduler advances with
        # every token
        self.compiled_grammar: CompiledSpec | None = None
        self.grammar: RequestGrammar | None = None
        # speculative decoding: tokens the proposer guessed after the last one, checked
        # by the next step that decodes this request (never part of its tokens or hashes)
        self.draft_token_ids: list[int] = []

        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        self._update_block_hashes()

    def clone_as(self, request_id: str, sampling_params: SamplingParams) -> Request:
        """Another sample of the same (not yet started) prompt."""
        clone = Request(
            request_id,
            self.prompt_token_ids,
            sampling_params,
            self.eos_token_id,
            self.mm_features,
            self.mrope_positions,
            self.mrope_delta,
            self.arrival_time,
            self.priority,
            self.cache_salt,
            block_hasher=None,
            lora_request=self.lora_request,
            pooling_params=self.pooling_params,
        )
        clone._block_hasher = self._block_hasher
        clone.block_hashes = list(self.block_hashes)
        clone.cache_points = list(self.cache_points)
        clone.compiled_grammar = self.compiled_grammar
        clone.reasoning = self.reasoning
        return clone

    # -- tokens ---------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        hasher = self._block_hasher
        if hasher is not None and len(self._all_token_ids) >= (len(self.block_hashes) + 1) * hasher.block_size:
            self.block_hashes.extend(hasher(self))  # a block filled up

    @functools.cached_property
    def stop_token_set(self) -> frozenset[int]:
        """The tokens that end it once min_tokens are out: EOS (unless ignored) and its stop ids."""
        eos = () if self.eos_token_id is None or self.sampling_params.ignore_eos else (self.eos_token_id,)
        return frozenset((*eos, *self.sampling_params.stop_token_ids))

    @functools.cached_property
    def needs_its_last_token(self) -> bool:
        """Whether sampling its next token reads the tokens before it (penalties, a bad word
        of several tokens, min_tokens' bans, a grammar, a thinking budget) or it runs under an adapter: its
        next step cannot be scheduled while its last token is still being sampled. Read
        once, when the scheduler takes it (its grammar is set by then)."""
        p = self.sampling_params
        return (self.compiled_grammar is not None or self.grammar is not None or self.lora_request is not None
                or p.has_penalties or p.min_tokens > 0 or any(len(word) > 1 for word in p.bad_words_token_ids))

    @property
    def computes_every_prompt_token(self) -> bool:
        """Whether it needs the output at every prompt position (no prefix-cache hit)."""
        pooling = self.pooling_params
        return self.sampling_params.prompt_logprobs is not None or (pooling is not None and pooling.needs_every_token)

    # -- media ----------------------------------------------------------------
    @property
    def has_encoder_inputs(self) -> bool:
        return bool(self.mm_features)

    def media_stats(self) -> dict[str, int]:
        """How many media items (a video once, however many frame groups it was encoded
        in) were encoded, came from the encoder cache, or were skipped because the prefix
        cache already held their KV. An item counts where its costliest piece came from."""
        order = ["encoded", "encoder_cache", "prefix_cache"]
        items: list[str | None] = []
        for i, f in enumerate(self.mm_features):
            source = self.media_sources.get(i)
            if source is None and f.end <= max(self.num_cached_tokens, 0):
                source = "prefix_cache"
            if f.piece and items:
                known = [s for s in (items[-1], source) if s is not None]
                items[-1] = min(known, key=order.index) if known else None
            else:
                items.append(source)
        return {k: sum(s == k for s in items) for k in order}

    # -- status ---------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return self.status.finish_reason()

    @property
    def scheduling_key(self) -> tuple[int, float, str]:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return self.priority, self.arrival_time, self.request_id

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
