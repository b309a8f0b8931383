"""Reasoning parsers, under vLLM's `--reasoning-parser` names for the families vlmserve
serves: `qwen3` (Qwen3-VL, Qwen3-VL-Thinking, Qwen3.5: `<think>` … `</think>`, the
opening tag in the prompt or in the answer; `enable_thinking: false` in
chat_template_kwargs turns reasoning off) and `deepseek_r1` (the same tags, always
reasoning; QwQ and R1 distills of Qwen). A parser splits an answer's text into its
reasoning and its content, whole or streamed, and knows the tags' token ids."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vlmserve.reasoning.bounds import ReasoningBounds

_FUNCTION_OPEN = re.compile(r"\s*<function[\s=]")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str  # the opening tag, e.g. <think>
    end: str  # the closing tag, e.g. </think>
    start_token_id: int | None
    end_token_id: int
    switch: str | None = None  # the chat_template_kwargs key that turns reasoning off when false
    tool_call_ends: bool = False  # Qwen3.5 may open a <tool_call><function=...> before closing its reasoning

    def thinking(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a request reasons (its template switch, where the family has one)."""
        if self.switch is None:
            return True
        return (chat_template_kwargs or {}).get(self.switch, True) is not False

    def prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt closed the reasoning already (the template's enable_thinking
        false writes `<think>\\n\\n</think>\\n\\n`): the last of the tags it holds is the closing one."""
        for token in reversed(prompt_token_ids):
            if token == self.end_token_id:
                return True
            if token == self.start_token_id:
                return False
        return False

    def bounds(self, prompt_token_ids: Sequence[int], budget: int | None) -> ReasoningBounds:
        """What the engine core follows of a request's reasoning."""
        return ReasoningBounds(self.end_token_id, self.start_token_id, self.prompt_ends_reasoning(prompt_token_ids),
                               budget)

    def split(self, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer, as vLLM's parser of the same name splits
        it: an opening tag that starts it dropped; before the closing tag reasoning, after it content;
        without a closing tag, all reasoning (cut short), or all content when the
        request turned reasoning off."""
        if text.lstrip().startswith(self.start):  # the model opened its reasoning itself
            text = text.lstrip()[len(self.start) :]
        if self.end in text:
            reasoning, _, content = text.partition(self.end)
            return reasoning, content or None
        if not thinking:
            return None, text
        cut = self._implicit_end(text)
        if cut is not None:
            return text[:cut] or None, text[cut:] or None
        return text, None

    def _implicit_end(self, text: str) -> int | None:
        """Where a tool call opened inside the reasoning ends it (Qwen3.5), if it does."""
        if not self.tool_call_ends:
            return None
        at = text.find("<tool_call>")
        if at >= 0 and _FUNCTION_OPEN.match(text, at + len("<tool_call>")):
            return at
        return None

    def reasons(self, chat_template_kwargs: dict[str, Any] | None, prompt_token_ids: Sequence[int]) -> bool:
        """Whether a request's answer starts with reasoning: the template's switch is not
        off and the prompt did not close the reasoning already (vLLM then reads the whole
        answer as content)."""
        return self.thinking(chat_template_kwargs) and not self.prompt_ends_reasoning(prompt_token_ids)

    def reasoning_tokens(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
                         thinking: bool = True) -> int:
        """The answer's reasoning tokens (usage's reasoning_tokens): those before the
        closing tag; all of them if it never came; none if the prompt closed it."""
        if not thinking or self.prompt_ends_reasoning(prompt_token_ids):
            return 0
        ids = list(output_token_ids)
        return ids.index(self.end_token_id) if self.end_token_id in ids else len(ids)


class ReasoningStream:
    """Splits one streamed answer as it grows: each call takes the whole text so far and
    gives the new reasoning and the new content. A tail that may be the start of the
    closing tag is held back until it is known."""

    def __init__(self, parser: ReasoningParser, thinking: bool) -> None:
        self.parser = parser
        self.thinking = thinking
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        if not final and text.strip() and self.parser.start.startswith(text.lstrip()):
            return "", ""  # the opening tag, partly written
        reasoning, content = self.parser.split(text, self.thinking)
        reasoning, content = reasoning or "", content or ""
        if not final and not content and reasoning:
            reasoning = reasoning[: self._settled(reasoning)]
        new = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_content = max(self.sent_content, len(content))
        return new


    def _settled(self, reasoning: str) -> int:
        """How much of the reasoning so far stays reasoning whatever comes next: not a tail
        that may begin the closing tag, nor (Qwen3.5) a tool call that may end it."""
        keep = len(reasoning) - _partial_tail(reasoning, self.parser.end)
        if self.parser.tool_call_ends:
            keep = min(keep, len(reasoning) - _partial_tail(reasoning, "<tool_call>"))
            at = reasoning.find("<tool_call>")
            keep = keep if at < 0 else min(keep, at)
        return keep


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of text could begin tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_FAMILIES = {
    # name: (opening tag, closing tag, the template's switch, a tool call ends the reasoning)
    "qwen3": ("<think>", "</think>", "enable_thinking", True),
    "deepseek_r1": ("<think>", "</think>", None, False),
}
REASONING_PARSERS = tuple(_FAMILIES)


def reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The named parser for this tokenizer; ValueError for an unknown name or a tokenizer
    whose vocabulary lacks the closing tag as one token."""
    if name not in _FAMILIES:
        raise ValueError(f"--reasoning-parser {name}: vlmserve has {', '.join(REASONING_PARSERS)}")
    start, end, switch, tool_call_ends = _FAMILIES[name]
    vocab = tokenizer.get_vocab()
    if end not in vocab:
        raise ValueError(f"--reasoning-parser {name}: the tokenizer has no {end} token; this checkpoint does "
                         f"not think in the {name} format")
    return ReasoningParser(name, start, end, vocab.get(start), vocab[end], switch, tool_call_ends)
