"""Media files made on the spot for tests: images in every mode, videos in every container."""

from __future__ import annotations

import io
import struct
import zlib

import av
import numpy as np
from PIL import Image


def image_bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def picture(w: int, h: int, seed: int = 0) -> Image.Image:
    rng = np.random.RandomState(seed)
    base = rng.randint(0, 256, (6, 6, 3), dtype=np.uint8)
    return Image.fromarray(base).resize((w, h), Image.BILINEAR)


def in_mode(img: Image.Image, mode: str) -> Image.Image:
    if mode == "RGBA":
        rgba = img.convert("RGBA")
        alpha = np.zeros((img.height, img.width), dtype=np.uint8)
        alpha[:, : img.width // 2] = 255
        alpha[: img.height // 3, :] = 128
        rgba.putalpha(Image.fromarray(alpha))
        return rgba
    if mode == "LA":
        la = img.convert("LA")
        la.putalpha(Image.fromarray(np.full((img.height, img.width), 100, dtype=np.uint8)))
        return la
    if mode == "P":
        return img.convert("P", palette=Image.ADAPTIVE, colors=32)
    return img.convert(mode)


def huge_png_header(width: int = 20000, height: int = 20000) -> bytes:
    """A PNG whose header claims width x height; the pixel data is a few bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def png_bomb(width: int, height: int, bit_depth: int = 8, color_type: int = 2, frames: int = 1) -> bytes:
    """A PNG of width x height pixels, every one zero, at any bit depth and colour type (0
    grey, 2 RGB, 3 palette, 4 grey+alpha, 6 RGBA), written row by row so that it is never
    whole in memory: a few KB on disk, gigabytes decoded. frames > 1: an animated PNG."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[color_type]
    row = b"\x00" * (1 + (width * channels * bit_depth + 7) // 8)
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0))
    if color_type == 3:
        out += chunk(b"PLTE", b"\x00\x00\x00\xff\xff\xff") + chunk(b"tRNS", b"\x00")
    if frames > 1:
        out += chunk(b"acTL", struct.pack(">II", frames, 0))
        control = struct.pack(">IIIIIHHBB", 0, width, height, 0, 0, 1, 1, 0, 0)
        out += chunk(b"fcTL", control) + chunk(b"IDAT", idat)
        for i in range(1, frames):  # the later frames repeat the first one's data
            control = struct.pack(">IIIIIHHBB", 2 * i - 1, width, height, 0, 0, 1, 1, 0, 0)
            out += chunk(b"fcTL", control) + chunk(b"fdAT", struct.pack(">I", 2 * i) + idat)
        return out + chunk(b"IEND", b"")
    return out + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def video_bytes(fmt: str = "mp4", frames: int = 12, fps: int = 4, size=(96, 64), seed: int = 0) -> bytes:
    """A short video of a square moving right, in mp4 (H.264), webm (VP8), mov, or gif."""
    codec = {"mp4": "libx264", "mov": "libx264", "webm": "libvpx", "gif": "gif"}[fmt]
    pix = {"gif": "rgb8"}.get(fmt, "yuv420p")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = pix
        for i in range(frames):
            arr = np.full((size[1], size[0], 3), 230, dtype=np.uint8)
            x = 4 + i * (size[0] - 24) // max(frames - 1, 1)
            arr[20:40, x : x + 16] = (200, 30 + seed * 40 % 200, 40)
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def undecodable_video_bytes() -> bytes:
    """A well-formed MP4 whose every frame is damaged (the payload of its mdat box zeroed)."""
    good = video_bytes("mp4")
    i = good.find(b"mdat")
    size = struct.unpack(">I", good[i - 4 : i])[0]
    start, end = i + 4, i - 4 + size
    return good[:start] + bytes(end - start) + good[end:]
