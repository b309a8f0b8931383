"""What the engine core knows of a request's reasoning: the token that ends it, whether
the prompt ended it already, and the thinking budget. Token ids only: the core never
reads text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningBounds:
    end_token_id: int  # closes the reasoning (`</think>`)
    start_token_id: int | None  # opens it (`<think>`); the budget counts from the last one
    ended_in_prompt: bool  # the prompt closed it (enable_thinking false): the answer starts at once
    budget: int | None = None  # thinking_token_budget: reasoning tokens before the end is forced

    def answer_start(self, output_token_ids: Sequence[int]) -> int | None:
        """Where the answer starts among the output tokens (after the end token); None
        while the reasoning goes on."""
        if self.ended_in_prompt:
            return 0
        try:
            return list(output_token_ids).index(self.end_token_id) + 1
        except ValueError:
            return None

    def reasoning_tokens(self, output_token_ids: Sequence[int]) -> int:
        """The reasoning tokens generated so far, counted as vLLM counts them against the
        budget: after the last start token the output holds (from its first token where
        the prompt opened the reasoning)."""
        ids = list(output_token_ids)
        start = 0
        if self.start_token_id is not None and self.start_token_id in ids:
            start = len(ids) - ids[::-1].index(self.start_token_id)
        return len(ids) - start

    def budget_spent(self, output_token_ids: Sequence[int]) -> bool:
        return self.budget is not None and self.reasoning_tokens(output_token_ids) >= self.budget
