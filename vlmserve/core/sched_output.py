"""What the scheduler tells the model runner each step, what comes back, and what a step
produced for each request (EngineCoreOutput) and for the whole engine (SchedulerStats).

Everything that crosses the scheduler/runner boundary is here. New requests carry
their full data once; requests the runner already holds get deltas only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlmserve.core.kv_connector import KVTransfers
from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.outputs import LogprobsEntry
from vlmserve.pooling_params import PoolingParams
from vlmserve.request import FinishReason
from vlmserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per attention group of the KV cache
    state_slot: int | None  # its recurrent-state slot (models with recurrent layers)
    num_computed_tokens: int  # prefix-cache hit
    mrope_positions: Any  # (3, num_prompt_tokens) tensor or None
    mrope_delta: int
    # tokens already generated before a preemption (recomputed with the prompt)
    output_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter it runs under
    pooling_params: PoolingParams | None = None  # an embedding request's


@dataclass
class CachedRequestData:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[list[int]]] = field(default_factory=list)  # per attention group
    num_computed_tokens: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> indices into its mm_features whose encoder runs this step
    scheduled_encoder_inputs: dict[str, list[int]]
    finished_req_ids: set[str]  # finished or aborted since the last step
    preempted_req_ids: set[str]
    free_encoder_mm_hashes: list[str]
    # recurrent-state slot copies: (snapshot, live) before the forward, (live, snapshot) after
    state_restores: list[tuple[int, int]] = field(default_factory=list)
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    # req_id -> draft tokens checked this step, after its last token (counted in
    # num_scheduled_tokens; KV slots are allocated for them)
    scheduled_draft_tokens: dict[str, list[int]] = field(default_factory=dict)
    # hybrid models: req_id -> a recurrent-state slot per draft, for the state after its
    # last token and after each draft but the last
    draft_checkpoints: dict[str, list[int]] = field(default_factory=dict)
    # whether drafts proposed after this step could be checked (not while too many run)
    propose_drafts: bool = True
    # the requests that sample a token this step (until their output comes back, the next
    # step sees it as a placeholder)
    sampling_req_ids: set[str] = field(default_factory=set)
    # of those media, the ones whose output comes from the KV connector's store instead
    # (mm_hash -> the output, serialized): put in the encoder cache, not encoded
    encoder_outputs_loaded: dict[str, bytes] = field(default_factory=dict)
    # copies between device blocks and the KV connector's store (core/kv_connector.py)
    kv_transfers: KVTransfers = field(default_factory=KVTransfers)


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # one list per request; empty when the step ended inside the prompt; with drafts, the
    # kept ones and one more
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)  # per sampled token
    # req_id -> logprobs of every prompt position 1..n-1, once the whole prompt is done
    prompt_logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    # req_id -> draft tokens proposed for its next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> the pooled vector of an embedding request whose prompt is done (a tensor)
    pooler_output: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[LogprobsEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobsEntry] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    media_stats: dict[str, int] | None = None  # set when finished
    first_scheduled_time: float | None = None  # wall clock, for the queue-time metric
    pooled: Any = None  # an embedding request's vector (an fp32 CPU tensor, opaque here)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class DraftCounts:
    """Speculative decoding's drafts so far: the checks (a request's step with drafts), the
    draft tokens checked, and at each position how many checks kept the draft there."""

    checks: int = 0
    tokens: int = 0
    kept_at: list[int] = field(default_factory=list)

    def add(self, checked: int, kept: int) -> None:
        self.checks += 1
        self.tokens += checked
        self.kept_at += [0] * (checked - len(self.kept_at))
        for i in range(kept):
            self.kept_at[i] += 1


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    group_kinds: list[str]  # per KV cache group: the name of its spec
    blocks_in_use: dict[int, int]  # per attention group (by its index among the groups)
    num_free_blocks: int
    kv_usage: float
    prefix_cache_queries: list[int]  # tokens, per group, cumulative
    prefix_cache_hits: list[int]
    state_slots_in_use: int  # recurrent-state slots of running requests
    state_snapshots: int  # recurrent-state snapshots kept for prefix caching
    encoder_cache_hits: int
    encoder_cache_misses: int
    encoder_cache_entries: int
    encoder_cache_entries_in_use: int  # referenced by requests that still need them
    encoder_cache_tokens: int
    num_preemptions: int
    num_drafts: int  # speculative decoding: steps of a request that checked drafts, cumulative
    num_draft_tokens: int  # ... draft tokens checked
    num_accepted_tokens: int  # ... and kept
    num_accepted_per_position: list[int] = field(default_factory=list)  # ... [i]: checks whose i-th draft was kept
    # the KV connector (a host tier, a shared pool): prompt tokens looked up in it and found
    # (past the device's hits), blocks copied to it and back (cumulative), blocks it holds now
    connector_queries: int = 0
    connector_hits: int = 0
    connector_blocks_saved: int = 0
    connector_blocks_loaded: int = 0
    connector_blocks_held: int = 0
    connector_block_bytes: int = 0  # of one block, every attention layer's keys and values (a rank's)
    # seconds copying to the connector's store and back (a pool's fetches while scheduling
    # counted as load), cumulative
    connector_save_seconds: float = 0.0
    connector_load_seconds: float = 0.0
