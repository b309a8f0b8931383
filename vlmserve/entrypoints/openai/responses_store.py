"""Stored responses (`store: true`), for GET /v1/responses/{id} and previous_response_id:
each response's body and the conversation it ended (as chat messages), kept in memory,
bounded by count and by size, the oldest evicted first."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response as it was answered
    conversation: list[dict[str, Any]]  # its input (earlier turns included) and its output, as chat messages
    size: int  # bytes, roughly: what the bound counts


class ResponseStore:
    def __init__(self, max_entries: int = 1024, max_bytes: int = 256 << 20) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response_id: str, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(body, default=str)) + len(json.dumps(conversation, default=str))
        if size > self.max_bytes:
            logger.warning("response %s is %d bytes, over the store's %d: not stored", response_id, size,
                           self.max_bytes)
            return
        with self._lock:
            self._entries[response_id] = StoredResponse(body, conversation, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.size

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry.size
            return entry is not None

    def __len__(self) -> int:
        return len(self._entries)
