"""The waiting queue: lowest priority value first, then earliest arrival.

A preempted request keeps its arrival time, so it goes back ahead of requests that
arrived after it.
"""

from __future__ import annotations

import heapq

from vlmserve.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self):
        return iter(sorted(self._heap))
