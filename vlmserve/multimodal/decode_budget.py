"""The memory that decoding media takes, counted from headers before any pixel is decoded,
and a budget of it shared by every decode in flight.

A picture's file says little about what it costs: a 500 KB PNG of 8000 x 8000 pixels at
16 bits per channel took 1.5 GB of working memory to decode and process, and four of them
at once took a server from 1 GB to 8 GB. What a decode holds at its peak is a function of
the pixels (and a video's kept frames), known from the header: `image_decode_bytes` and
`video_decode_bytes` give an upper bound of it (checked in tests/test_hostile_inputs.py
against the process's measured peak), and `DecodeBudget` lets decodes run together only
while their bounds add up to its capacity: the others wait their turn (or, after a while,
are refused as a busy server is), and one that alone needs more than the capacity is
refused from its header.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from vlmserve.allocator import returning_freed_memory

# a picture's peak, a pixel at a time: its RGB copy (4 bytes in PIL) beside what the HF
# image processor makes of it at full size before it resizes (a converted copy, an array, a
# tensor, a stacked batch), the decoded picture itself being let go before. Measured at 16
# megapixels (tests/test_hostile_inputs.py): 14.1-14.6 bytes for every PNG mode, GIF, TIFF,
# BMP and CMYK JPEG; 17.4 for WebP, whose decoder keeps a buffer of its own
IMAGE_BYTES_PER_PIXEL = 20
# a decoder's and an image processor's own buffers, whatever the size
FIXED_BYTES = 16 << 20
# a decode this large gives its freed memory back to the system (the engine's allocator
# keeps freed memory for its next step: engine steps reuse it, but a rare large decode's
# pages would otherwise stay with the process)
GIVE_BACK_BYTES = 256 << 20


def image_decode_bytes(width: int, height: int) -> int:
    """The most memory that decoding a picture of this size to RGB and running the image
    processor on it holds at once."""
    return width * height * IMAGE_BYTES_PER_PIXEL + FIXED_BYTES


def video_decode_bytes(frames: int, width: int, height: int) -> int:
    """The most memory a video's kept frames hold: the decoded frames (RGB, 3 bytes a
    pixel) and the tensor the video processor makes of them."""
    return 2 * frames * width * height * 3 + FIXED_BYTES


class MediaBusyError(RuntimeError):
    """The server is decoding other large media and this item did not get its share of
    the decode memory in time: a busy server, not a bad request (503)."""


class DecodeBudget:
    """The decode memory that the decodes in flight may hold together."""

    def __init__(self, capacity: int, wait_seconds: float) -> None:
        self.capacity = capacity
        self.wait_seconds = wait_seconds
        self._used = 0
        self._cond = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Holds `nbytes` of the budget for the block (waiting while others hold too much);
        MediaBusyError if that takes longer than the wait. The caller has checked that
        `nbytes` fits the capacity."""
        nbytes = min(nbytes, self.capacity)
        with self._cond:
            if not self._cond.wait_for(lambda: self._used + nbytes <= self.capacity, timeout=self.wait_seconds):
                raise MediaBusyError(f"the server is decoding other large media and this item waited "
                                     f"{self.wait_seconds:g} s for its {nbytes >> 20} MB; try again")
            self._used += nbytes
        try:
            with returning_freed_memory() if nbytes >= GIVE_BACK_BYTES else nullcontext():
                yield
        finally:
            with self._cond:
                self._used -= nbytes
                self._cond.notify_all()
