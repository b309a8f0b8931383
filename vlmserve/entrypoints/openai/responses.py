"""How engine outputs read in OpenAI's (and vLLM's) response bodies: logprobs of chat and
text completions, prompt logprobs, usage. Pure functions of the outputs and the
tokenizer, shared by the chat and the completion endpoints."""

from __future__ import annotations

import math
from typing import Any

from vlmserve.outputs import CompletionOutput, LogprobsEntry, RequestOutput


class ResponseShaper:
    def __init__(self, tokenizer, tokens_as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: "token_id:N"

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else self.tokenizer.decode([token_id])

    def chat_logprobs(self, entries: list[LogprobsEntry]) -> dict[str, Any]:
        """Chat's logprobs: per token its logprob, bytes and the top alternatives (the
        `top_logprobs` most likely)."""
        content = []
        for e in entries:
            text = self.tokenizer.decode([e.token_ids[0]])
            top = [{"token": self.token(t), "logprob": _finite(lp), "bytes": list(self.token(t).encode())}
                   for t, lp in zip(e.token_ids[1:], e.logprobs[1:])]
            content.append({"token": self.token(e.token_ids[0]), "logprob": _finite(e.logprobs[0]),
                            "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}

    def completion_logprobs(self, entries: list[LogprobsEntry], text_start: int = 0,
                            prompt: tuple[list[int], list[LogprobsEntry]] | None = None) -> dict[str, Any]:
        """Text completion logprobs: tokens, their logprobs, the top alternatives with the
        chosen token among them (`logprobs: 0` gives the chosen one alone) and each token's
        offset in the text. With `prompt` (echo: its token ids and the logprobs of all but
        the first), the prompt's tokens come first, the first without a logprob."""
        tokens, token_lps, tops, offsets, pos = [], [], [], [], text_start
        if prompt is not None:
            ids, prompt_entries = prompt
            for i, token_id in enumerate(ids):
                tok = self.token(token_id)
                entry = prompt_entries[i - 1] if i > 0 and i - 1 < len(prompt_entries) else None
                tokens.append(tok)
                token_lps.append(None if entry is None else _finite(entry.logprobs[0]))
                tops.append(None if entry is None else self._top_dict(entry))
                offsets.append(pos)
                pos += len(tok)
        for e in entries:
            tok = self.token(e.token_ids[0])
            tokens.append(tok)
            token_lps.append(_finite(e.logprobs[0]))
            tops.append(self._top_dict(e))
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _top_dict(self, e: LogprobsEntry) -> dict[str, float]:
        top = {self.token(e.token_ids[0]): _finite(e.logprobs[0])}
        for t, lp in zip(e.token_ids[1:], e.logprobs[1:]):
            top.setdefault(self.token(t), _finite(lp))
        return top

    def prompt_logprobs(self, entries: list[LogprobsEntry] | None) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a map
        from token id to {logprob, rank, decoded_token}: the prompt's own token and the
        most likely ones."""
        if entries is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for e in entries:
            position = {str(e.token_ids[0]): {"logprob": _finite(e.logprobs[0]), "rank": e.rank,
                                              "decoded_token": self.token(e.token_ids[0])}}
            for rank, (t, lp) in enumerate(zip(e.token_ids[1:], e.logprobs[1:]), 1):
                position.setdefault(str(t), {"logprob": _finite(lp), "rank": rank, "decoded_token": self.token(t)})
            out.append(position)
        return out


def usage(outs: list[RequestOutput], completion_tokens: int | None = None) -> dict[str, Any]:
    """The usage of a request (several prompts: each prompt counted once): prompt and
    completion tokens, the prompt tokens served from the prefix cache and, as vlmserve's
    extension, where each picture's embeddings came from."""
    prompt = sum(out.num_prompt_tokens for out in outs)
    if completion_tokens is None:
        completion_tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
    body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                            "total_tokens": prompt + completion_tokens,
                            "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in outs)}}
    media: dict[str, int] = {}
    for out in outs:
        for key, n in (out.media_stats or {}).items():
            media[key] = media.get(key, 0) + n
    if media:
        body["media"] = media
    return body


def choice_usage(out: RequestOutput, c: CompletionOutput) -> dict[str, int]:
    """One choice's running usage (stream_options.continuous_usage_stats)."""
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": len(c.token_ids),
            "total_tokens": out.num_prompt_tokens + len(c.token_ids)}


def _finite(logprob: float) -> float:
    """-inf (a token the grammar or a ban ruled out) as vLLM writes it: JSON has no -inf."""
    return logprob if math.isfinite(logprob) else -9999.0
