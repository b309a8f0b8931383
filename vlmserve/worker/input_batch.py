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
    req_id: str
    num_prompt_tokens: int
    mm_features: list[MultiModalFeature]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    mrope_positions: torch.Tensor | None
    mrope_delta: int
    num_computed_tokens: int
    num_output_tokens: int
    state_slot: int | None = None  # recurrent layers' state slot
    lora_request: LoRARequest | None = None  # the adapter it runs under
    pooling_params: PoolingParams | None = None  # an embedding request's (resolved: type and normalize set)
    pooled_sum: torch.Tensor | None = None  # MEAN pooling: the prompt's hidden states so far, summed (fp32)
    pooled_first: torch.Tensor | None = None  # CLS pooling: the first token's hidden state
    prompt_logprobs: list[LogprobsEntry] = field(default_factory=list)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: list[int]) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_tables = [np.zeros((max_num_reqs, n), dtype=np.int32) for n in max_blocks_per_req]
        self.num_blocks = [np.zeros(max_num_reqs, dtype=np.int64) for _ in max_blocks_per_req]
        self.req_ids: list[str] = []
        self.states: list[CachedRequestState] = []
        self.index_of: dict[str, int] = {}
        self.dirty_rows: set[int] = set()  # rows whose block tables changed since the device copy

    def __len__(self) -> int:
        return len(self.req_ids)

    def add(self, state: CachedRequestState, token_ids: list[int], block_ids: list[list[int]]) -> None:
        """block_ids: per attention group."""
        row = len(self.req_ids)
        if row >= self.max_num_reqs:
            raise RuntimeError(f"input batch holds at most {self.max_num_reqs} requests")
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.index_of[state.req_id] = row
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
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
            self.num_tokens[row] = n
            for table, count in zip(self.block_tables, self.num_blocks):
                table[row] = table[last]
                count[row] = count[last]
            self.dirty_rows.add(row)
        self.req_ids.pop()
        self.states.pop()

    def take_dirty_rows(self) -> list[int]:
        rows, self.dirty_rows = sorted(self.dirty_rows), set()
        return rows

    def block_table(self, group: int, row: int) -> np.ndarray:
        """The blocks of a row in one attention group."""
        return self.block_tables[group][row, : self.num_blocks[group][row]]
