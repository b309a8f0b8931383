"""/v1/score and /v1/rerank (also under /score, /rerank, /v2/rerank, as vLLM serves them):
query-document pairs scored by a reranker (one prompt per pair) or an embedding model
(the cosine similarity of the two sides' vectors); pictures allowed on either side. All
pairs run on the engine at once; a 1:N request shares its query's prefix-cache blocks."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request

from vlmserve.entrypoints.openai.protocol import OpenAIError, RerankRequest, ScoreRequest, ScoringRequest
from vlmserve.entrypoints.openai.serving import ServingBase
from vlmserve.entrypoints.scoring import ScoringPlan, score_pairs
from vlmserve.lora.request import LoRARequest
from vlmserve.pooling_params import PoolingParams


class ServingScore(ServingBase):
    tasks = ("score", "embed")

    async def score(self, req: ScoreRequest, request: Request) -> dict[str, Any]:
        lora = self.check(req)
        queries, documents, names = req.sides()
        request_id = f"score-{uuid.uuid4().hex}"
        scores, tokens = await self._scores(request_id, req, lora, queries, documents, names, request)
        return {"id": request_id, "object": "list", "created": int(time.time()), "model": self.models.name_of(lora),
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}

    async def rerank(self, req: RerankRequest, request: Request) -> dict[str, Any]:
        lora = self.check(req)
        request_id = f"rerank-{uuid.uuid4().hex}"
        scores, tokens = await self._scores(request_id, req, lora, req.query, req.documents, ("query", "documents"),
                                            request)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or len(scores)]
        results = [{"index": i, "relevance_score": scores[i]} for i in order]
        if req.return_documents:
            for result in results:
                document = req.documents[result["index"]]
                result["document"] = {"text": document} if isinstance(document, str) else \
                    {"multi_modal": document.get("content")}
        return {"id": request_id, "model": self.models.name_of(lora), "results": results,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    async def _scores(self, request_id: str, req: ScoringRequest, lora: LoRARequest | None, queries: Any,
                      documents: Any, names: tuple[str, str], request: Request) -> tuple[list[float], int]:
        """One score per pair, and the prompt tokens the engine read."""
        try:
            plan = ScoringPlan.of(self.engine.task, score_pairs(queries, documents, names), self.engine.render_chat,
                                  req.task_instruction)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        truncate = self.truncation(req)
        for prompt in plan.prompts:
            prompt.mm_processor_kwargs, prompt.truncate_prompt_tokens = dict(req.mm_processor_kwargs or {}), truncate
        pooling = PoolingParams(normalize=req.use_activation) if self.engine.task == "score" else PoolingParams()
        started = await self.start_all(request_id, plan.prompts, None, req, request, lora, pooling)
        finals = await self.final(started, request)
        return [score for score, _ in plan.scored(finals)], sum(len(out.prompt_token_ids) for out in finals)
