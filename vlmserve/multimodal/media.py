"""Loading media from what users hand in, with the checks a server needs.

Every entry point goes through `MediaLoader`: data URLs; files, only under an allowed
folder (also as file:// URLs); http(s) URLs, only from allowed hosts, with a timeout, a
byte cap and no redirect to another host; PIL images, numpy arrays and lists of frames
from the Python API. Each item comes back decoded, with the bytes that identify it (the
original encoded bytes, or the pixels of an object that arrived decoded) for its mm_hash.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import os
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps


FrameChooser = Callable[[int, "float | None"], Any]  # (frames in the video, fps) -> indices to keep


IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif"}
VIDEO_EXTENSIONS = {".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v"}


def modality_of(path: str) -> str | None:
    """"image" or "video" by a file's extension; None for neither."""
    ext = Path(path).suffix.lower()
    return "image" if ext in IMAGE_EXTENSIONS else "video" if ext in VIDEO_EXTENSIONS else None


class MediaError(ValueError):
    """A media item that cannot be used; the message says why."""


@dataclass
class RawMedia:
    """A media item read but not yet decoded: decoding is skipped on a cache hit."""

    modality: str  # "image" | "video"
    content: bytes  # what identifies it: the original encoded bytes, or mode+size+pixels
    what: str  # a short description for error messages
    decoded: Any = None  # set when the caller handed over a decoded object


@dataclass
class DecodedVideo:
    frames: np.ndarray  # [kept, H, W, 3] uint8
    fps: float | None  # None for frames handed in without a rate
    num_frames: int = 0  # frames in the video; 0: as many as were kept
    kept: list[int] | None = None  # which of them `frames` holds; None: all

    def __post_init__(self) -> None:
        self.num_frames = self.num_frames or len(self.frames)

    def select(self, indices: np.ndarray) -> np.ndarray:
        """The frames at these indices of the video (all of them must have been kept)."""
        if self.kept is None:
            return self.frames[indices]
        position = {i: p for p, i in enumerate(self.kept)}
        return self.frames[[position[int(i)] for i in indices]]


@dataclass
class MediaLimits:
    max_image_bytes: int = 20 << 20
    max_image_pixels: int = 64 << 20  # refused from the header, before the pixels are decoded
    max_video_bytes: int = 200 << 20
    max_video_frames: int = 3600  # decoded frames; beyond this the video is refused
    max_video_frame_pixels: int = 8 << 20
    allowed_local_media_path: str | None = None  # None: no local files
    allowed_media_domains: list[str] = field(default_factory=list)  # hosts http(s) may fetch from
    fetch_timeout: float = 10.0
    background: tuple[int, int, int] = (255, 255, 255)  # for transparent images, as transformers


