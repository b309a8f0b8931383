"""Embedding checkpoints made offline with sentence-transformers from a test checkpoint:
its bare model (no output head) with a Pooling module, and a Normalize one, saved in
sentence-transformers' own layout (modules.json, 1_Pooling/, 2_Normalize/)."""

from __future__ import annotations

from pathlib import Path


def write_embedder(base: str | Path, out: str | Path, pooling_mode: str = "lasttoken", normalize: bool = True) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    transformer = Transformer(str(base))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules).save(str(out))
    return Path(out)
