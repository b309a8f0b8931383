"""Scoring query-document pairs, for `LLM.score`, /v1/score and /v1/rerank, in vLLM's two
ways: a reranker reads each pair in one prompt and gives its relevance (the prompt of
Qwen3-Reranker and Qwen3-VL-Reranker, rendered by the checkpoint's chat template); an
embedding model embeds each side on its own and scores their cosine similarity.

A side is a string or {"content": [parts]} (text, image_url, video_url parts: vLLM's
ScoreMultiModalParam); pictures may stand on either side."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vlmserve.engine.input_processor import PromptInput
from vlmserve.outputs import RequestOutput

RERANKER_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct '
                   'provided. Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."


def content_parts(side: Any, where: str) -> list[dict[str, Any]]:
    """A side's content parts: a string is one text part."""
    if isinstance(side, str):
        return [{"type": "text", "text": side}]
    if isinstance(side, dict) and isinstance(side.get("content"), list) and side["content"]:
        return side["content"]
    raise ValueError(f"{where} must be a string or {{\"content\": [parts]}} (text, image_url, video_url parts)")


def score_pairs(data_1: Any, data_2: Any, names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple[Any, Any]]:
    """(query, document) pairs: one query against every document, or one query per
    document; ValueError naming the field otherwise."""
    queries = data_1 if isinstance(data_1, list) else [data_1]
    documents = data_2 if isinstance(data_2, list) else [data_2]
    if not queries:
        raise ValueError(f"{names[0]} is empty: give a query")
    if not documents:
        raise ValueError(f"{names[1]} is empty: give at least one document")
    if len(queries) == 1:
        queries = queries * len(documents)
    elif len(queries) != len(documents):
        raise ValueError(f"{len(queries)} items in {names[0]} for {len(documents)} in {names[1]}: give one, "
                         f"or one for each")
    for i, (query, document) in enumerate(zip(queries, documents)):
        content_parts(query, f"{names[0]}[{i}]")
        content_parts(document, f"{names[1]}[{i}]")
    return list(zip(queries, documents))


def reranker_messages(query: Any, document: Any, instruction: str | None) -> list[dict[str, Any]]:
    """The pair as the reranker was trained to read it: a system turn that asks for "yes"
    or "no", then "<Instruct>: ...<Query>:...\\n<Document>:..." in one user turn."""
    return [
        {"role": "system", "content": RERANKER_SYSTEM},
        {"role": "user", "content": [
            {"type": "text", "text": f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}"},
            {"type": "text", "text": "<Query>:"}, *content_parts(query, "query"),
            {"type": "text", "text": "\n<Document>:"}, *content_parts(document, "document"),
        ]},
    ]


def distinct_sides(pairs: list[tuple[Any, Any]]) -> tuple[list[Any], list[tuple[int, int]]]:
    """For an embedding model: each side once (a query scored against many documents is
    embedded once), and each pair as two indexes into them."""
    index: dict[str, int] = {}
    sides: list[Any] = []
    for side in (side for pair in pairs for side in pair):
        key = json.dumps(side, sort_keys=True, default=repr)  # a PIL picture: by its object
        if key not in index:
            index[key] = len(sides)
            sides.append(side)
    keys = [json.dumps(side, sort_keys=True, default=repr) for pair in pairs for side in pair]
    return sides, [(index[a], index[b]) for a, b in zip(keys[::2], keys[1::2])]


def embedding_prompt(side: Any, render_chat) -> PromptInput:
    """One side for an embedding model: a string as it is (as /v1/embeddings takes text),
    content with pictures as a user turn by the chat template (as sentence-transformers and
    /v1/embeddings' messages form render it)."""
    if isinstance(side, str):
        return PromptInput(prompt=side)
    return render_chat([{"role": "user", "content": content_parts(side, "input")}], False)


def cosine(a: list[float], b: list[float]) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) or 1.0))


@dataclass
class ScoringPlan:
    """The prompts that score some pairs on a model, and which of their outputs make each
    pair's score: a reranker's one prompt per pair, an embedder's two sides."""

    prompts: list[PromptInput]
    sides_of_pair: list[tuple[int, ...]]  # per pair: the prompts whose outputs score it

    @classmethod
    def of(cls, task: str, pairs: list[tuple[Any, Any]], render_chat: Callable[..., PromptInput],
           instruction: str | None = None) -> ScoringPlan:
        """task: the engine's; ValueError for a model that generates, or a side it cannot render."""
        if task == "score":
            return cls([render_chat(reranker_messages(q, d, instruction)) for q, d in pairs],
                       [(i,) for i in range(len(pairs))])
        if task != "embed":
            raise ValueError("this model generates text; it scores as a reranker or an embedding model, started "
                             "with --runner pooling")
        sides, pair_index = distinct_sides(pairs)
        return cls([embedding_prompt(side, render_chat) for side in sides], pair_index)

    def scored(self, outputs: list[RequestOutput]) -> list[tuple[float, list[RequestOutput]]]:
        """Each pair's score and the outputs it came from (a reranker's relevance, or the
        cosine of the two sides' vectors)."""
        result = []
        for index in self.sides_of_pair:
            parts = [outputs[i] for i in index]
            score = parts[0].embedding[0] if len(parts) == 1 else cosine(parts[0].embedding, parts[1].embedding)
            result.append((score, parts))
        return result
