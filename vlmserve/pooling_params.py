"""Pooling requests: how a model pools its hidden states into one vector or one score
(the model's `PoolerConfig`), and what a request may ask of it (`PoolingParams`, vLLM's
names)."""

from __future__ import annotations

from dataclasses import dataclass

from vlmserve.sampling_params import ParamError

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """LAST: the last prompt token's hidden state (the decoder embedders: GME, VLM2Vec,
    Qwen3-VL-Embedding); MEAN: the average over the prompt; CLS: the first token's. Then
    L2-normalised if `normalize`.

    classifier_from_token (no, yes): a reranker made from a generative model (Qwen3-Reranker,
    Qwen3-VL-Reranker: vLLM's `from_2_way_softmax`): its output is one relevance score, the
    "yes" logit minus the "no" logit at the last token, through a sigmoid if `normalize`
    (vLLM's use_activation)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    classifier_from_token: tuple[str, str] | None = None

    @property
    def task(self) -> str:
        """What the model's requests give: "embed" (a vector) or "score" (a relevance score)."""
        return "embed" if self.classifier_from_token is None else "score"

    @classmethod
    def from_dict(cls, settings: dict) -> PoolerConfig:
        """ValueError naming what is wrong; vLLM's newer names (use_activation for
        normalize, seq_pooling_type for pooling_type) are taken too."""
        renamed = {"use_activation": "normalize", "seq_pooling_type": "pooling_type"}
        settings = {renamed.get(key, key): value for key, value in settings.items()}
        unknown = set(settings) - {"pooling_type", "normalize", "classifier_from_token"}
        if unknown:
            raise ValueError(f"unknown setting(s) {sorted(unknown)}; known: pooling_type, normalize, "
                             f"classifier_from_token")
        kind = str(settings.get("pooling_type", "LAST")).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooling_type {settings['pooling_type']!r}: one of {', '.join(POOLING_TYPES)}")
        tokens = settings.get("classifier_from_token")
        if tokens is not None:
            if not (isinstance(tokens, (list, tuple)) and len(tokens) == 2 and all(isinstance(t, str) for t in tokens)):
                raise ValueError(f"classifier_from_token {tokens!r}: two tokens, the 'no' one then the 'yes' one "
                                 f"(as [\"no\", \"yes\"])")
            if kind != "LAST":
                raise ValueError(f"classifier_from_token scores the last token: pooling_type {kind} does not apply")
            tokens = tuple(tokens)
        return cls(kind, bool(settings.get("normalize", True)), tokens)


@dataclass(frozen=True)
class PoolingParams:
    """dimensions: keep the first this many (Matryoshka embeddings), normalised after the
    cut; normalize and pooling_type: None for the model's own (the front end fills them
    in from its PoolerConfig before the request reaches the engine core, and, for a
    reranker, the ids of its (no, yes) tokens)."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None
    score_token_ids: tuple[int, int] | None = None

    def verify(self, hidden_size: int) -> None:
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise ParamError("dimensions", f"dimensions={self.dimensions}: the model's embeddings have "
                                           f"{hidden_size}; ask for 1 to {hidden_size}")

    def resolved(self, pooler: PoolerConfig, score_token_ids: tuple[int, int] | None = None) -> PoolingParams:
        if score_token_ids is not None and self.dimensions is not None:
            raise ParamError("dimensions", "this model gives one relevance score per prompt: dimensions does not apply")
        return PoolingParams(self.dimensions, pooler.normalize if self.normalize is None else self.normalize,
                             self.pooling_type or pooler.pooling_type, score_token_ids)

    @property
    def needs_every_token(self) -> bool:
        """MEAN and CLS read hidden states that a prefix-cache hit would skip."""
        return (self.pooling_type or "LAST") != "LAST"
