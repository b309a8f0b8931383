"""The runner's persistent view of the requests it holds.

Rows live across steps: a request is added once when first scheduled, updated by the
scheduler's deltas, and removed when it finishes or is preempted; removal moves the
last row into the hole so rows stay dense. Token ids and block tables sit in
preallocated numpy arrays, so a step's inputs are gathered with array indexing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vlmserve.lora.request import LoRARequest
from vlmserve.multimodal.inputs import MultiModalFeature
from vlmserve.outputs import LogprobsEntry
from vlmserve.pooling_params import PoolingParams
from vlmserve.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """What the runner keeps of a request besides its row's columns (InputBatch)."""

    req_id: str
    num_prompt_tokens: int
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    mrope_positions: torch.Tensor | None
    mrope_delta: int
    state_slot: int | None = None  # recurrent layers' state slot
    lora_request: LoRARequest | None = None  # the adapter it runs under
    pooling_params: PoolingParams | None = None  # an embedding request's (resolved: type and normalize set)
    pooled_sum: torch.Tensor | None = None  # MEAN pooling: the prompt's hidden states so far, summed (fp32)
    pooled_first: torch.Tensor | None = None  # CLS pooling: the first token's hidden state
    prompt_logprobs: list[LogprobsEntry] = field(default_factory=list)

    @property
    def samples_plainly(self) -> bool:
        """Whether its sampling is temperature, top-k, top-p and min_p alone: no logprobs,
        banned tokens, bias, penalties or seed (the sampler's per-row work)."""
        p = self.sampling_params
        return (p.logprobs is None and not p.min_tokens and not p.bad_words_token_ids and not p.logit_bias
                and not p.has_penalties and self.generator is None)


class InputBatch:
    """Rows of requests; per row, columns the steps read with array indexing: token ids,
    block tables, progress, positions, the sampling settings."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: list[int]) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.block_tables = [np.zeros((max_num_reqs, n), dtype=np.int32) for n in max_blocks_per_req]
        self.num_blocks = [np.zeros(max_num_reqs, dtype=np.int64) for _ in max_blocks_per_req]
        column = lambda dtype, value=0: np.full(max_num_reqs, value, dtype=dtype)  # noqa: E731
        self.num_tokens = column(np.int64)  # known to the host (a token the device is sampling is not)
        self.num_computed = column(np.int64)  # in the KV cache before the step being prepared
        self.num_prompt = column(np.int64)
        self.num_output = column(np.int64)  # generated tokens the host has
        self.mrope_delta = column(np.int64)  # a generated token's position past its index
        self.temperature = column(np.float32)  # 0: greedy
        self.top_k = column(np.int64)
        self.top_p = column(np.float32, 1.0)
        self.min_p = column(np.float32)
        self.plain = column(np.bool_, True)  # CachedRequestState.samples_plainly
        self.pooling = column(np.bool_)  # an embedding request: pooled, never sampled
        self.prompt_logprobs = column(np.bool_)  # asks for its prompt's logprobs
        self._columns = [self.num_tokens, self.num_computed, self.num_prompt, self.num_output, self.mrope_delta,
                         self.temperature, self.top_k, self.top_p, self.min_p, self.plain, self.pooling,
                         self.prompt_logprobs, *self.num_blocks]
        self.req_ids: list[str] = []
        self.states: list[CachedRequestState] = []
        self.index_of: dict[str, int] = {}
        self.dirty_rows: set[int] = set()  # rows whose block tables changed since the device copy

    def __len__(self) -> int:
        return len(self.req_ids)

    def add(self, state: CachedRequestState, token_ids: list[int], block_ids: list[list[int]], num_computed: int,
            num_output: int) -> None:
        """block_ids: per attention group; num_computed: its tokens in the KV cache already
        (a prefix-cache hit); num_output: of token_ids, those generated (before a preemption)."""
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"input batch holds at most {self.max_num_reqs} requests")
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.index_of[state.req_id] = row
        self.token_ids[row, : len(token_ids)] = token_ids
        p = state.sampling_params
        for col, value in ((self.num_tokens, len(token_ids)), (self.num_computed, num_computed),
                           (self.num_prompt, state.num_prompt_tokens), (self.num_output, num_output),
                           (self.mrope_delta, state.mrope_delta), (self.temperature, 0.0 if p.greedy else p.temperature),
                           (self.top_k, p.top_k), (self.top_p, p.top_p), (self.min_p, p.min_p),
                           (self.plain, state.samples_plainly), (self.pooling, state.pooling_params is not None),
                           (self.prompt_logprobs, p.prompt_logprobs is not None)):
            col[row] = value
        for g, ids in enumerate(block_ids):
            self.num_blocks[g][row] = 0
            self.append_blocks(row, g, ids)
        self.dirty_rows.add(row)

    def append_blocks(self, row: int, group: int, block_ids: list[int]) -> None:
        self.dirty_rows.add(row)
        n = self.num_blocks[group][row]
        self.block_tables[group][row, n : n + len(block_ids)] = block_ids
        self.num_blocks[group][row] = n + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """One new token for each of these rows (a step's decodes at once)."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1
        self.num_output[rows] += 1

    def remove(self, req_id: str) -> None:
        row = self.index_of.pop(req_id, None)
        if row is None:
            return
        last = len(self.req_ids) - 1
        if row != last:  # move the last row into the hole
            self.req_ids[row] = self.req_ids[last]
            self.states[row] = self.states[last]
            self.index_of[self.req_ids[row]] = row
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            for col in self._columns:
                col[row] = col[last]
            for table in self.block_tables:
                table[row] = table[last]
            self.dirty_rows.add(row)
        self.req_ids.pop()
        self.states.pop()

    def take_dirty_rows(self) -> list[int]:
        rows, self.dirty_rows = sorted(self.dirty_rows), set()
        return rows

    def block_table(self, group: int, row: int) -> np.ndarray:
        """The blocks of a row in one attention group."""
        return self.block_tables[group][row, : self.num_blocks[group][row]]
