"""mm_hash: the identity of a processed media item.

xxh3-128 over the modality, the media's original encoded bytes (or, for an object
handed in already decoded, its mode, size and pixels) and every setting that changes
the processed pixels. Equal hashes mean equal encoder input, so the hash keys the
processor cache, the encoder cache and the prefix-cache block hashes.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash


def mm_hash(modality: str, content: bytes, settings: dict[str, Any]) -> str:
    h = xxhash.xxh3_128()
    h.update(modality.encode())
    h.update(b"\x00")
    h.update(content)
    h.update(b"\x00")
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    return h.hexdigest()
