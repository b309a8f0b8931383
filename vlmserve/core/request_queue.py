"""The waiting queue: lowest priority value first, then earliest arrival.

A preempted request keeps its arrival time, so it goes back ahead of requests that
arrived after it.
"""

from __future__ import annotations

import heapq

from vlmserve.request import Request


class WaitingQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], Request]] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.scheduling_key, request))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self):
        return (request for _, request in sorted(self._heap, key=lambda entry: entry[0]))
