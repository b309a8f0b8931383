"""Loading media from what users hand in, with the checks a server needs.

Every entry point goes through `MediaLoader`: data URLs, files (only under an allowed
folder), PIL images and numpy arrays. Each item comes back decoded together with the
bytes that identify it (the original encoded bytes, or the pixels of an object that
arrived decoded), from which its mm_hash is computed.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps


class MediaError(ValueError):
    """A media item that cannot be used; the message says why."""


@dataclass
class LoadedImage:
    image: Image.Image  # RGB
    content: bytes  # what identifies it: the original file bytes, or mode+size+pixels


@dataclass
class MediaLimits:
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 64 << 20  # refused before the pixels are decoded
    allowed_local_media_path: str | None = None
    background: tuple[int, int, int] = (255, 255, 255)  # for transparent images


class MediaLoader:
    def __init__(self, limits: MediaLimits | None = None) -> None:
        self.limits = limits or MediaLimits()

    def load_image(self, source: Any) -> LoadedImage:
        if isinstance(source, Image.Image):
            return LoadedImage(self._to_rgb(source), _pixel_identity(source))
        if isinstance(source, np.ndarray):
            return self.load_image(_array_to_image(source))
        if isinstance(source, (bytes, bytearray)):
            return self._decode_image(bytes(source), "image bytes")
        if isinstance(source, dict):  # OpenAI content part {"url": ...}
            source = source.get("url", source)
        if not isinstance(source, (str, os.PathLike)):
            raise MediaError(f"unsupported image input of type {type(source).__name__}")
        source = str(source)
        if source.startswith("data:"):
            return self._decode_image(_decode_data_url(source), "data URL")
        if source.startswith(("http://", "https://")):
            raise MediaError("fetching images over http(s) is not enabled on this server")
        path = source[len("file://") :] if source.startswith("file://") else source
        return self._decode_image(self._read_local(path), path)

    # -- helpers -------------------------------------------------------------------------
    def _read_local(self, path: str) -> bytes:
        allowed = self.limits.allowed_local_media_path
        real = Path(path).expanduser().resolve()
        if allowed is not None:
            root = Path(allowed).expanduser().resolve()
            if root != real and root not in real.parents:
                raise MediaError(f"local file {path!r} is outside the allowed media folder")
        if not real.is_file():
            raise MediaError(f"no such file: {path!r}")
        size = real.stat().st_size
        if size > self.limits.max_image_bytes:
            raise MediaError(f"file {path!r} is {size} bytes, over the {self.limits.max_image_bytes}-byte limit")
        return real.read_bytes()

    def _decode_image(self, data: bytes, what: str) -> LoadedImage:
        if not data:
            raise MediaError(f"{what} is empty (0 bytes)")
        if len(data) > self.limits.max_image_bytes:
            raise MediaError(f"{what} is {len(data)} bytes, over the {self.limits.max_image_bytes}-byte limit")
        try:
            with Image.open(io.BytesIO(data)) as img:
                # the header gives the size: refuse a decompression bomb before decoding it
                w, h = img.size
                if w * h > self.limits.max_image_pixels:
                    raise MediaError(
                        f"{what} is {w}x{h} pixels, over the {self.limits.max_image_pixels}-pixel limit"
                    )
                img.load()
                img = ImageOps.exif_transpose(img)
                rgb = self._to_rgb(img)
        except MediaError:
            raise
        except Exception as e:  # PIL raises many types for broken files
            raise MediaError(f"{what} is not a readable image: {e}") from None
        return LoadedImage(rgb, data)

    def _to_rgb(self, img: Image.Image) -> Image.Image:
        if img.mode == "RGB":
            return img
        if img.mode == "P":
            img = img.convert("RGBA")
        if img.mode in ("RGBA", "LA"):
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, self.limits.background + (255,))
            return Image.alpha_composite(background, rgba).convert("RGB")
        if img.mode in ("I;16", "I;16B", "I;16L", "I"):
            arr = np.asarray(img, dtype=np.float64)
            top = 65535.0 if arr.max() > 255 else 255.0
            return Image.fromarray((arr / top * 255).round().clip(0, 255).astype(np.uint8)).convert("RGB")
        return img.convert("RGB")


def _pixel_identity(img: Image.Image) -> bytes:
    return f"{img.mode}:{img.size}:".encode() + img.tobytes()


def _array_to_image(arr: np.ndarray) -> Image.Image:
    if arr.dtype != np.uint8:
        raise MediaError(f"image arrays must be uint8 (H, W[, C]), got {arr.dtype}")
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (1, 3, 4)):
        raise MediaError(f"image arrays must be (H, W), (H, W, 3) or (H, W, 4), got {arr.shape}")
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    return Image.fromarray(arr)


def _decode_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("malformed data URL: no ',' separating header and data")
    if not header.endswith(";base64"):
        raise MediaError("data URLs must be base64-encoded (data:<mime>;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data URL payload is not valid base64") from None
