"""Prompt logprobs (vLLM's prompt_logprobs, the log-likelihoods evaluation harnesses
score): each prompt token's logprob under the model, gathered chunk by chunk as the prompt
is computed, handed over with the request's first token."""

from __future__ import annotations

import numpy as np
import torch

from vlmserve.outputs import LogprobsEntry
from vlmserve.worker.input_batch import InputBatch
from vlmserve.worker.prepared_step import PreparedStep, PromptLogprobRows, SamplingPositions
from vlmserve.worker.sampler import logprobs_entry
from vlmserve.worker.step_inputs import StepInputs


def prompt_logprob_rows(batch: InputBatch, step: StepInputs, read: SamplingPositions) -> PromptLogprobRows | None:
    """The requests of the step that ask for prompt logprobs: the prompt tokens each
    scores this step (position p predicts prompt token p + 1), and those whose prompt
    logprobs go out with this step's token (its first: not again after a preemption)."""
    rows = step.rows_array
    asking = np.flatnonzero(batch.prompt_logprobs[rows]).tolist()
    if not asking:
        return None
    starts = np.cumsum(step.query_lens) - step.query_lens
    scored = []
    for i in asking:
        row, c, q = step.rows[i], step.num_computed[i], step.query_lens[i]
        state = batch.states[row]
        last = min(c + q, state.num_prompt_tokens - 1)
        if last > c:
            scored.append((i, int(starts[i]), state, batch.token_ids[row, c + 1 : last + 1].copy()))
    sampling = set(read.sample_idx)
    done = [(step.req_ids[i], batch.states[step.rows[i]]) for i in asking if i in sampling
            and batch.num_output[step.rows[i]] == 0 and step.num_computed[i] < batch.num_prompt[step.rows[i]]]
    return PromptLogprobRows(scored, done)

def gather_prompt_logprobs(model: torch.nn.Module, p: PreparedStep, hidden: torch.Tensor
                       ) -> dict[str, list[LogprobsEntry]]:
    """Gathers the prompt logprobs of this step's prompt tokens; hands them over for the
    requests whose prompt is done."""
    if p.prompt_logprobs is None:
        return {}
    for _, token_start, state, targets in p.prompt_logprobs.scored:
        count = len(targets)
        lp = torch.log_softmax(model.compute_logits(hidden[token_start : token_start + count]).float(), dim=-1)
        n = state.sampling_params.prompt_logprobs
        state.prompt_logprobs.extend(logprobs_entry(lp[j], int(targets[j]), n) for j in range(count))
    return {rid: state.prompt_logprobs for rid, state in p.prompt_logprobs.done}
