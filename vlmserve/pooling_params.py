"""Embedding requests: how a model pools its hidden states into one vector (the model's
`PoolerConfig`), and what a request may ask of it (`PoolingParams`, vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

from vlmserve.sampling_params import ParamError

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class PoolerConfig:
    """LAST: the last prompt token's hidden state (the decoder embedders: GME, VLM2Vec,
    Qwen3-VL-Embedding); MEAN: the average over the prompt; CLS: the first token's. Then
    L2-normalised if `normalize`."""

    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def from_dict(cls, settings: dict) -> PoolerConfig:
        """ValueError naming what is wrong; vLLM's newer names (use_activation for
        normalize, seq_pooling_type for pooling_type) are taken too."""
        renamed = {"use_activation": "normalize", "seq_pooling_type": "pooling_type"}
        settings = {renamed.get(key, key): value for key, value in settings.items()}
        unknown = set(settings) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(f"unknown setting(s) {sorted(unknown)}; known: pooling_type, normalize")
        kind = str(settings.get("pooling_type", "LAST")).upper()
        if kind not in POOLING_TYPES:
            raise ValueError(f"pooling_type {settings['pooling_type']!r}: one of {', '.join(POOLING_TYPES)}")
        return cls(kind, bool(settings.get("normalize", True)))


@dataclass(frozen=True)
class PoolingParams:
    """dimensions: keep the first this many (Matryoshka embeddings), normalised after the
    cut; normalize and pooling_type: None for the model's own (the front end fills them
    in from its PoolerConfig before the request reaches the engine core)."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None

    def verify(self, hidden_size: int) -> None:
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise ParamError("dimensions", f"dimensions={self.dimensions}: the model's embeddings have "
                                           f"{hidden_size}; ask for 1 to {hidden_size}")

    def resolved(self, pooler: PoolerConfig) -> PoolingParams:
        return PoolingParams(self.dimensions, pooler.normalize if self.normalize is None else self.normalize,
                             self.pooling_type or pooler.pooling_type)

    @property
    def needs_every_token(self) -> bool:
        """MEAN and CLS read hidden states that a prefix-cache hit would skip."""
        return (self.pooling_type or "LAST") != "LAST"
