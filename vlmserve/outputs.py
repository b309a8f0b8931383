"""What callers get back for a request (the LLM API, the server, the CLI, the UI)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LogprobsEntry:
    """Top logprobs at one position: the chosen token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # rank of the chosen token in the full distribution (1 = most likely)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[LogprobsEntry] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[LogprobsEntry] | None = None
    error: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # media items: encoded / from the encoder cache / covered by the prefix cache (when finished)
    media_stats: dict[str, int] | None = None
    embedding: list[float] | None = None  # an embedding request's vector (when finished)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True

    @classmethod
    def of(cls, out: RequestOutput) -> EmbeddingRequestOutput:
        if out.embedding is None:
            raise RuntimeError(f"request {out.request_id} ended without an embedding: {out.error or 'aborted'}")
        return cls(out.request_id, EmbeddingOutput(out.embedding), out.prompt_token_ids, out.num_cached_tokens)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result for one query-document pair (vLLM's shape: `.outputs.score`):
    a reranker's relevance, or an embedding model's cosine similarity. Its prompt tokens
    are the pair's prompt (a reranker) or the two sides' prompts together (an embedder)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True
