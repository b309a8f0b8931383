"""/v1/embeddings: one vector per input, from a model that embeds (`--runner pooling`, or
a sentence-transformers checkpoint). Each input runs as an embedding request on the
engine (prefill only, prefix and encoder caches used), all of them at once."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from fastapi import Request

from vlmserve.engine.input_processor import PromptInput
from vlmserve.entrypoints.openai.protocol import EmbeddingRequest, OpenAIError
from vlmserve.entrypoints.openai.serving import ServingBase
from vlmserve.pooling_params import PoolingParams


class ServingEmbedding(ServingBase):
    tasks = ("embed",)

    async def create(self, req: EmbeddingRequest, request: Request):
        lora = self.check(req)
        prompts = self._prompts(req)
        normalize = req.normalize if req.normalize is not None else req.use_activation
        pooling = PoolingParams(dimensions=req.dimensions, normalize=normalize)
        request_id = f"embd-{uuid.uuid4().hex}"
        started = await self.start_all(request_id, prompts, None, req, request, lora, pooling)
        finals = await self.final(started, request)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(out.embedding, req.encoding_format)}
                for i, out in enumerate(finals)]
        tokens = sum(len(out.prompt_token_ids) for out in finals)
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": self.models.name_of(lora),
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _prompts(self, req: EmbeddingRequest) -> list[PromptInput]:
        truncate = self.truncation(req)
        settings = dict(req.mm_processor_kwargs or {})
        if req.messages is not None:
            try:
                prompt = self.engine.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                                 continue_final_message=req.continue_final_message)
            except ValueError as e:
                raise OpenAIError(400, str(e), param="messages") from None
            prompt.mm_processor_kwargs, prompt.truncate_prompt_tokens = settings, truncate
            return [prompt]
        items = req.input
        if isinstance(items, str) or (isinstance(items, list) and items and isinstance(items[0], int)):
            items = [items]
        return [PromptInput(prompt=item, truncate_prompt_tokens=truncate) if isinstance(item, str)
                else PromptInput(prompt_token_ids=list(item), truncate_prompt_tokens=truncate) for item in items]


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """float: the numbers; base64: their float32 bytes, little-endian (OpenAI's form)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()
    return embedding


