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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from vlmserve.multimodal.decode_budget import DecodeBudget, image_decode_bytes, video_decode_bytes


FrameChooser = Callable[[int, "float | None"], Any]  # (frames in the video, fps) -> indices to keep


IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif"}
VIDEO_EXTENSIONS = {".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v"}
GREY_HIGH_DEPTH = ("I;16", "I;16B", "I;16L", "I", "F")  # scaled to 8 bits, not clipped
STRIP_ROWS = 256  # rows converted to RGB at a time


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
        """The frames at these indices of the video (all of them must have been kept); the
        kept frames themselves, not a copy, where they are all asked for in order."""
        if self.kept is None:
            positions = [int(i) for i in indices]
        else:
            position = {i: p for p, i in enumerate(self.kept)}
            positions = [position[int(i)] for i in indices]
        if positions == list(range(len(self.frames))):
            return self.frames
        return self.frames[positions]


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
    # what the decodes in flight may hold together (one item alone no more), and how long
    # an item waits for its share before the server answers busy (decode_budget.py)
    decode_memory_bytes: int = 2 << 30
    decode_wait_seconds: float = 60.0


class MediaLoader:
    def __init__(self, limits: MediaLimits | None = None) -> None:
        self.limits = limits or MediaLimits()
        self.budget = DecodeBudget(self.limits.decode_memory_bytes, self.limits.decode_wait_seconds)

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

    # -- decoding, within the decode budget ----------------------------------------------
    @contextmanager
    def decoding(self, raw: RawMedia, choose: FrameChooser | None = None) -> Iterator[Any]:
        """The item decoded (an RGB picture, or a DecodedVideo of the frames `choose`
        picks), holding its share of the decode budget for the block, in which the caller
        processes it: its size is checked from the header first, and an item that alone
        needs more memory than the budget is refused before anything is decoded."""
        if raw.modality == "image":
            img = raw.decoded if raw.decoded is not None else self._open_image(raw)
            with self._holding(image_decode_bytes(img.width, img.height), raw.what):
                # rebound, so that the decoded picture is let go once its RGB copy is made
                img = self._to_rgb(img if raw.decoded is not None else self._loaded(img, raw.what))
                yield img
            return
        if raw.decoded is not None:
            video = raw.decoded
            with self._holding(video_decode_bytes(len(video.frames), *video.frames.shape[1:3]), raw.what):
                yield video
            return
        with self._decoded_video(raw.content, raw.what, choose) as video:
            yield video

    def decode_image(self, raw: RawMedia) -> Image.Image:
        with self.decoding(raw) as img:
            return img

    def decode_video(self, raw: RawMedia, choose: FrameChooser | None = None) -> DecodedVideo:
        """All frames, or only those choose(num_frames, fps) picks: the others are decoded
        (they must be, to reach the next) but never converted to RGB nor kept — a long
        clip costs a few frames' memory."""
        with self.decoding(raw, choose) as video:
            return video

    @contextmanager
    def _holding(self, nbytes: int, what: str) -> Iterator[None]:
        budget = self.budget
        if nbytes > budget.capacity:
            raise MediaError(f"{what} needs about {nbytes >> 20} MB of memory to decode, over the "
                             f"{budget.capacity >> 20} MB the server decodes media in (--media-decode-memory-gb)")
        with budget.hold(nbytes):
            yield

    # -- images ---------------------------------------------------------------------------
    def _open_image(self, raw: RawMedia) -> Image.Image:
        """The picture with its header read, its pixels not yet decoded."""
        what = raw.what
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(raw.content))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise MediaError(f"{what} is too large to decode: {e}") from None
        except Image.UnidentifiedImageError:
            raise MediaError(f"{what} is not a readable image (not a known image format)") from None
        except Exception as e:  # PIL raises many types for broken files
            raise MediaError(f"{what} is not a readable image ({type(e).__name__}: {e})") from None
        w, h = img.size
        if w * h > self.limits.max_image_pixels:
            raise MediaError(f"{what} is {w}x{h} pixels, over the {self.limits.max_image_pixels}-pixel limit")
        return img

    @staticmethod
    def _loaded(img: Image.Image, what: str) -> Image.Image:
        try:
            img.load()
            ImageOps.exif_transpose(img, in_place=True)
        except Exception as e:  # PIL raises many types for broken files
            raise MediaError(f"{what} is not a readable image ({type(e).__name__}: {e})") from None
        return img

    def _to_rgb(self, img: Image.Image) -> Image.Image:
        """RGB as transformers makes it (transparency over the background), made a strip of
        rows at a time: beside the picture, only its RGB copy and one strip are held."""
        if img.mode == "RGB":
            return img
        scale = None
        if img.mode in GREY_HIGH_DEPTH:  # scaled to 8 bits by the picture's own range
            scale = 65535.0 if img.getextrema()[1] > 255 else 255.0
        alpha = scale is None and ("A" in img.getbands() or img.info.get("transparency") is not None)
        out = Image.new("RGB", img.size)
        for top in range(0, img.height, STRIP_ROWS):
            box = (0, top, img.width, min(top + STRIP_ROWS, img.height))
            out.paste(self._strip_to_rgb(img.crop(box), scale, alpha), box[:2])
        return out

    def _strip_to_rgb(self, img: Image.Image, scale: float | None, alpha: bool) -> Image.Image:
        if scale is not None:
            arr = np.asarray(img, dtype=np.float64)
            return Image.fromarray((arr / scale * 255).round().clip(0, 255).astype(np.uint8)).convert("RGB")
        if alpha:
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, self.limits.background + (255,))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return img.convert("RGB")

    # -- videos ---------------------------------------------------------------------------
    @contextmanager
    def _decoded_video(self, data: bytes, what: str, choose: FrameChooser | None) -> Iterator[DecodedVideo]:
        """Reads the container's frame count (or counts its packets), picks the frames to
        keep, holds their decode memory, and decodes. Where the count was wrong, the frames
        are picked again from the true one and decoded again, within the memory held."""
        import av

        try:
            with av.open(io.BytesIO(data)) as container:
                stream = self._video_stream(container, what)
                size, rate = (stream.width, stream.height), stream.average_rate or stream.guessed_rate
                fps = float(rate) if rate else None
                count = stream.frames or _count_packets(container, stream)
        except MediaError:
            raise
        except Exception as e:  # av raises its own error types for broken containers
            raise MediaError(f"{what} is not a readable video ({type(e).__name__}: {e})") from None
        if not count:
            raise MediaError(f"{what} has no decodable frame")
        wanted = self._wanted(min(count, self.limits.max_video_frames), fps, choose)
        room = len(wanted) + max(2, len(wanted) // 8)  # a count a little off decodes again within this
        with self._holding(video_decode_bytes(room, *size), what):
            video = self._decode_frames(data, what, wanted)
            if video.num_frames != count:
                again = self._wanted(video.num_frames, fps, choose)
                if len(again) > room:
                    raise MediaError(f"{what} says it has {count} frames but holds {video.num_frames}")
                if again != wanted:
                    video = self._decode_frames(data, what, again)
            yield video

    def _video_stream(self, container, what: str):
        if not container.streams.video:
            raise MediaError(f"{what} has no video stream")
        stream = container.streams.video[0]
        if stream.width * stream.height > self.limits.max_video_frame_pixels:
            raise MediaError(f"{what} frames are {stream.width}x{stream.height}, over the pixel limit")
        return stream

    @staticmethod
    def _wanted(count: int, fps: float | None, choose: FrameChooser | None) -> list[int]:
        if choose is None:
            return list(range(count))
        return sorted({int(i) for i in choose(count, fps) if 0 <= int(i) < count})

    def _decode_frames(self, data: bytes, what: str, wanted: list[int]) -> DecodedVideo:
        """Decodes every frame, keeping (as RGB) those in `wanted`, in an array made once."""
        import av

        keep = set(wanted)
        frames, kept, count, broken = None, [], 0, 0
        try:
            with av.open(io.BytesIO(data)) as container:
                stream = self._video_stream(container, what)
                rate = stream.average_rate or stream.guessed_rate
                frames = np.empty((len(wanted), stream.height, stream.width, 3), np.uint8)
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
                        if count in keep:
                            if (frame.width, frame.height) != (stream.width, stream.height):
                                raise MediaError(f"{what} changes its frame size mid-stream")
                            frames[len(kept)] = frame.to_ndarray(format="rgb24")
                            kept.append(count)
                        count += 1
        except MediaError:
            raise
        except Exception as e:  # av raises its own error types for broken containers
            raise MediaError(f"{what} is not a readable video ({type(e).__name__}: {e})") from None
        if not count:
            detail = f" ({broken} damaged packet(s))" if broken else ""
            raise MediaError(f"{what} has no decodable frame{detail}")
        every = len(kept) == count
        return DecodedVideo(frames[: len(kept)], float(rate) if rate else None, count, None if every else kept)

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
                data, what = _decode_data_url(source, kind), f"{kind} data URL"
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


def _count_packets(container, stream) -> int:
    """A video's frames, for a container that does not say: its packets (one frame each
    for the codecs in use; the decode checks, media.py's caller decodes again if not)."""
    return sum(1 for packet in container.demux(stream) if packet.size)


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


def _decode_data_url(url: str, kind: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("malformed data URL: no ',' separating header and data")
    if not header.endswith(";base64"):
        raise MediaError("data URLs must be base64-encoded (data:<mime>;base64,...)")
    mime = header[len("data:"):].split(";")[0].strip().lower()
    if mime and not mime.startswith(f"{kind}/") and mime != "application/octet-stream":
        article = "an" if kind == "image" else "a"
        raise MediaError(f"a data URL of type {mime!r} is not {article} {kind} (data:{kind}/<format>;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("data URL payload is not valid base64") from None
