"""POST /v1/completions: one prompt or several, as text or token ids (a choice per prompt
and sample, numbered prompt by prompt), with vLLM's extensions: echo (the prompt and its
logprobs before the answer's, as evaluation harnesses score log-likelihoods),
prompt_logprobs, return_token_ids, continuous usage."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from vlmserve.engine.input_processor import PromptInput
from vlmserve.entrypoints.openai.protocol import CompletionRequest, OpenAIError
from vlmserve.entrypoints.openai.responses import ResponseShaper, usage
from vlmserve.entrypoints.openai.serving import ServingBase, Started
from vlmserve.outputs import CompletionOutput, RequestOutput


class ServingCompletion(ServingBase):
    async def create(self, req: CompletionRequest, request: Request):
        lora = self.check(req)
        prompts = self._prompts(req)
        params = self._params(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        started = await self.start_all(request_id, prompts, params, req, request, lora)
        shaper = ResponseShaper(self.engine.tokenizer, req.return_tokens_as_token_ids)
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.models.name_of(lora)}
        if req.stream:
            return StreamingResponse(self.stream(started, base, self._chunker(req, shaper, started),
                                                 req.include_usage()), media_type="text/event-stream")
        finals = await self.final(started, request)
        choices = [self._choice(req, shaper, out, c, s.offset + c.index) for s, out in zip(started, finals)
                   for c in out.outputs]
        generated = None if req.max_tokens != 0 else 0  # echo only: the one token the engine made is not returned
        return {**base, "choices": choices, "usage": usage(finals, generated)}

    # -- the request ------------------------------------------------------------------------------
    def _prompts(self, req: CompletionRequest) -> list[PromptInput]:
        raw = req.prompt
        if isinstance(raw, str):
            items: list[str | list[int]] = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [list(raw)]  # one prompt of token ids
        else:
            items = list(raw)
        truncate = self.truncation(req)
        prompts = []
        for item in items:
            prompt = PromptInput(prompt=item) if isinstance(item, str) else PromptInput(prompt_token_ids=list(item))
            prompt.mm_processor_kwargs = dict(req.mm_processor_kwargs or {})
            prompt.truncate_prompt_tokens = truncate
            prompts.append(prompt)
        return prompts

    def _params(self, req: CompletionRequest):
        max_tokens = req.max_tokens
        if max_tokens == 0:
            if not req.echo:
                raise OpenAIError(400, "max_tokens must be at least 1, got 0.", param="max_tokens")
            max_tokens = 1  # echo alone: the prompt is the answer (one token is made and dropped)
        params = self.params(req, max_tokens, req.logprobs, default_max=16)
        if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)  # the prompt's logprobs lead
        return params

    # -- the answer ------------------------------------------------------------------------------
    def _choice(self, req: CompletionRequest, shaper: ResponseShaper, out: RequestOutput, c: CompletionOutput,
                index: int) -> dict[str, Any]:
        generated = req.max_tokens != 0
        prompt_text = self._prompt_text(req, out) if req.echo else ""
        text = prompt_text + (c.text if generated else "")
        logprobs = None
        if c.logprobs is not None or (req.echo and req.logprobs is not None):
            echoed = (out.prompt_token_ids, out.prompt_logprobs or []) if req.echo else None
            logprobs = shaper.completion_logprobs((c.logprobs or []) if generated else [], 0, echoed)
        choice = {"index": index, "text": text, "finish_reason": c.finish_reason if generated else "length",
                  "stop_reason": c.stop_reason if generated else None, "logprobs": logprobs}
        if req.prompt_logprobs is not None or (req.echo and req.logprobs is not None):
            choice["prompt_logprobs"] = shaper.prompt_logprobs(out.prompt_logprobs)
        if req.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = c.token_ids if generated else []
        return choice

    def _prompt_text(self, req: CompletionRequest, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.engine.tokenizer.decode(out.prompt_token_ids)

    def _chunker(self, req: CompletionRequest, shaper: ResponseShaper, started: list[Started]):
        """Shapes each streamed choice; a choice's first chunk carries the echoed prompt
        (and its logprobs) and, when asked, the prompt's token ids."""
        opened: set[int] = set()
        generated = req.max_tokens != 0

        def chunk(c: CompletionOutput, out: RequestOutput, text: str, new_from: int, index: int) -> dict[str, Any]:
            first = index not in opened
            opened.add(index)
            echoed = req.echo and first
            text = (self._prompt_text(req, out) if echoed else "") + (text if generated else "")
            logprobs = None
            if req.logprobs is not None:
                prompt = (out.prompt_token_ids, out.prompt_logprobs or []) if echoed else None
                entries = (c.logprobs or [])[new_from:] if generated else []
                logprobs = shaper.completion_logprobs(entries, 0, prompt)
            choice = {"index": index, "text": text, "finish_reason": c.finish_reason if generated else "length",
                      "stop_reason": c.stop_reason if generated else None, "logprobs": logprobs}
            if req.return_token_ids:
                if first:
                    choice["prompt_token_ids"] = out.prompt_token_ids
                choice["token_ids"] = c.token_ids[new_from:] if generated else []
            return choice

        return chunk