class MediaLoader:
    def __init__(self, limits: MediaLimits | None = None) -> None:
        self.limits = limits or MediaLimits()

    def read(self, source: Any, modality: str) -> RawMedia:
        """Reads a source (checking where it may come from and how big it is)."""
        if modality == "image":
            if isinstance(source, np.ndarray):
                source = _array_to_image(source)
            if isinstance(source, Image.Image):
                return RawMedia("image", _pixel_identity(source), "image", decoded=source)
            data, what = self._read(source, self.limits.max_image_bytes, "image")
            return RawMedia("image", data, what)
        if modality == "video":
            if isinstance(source, (list, tuple)):  # frames: PIL images or arrays
                frames = [np.asarray(self.decode_image(self.read(f, "image"))) for f in source]
                if not frames:
                    raise MediaError("the video has no frames")
                if len({f.shape for f in frames}) != 1:
                    raise MediaError("all frames of a video must have the same size")
                source = np.stack(frames)
            if isinstance(source, np.ndarray):
                if source.ndim != 4 or source.shape[-1] != 3 or source.dtype != np.uint8:
                    raise MediaError(f"a video array must be uint8 [frames, H, W, 3], got {source.dtype} {source.shape}")
                identity = b"frames:" + str(source.shape).encode() + source.tobytes()
                return RawMedia("video", identity, "video frames", decoded=DecodedVideo(source, None))
            data, what = self._read(source, self.limits.max_video_bytes, "video")
            return RawMedia("video", data, what)
        raise MediaError(f"unsupported modality {modality!r}")

    # -- images ---------------------------------------------------------------------------
    def decode_image(self, raw: RawMedia) -> Image.Image:
        if raw.decoded is not None:
            return self._to_rgb(raw.decoded)
        what = raw.what
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(raw.content))
            # the header gives the size: refuse a decompression bomb before decoding it
            w, h = img.size
            if w * h > self.limits.max_image_pixels:
                raise MediaError(f"{what} is {w}x{h} pixels, over the {self.limits.max_image_pixels}-pixel limit")
            img.load()
            return self._to_rgb(ImageOps.exif_transpose(img))
        except MediaError:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise MediaError(f"{what} is too large to decode: {e}") from None
        except Image.UnidentifiedImageError:
            raise MediaError(f"{what} is not a readable image (not a known image format)") from None
        except Exception as e:  # PIL raises many types for broken files
            raise MediaError(f"{what} is not a readable image ({type(e).__name__}: {e})") from None

    def _to_rgb(self, img: Image.Image) -> Image.Image:
        if img.mode == "RGB":
            return img
        if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # 16-bit / float grey: scale to 8 bits
            arr = np.asarray(img, dtype=np.float64)
            top = 65535.0 if arr.max() > 255 else 255.0
            img = Image.fromarray((arr / top * 255).round().clip(0, 255).astype(np.uint8))
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, self.limits.background + (255,))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return img.convert("RGB")

    # -- videos ---------------------------------------------------------------------------
    def decode_video(self, raw: RawMedia, choose: FrameChooser | None = None) -> DecodedVideo:
        """All frames, or, when the container tells its frame count up front, only those
        choose(num_frames, fps) picks: the others are decoded (they must be, to reach the
        next) but never converted to RGB nor kept — a long clip costs a few frames' memory."""
        if raw.decoded is not None:
            return raw.decoded
        return self._decode_video(raw.content, raw.what, choose)

    def _decode_video(self, data: bytes, what: str, choose: FrameChooser | None) -> DecodedVideo:
        import av

        try:
            with av.open(io.BytesIO(data)) as container:
                if not container.streams.video:
                    raise MediaError(f"{what} has no video stream")
                stream = container.streams.video[0]
                if stream.width * stream.height > self.limits.max_video_frame_pixels:
                    raise MediaError(f"{what} frames are {stream.width}x{stream.height}, over the pixel limit")
                rate = stream.average_rate or stream.guessed_rate
                declared = stream.frames or 0
                wanted = None
                if choose is not None and declared:
                    wanted = {int(i) for i in choose(declared, float(rate) if rate else None)}
                frames, kept, count, broken = [], [], 0, 0
                # packet by packet, so that a damaged frame is skipped, not fatal
                for packet in container.demux(stream):
                    try:
                        decoded = packet.decode()
                    except av.error.FFmpegError:
                        broken += 1
                        continue
                    for frame in decoded:
                        if count >= self.limits.max_video_frames:
                            raise MediaError(f"{what} has more than {self.limits.max_video_frames} frames")
                        if wanted is None or count in wanted:
                            frames.append(frame.to_ndarray(format="rgb24"))
                            kept.append(count)
                        count += 1
        except MediaError:
            raise
        except Exception as e:  # av raises its own error types for broken containers
            raise MediaError(f"{what} is not a readable video ({type(e).__name__}: {e})") from None
        if not count:
            detail = f" ({broken} damaged packet(s))" if broken else ""
            raise MediaError(f"{what} has no decodable frame{detail}")
        if wanted is not None and count != declared:  # the header's count was wrong: keep every frame
            return self._decode_video(data, what, None)
        return DecodedVideo(np.stack(frames), float(rate) if rate else None, count, None if wanted is None else kept)

    # -- sources -------------------------------------------------------------------------
    def _read(self, source: Any, max_bytes: int, kind: str) -> tuple[bytes, str]:
        """The encoded bytes of a source, and a short description of it for errors."""
        if isinstance(source, (bytes, bytearray)):
            data, what = bytes(source), f"{kind} bytes"
        else:
            if isinstance(source, dict):  # OpenAI content part {"url": ...}
                source = source.get("url", source)
            if not isinstance(source, (str, os.PathLike)):
                raise MediaError(f"unsupported {kind} input of type {type(source).__name__}")
            source = str(source)
            if source.startswith("data:"):
                data, what = _decode_data_url(source), f"{kind} data URL"
            elif source.startswith(("http://", "https://")):
                data, what = self._fetch(source, max_bytes), source
            elif re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", source) and not source.startswith("file://"):
                scheme = source.split("://", 1)[0]
                raise MediaError(f"unsupported URL scheme {scheme!r} in {kind} URL: use http(s), a data URL or a "
                                 f"local file")
            else:
                path = source[len("file://") :] if source.startswith("file://") else source
                data, what = self._read_local(path, max_bytes), path
        if not data:
            raise MediaError(f"{what} is empty (0 bytes)")
        if len(data) > max_bytes:
            raise MediaError(f"{what} is {len(data)} bytes, over the {max_bytes}-byte limit")
        return data, what

    def _read_local(self, path: str, max_bytes: int) -> bytes:
        allowed = self.limits.allowed_local_media_path
        if allowed is None:
            raise MediaError(f"local file {path!r} refused: local media is not enabled (--allowed-local-media-path)")
        real = Path(path).expanduser().resolve()  # resolves '..' and symlinks
        root = Path(allowed).expanduser().resolve()
        if root != real and root not in real.parents:
            raise MediaError(f"local file {path!r} is outside the allowed media folder")
        if not real.is_file():
            raise MediaError(f"no such file: {path!r}")
        size = real.stat().st_size
        if size > max_bytes:
            raise MediaError(f"file {path!r} is {size} bytes, over the {max_bytes}-byte limit")
        return real.read_bytes()

    def _fetch(self, url: str, max_bytes: int) -> bytes:
        host = urllib.parse.urlsplit(url).hostname or ""
        allowed = {d.lower() for d in self.limits.allowed_media_domains}
        if host.lower() not in allowed:
            if not allowed:
                raise MediaError(f"fetching {url} refused: http(s) media is not enabled (--allowed-media-domains)")
            raise MediaError(f"fetching {url} refused: host {host!r} is not in the allowed media domains")
        timeout = self.limits.fetch_timeout
        # the timeout bounds the whole fetch (connect, headers, body), not each read: a
        # server that sends a byte now and then must not hold a processing thread for ever
        watchdog = _Watchdog(timeout)
        opener = urllib.request.build_opener(_SameHostRedirects(host), *watchdog.handlers())
        try:
            with opener.open(url, timeout=timeout) as resp:
                declared = resp.headers.get("Content-Length")
                if declared and declared.isdigit() and int(declared) > max_bytes:
                    raise MediaError(f"{url} is {declared} bytes, over the {max_bytes}-byte limit")
                data = resp.read(max_bytes + 1)
        except MediaError:
            raise
        except urllib.error.HTTPError as e:
            raise MediaError(f"fetching {url} failed: HTTP {e.code}") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            if watchdog.fired:
                raise MediaError(f"fetching {url} took longer than the {timeout:g} s timeout") from None
            reason = getattr(e, "reason", e)
            raise MediaError(f"fetching {url} failed: {reason}") from None
        finally:
            watchdog.cancel()
        if watchdog.fired:  # cut off mid-body: what was read is not the whole file
            raise MediaError(f"fetching {url} took longer than the {timeout:g} s timeout")
        if len(data) > max_bytes:
            raise MediaError(f"{url} is over the {max_bytes}-byte limit")
        return data


