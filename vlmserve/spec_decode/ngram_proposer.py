"""Prompt lookup: the tokens that followed the latest earlier occurrence of a request's
last n tokens are its drafts. Copying text (OCR, names from the prompt, JSON keys,
edits of a given text) makes them right often; otherwise they cost one wasted slot each."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from vlmserve.config import SpeculativeConfig
from vlmserve.core.sched_output import SchedulerOutput
from vlmserve.worker.proposer import Proposer, token_history
from vlmserve.worker.step_inputs import StepInputs


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, so: SchedulerOutput, step: StepInputs, kept: list[int], proposing: list[int]
                ) -> dict[str, list[int]]:
        return {step.req_ids[i]: self.lookup(token_history(self.batch, step.rows[i])) for i in proposing}

    def lookup(self, tokens: np.ndarray) -> list[int]:
        """Drafts for a request whose tokens so far are `tokens` (prompt and output): the
        longest n-gram (max_n down to min_n) that ends the sequence and also occurs
        earlier wins; of its occurrences, the latest. Up to k tokens, possibly none."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows starting at 0 .. length - n - 1: every earlier occurrence, each with
            # at least one token after it
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + self.k].tolist()
        return []
