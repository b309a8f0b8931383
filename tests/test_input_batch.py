"""The runner's persistent batch: rows added and removed between steps, token ids and
block tables following their request when the last row moves into a hole."""

from __future__ import annotations

import numpy as np
import pytest

from vlmserve.sampling_params import SamplingParams
from vlmserve.worker.input_batch import CachedRequestState, InputBatch


def state(rid: str, prompt: int) -> CachedRequestState:
    return CachedRequestState(rid, prompt, [], SamplingParams(), None, None, 0)


def test_rows_keep_their_tokens_and_blocks_when_the_last_row_fills_a_hole():
    batch = InputBatch(max_num_reqs=3, max_model_len=32, max_blocks_per_req=[4, 2])
    batch.add(state("a", 3), [1, 2, 3], [[10], [20]], 0, 0)
    batch.add(state("b", 2), [4, 5], [[11, 12], [21]], 0, 0)
    batch.add(state("c", 1), [6], [[13], []], 0, 0)
    batch.append_token(batch.index_of["c"], 7)
    batch.append_blocks(batch.index_of["c"], 0, [14])
    batch.remove("a")
    assert batch.req_ids == ["c", "b"] and batch.index_of == {"c": 0, "b": 1}
    row = batch.index_of["c"]
    assert batch.token_ids[row, : batch.num_tokens[row]].tolist() == [6, 7]
    assert batch.block_table(0, row).tolist() == [13, 14] and batch.block_table(1, row).tolist() == []
    assert batch.block_table(0, batch.index_of["b"]).tolist() == [11, 12]
    batch.remove("a")  # gone already: nothing happens
    batch.remove("b")
    assert batch.req_ids == ["c"] and len(batch) == 1


def test_a_full_batch_refuses_another_row():
    batch = InputBatch(max_num_reqs=1, max_model_len=8, max_blocks_per_req=[2])
    batch.add(state("a", 1), [1], [[3]], 0, 0)
    with pytest.raises(RuntimeError, match="at most 1"):
        batch.add(state("b", 1), [2], [[4]], 0, 0)
    assert np.array_equal(batch.block_table(0, 0), [3])