class _Watchdog:
    """Shuts a fetch's connections down once its time is up, which ends any read blocked
    on them. (Name resolution is not covered: it cannot be interrupted.)"""

    def __init__(self, seconds: float) -> None:
        self.sockets: list[socket.socket] = []
        self.fired = False
        self.lock = threading.Lock()
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self) -> None:
        with self.lock:
            self.fired = True
            for sock in self.sockets:
                _shut(sock)

    def watch(self, sock: socket.socket) -> None:
        with self.lock:
            self.sockets.append(sock)
            if self.fired:  # connected after the time was up
                _shut(sock)

    def cancel(self) -> None:
        self.timer.cancel()

    def handlers(self) -> list[urllib.request.BaseHandler]:
        """HTTP and HTTPS handlers whose connections (redirects' too) are watched."""
        watch = self.watch

        class Watched(http.client.HTTPConnection):
            def connect(self) -> None:
                super().connect()
                watch(self.sock)

        class WatchedTLS(http.client.HTTPSConnection):
            def connect(self) -> None:
                super().connect()
                watch(self.sock)

        class Handler(urllib.request.HTTPHandler):
            def http_open(self, req):
                return self.do_open(Watched, req)

        class TLSHandler(urllib.request.HTTPSHandler):
            def https_open(self, req):
                return self.do_open(WatchedTLS, req, context=self._context)

        return [Handler(), TLSHandler()]


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed already
        pass


class _SameHostRedirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, host: str) -> None:
        self.host = host.lower()

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        target = (urllib.parse.urlsplit(newurl).hostname or "").lower()
        if target != self.host:
            raise MediaError(f"fetching {req.full_url} refused: it redirects to another host ({target})")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


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
