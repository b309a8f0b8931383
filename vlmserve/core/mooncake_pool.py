"""A Mooncake pool of KV blocks shared by engines (vLLM's MooncakeStoreConnector,
`--kv-transfer-config`): the scheduler's side.

Blocks a step fills are put in the pool (after the forward, by the runner); a new request's
prefix hit goes on with blocks any engine on the pool put there, fetched while the request
is scheduled, so a hit only counts blocks whose bytes are in hand. The media's encoder
outputs are shared the same way: a picture another engine encoded is not encoded again
(the tokens of its that a hit leaves to compute need it). A pool that is down, or
a block gone from it, is a miss: the engine computes the tokens itself and says so in a
warning (once a minute), never a failed request.

Keys: `<namespace>/<block hash>-<group>`; the namespace names the model, its KV layout and
the rank, so engines share blocks only where they would compute the same bytes.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from vlmserve.core.block_pool import BlockHashWithGroup
from vlmserve.core.kv_connector import KVConnector

logger = logging.getLogger(__name__)

QUIET_SECONDS = 60.0  # between warnings of a pool that fails
MAX_KNOWN = 1 << 20  # names remembered as in the pool (not put again)

_clients: dict[str, Any] = {}  # one client per pool in a process: the scheduler's and the runner's


@dataclass(frozen=True)
class PoolSettings:
    """What an engine's scheduler and runner agree on about the pool."""

    settings_json: str  # the Mooncake client's settings (config.KVTransferConfig.mooncake_settings)
    namespace: str
    role: str  # kv_both, kv_producer, kv_consumer

    @property
    def settings(self) -> dict:
        return json.loads(self.settings_json)


def pool_client(pool: PoolSettings) -> Any | None:
    """The process's client of the pool (None, with a warning, if it cannot be reached)."""
    if pool.settings_json not in _clients:
        s = pool.settings
        if not _listening(s["master_server_address"]):  # the client's own setup tries for 90 s first
            logger.warning("the Mooncake pool's master at %s does not answer: KV blocks are cached locally only",
                           s["master_server_address"])
            _clients[pool.settings_json] = None
            return None
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        rc = store.setup(s["local_hostname"], s["metadata_server"], int(s["global_segment_size"]),
                         int(s["local_buffer_size"]), s["protocol"], s["device_name"], s["master_server_address"])
        if rc != 0:
            logger.warning("the Mooncake pool at %s cannot be reached (setup returned %s): KV blocks are cached "
                           "locally only", s["master_server_address"], rc)
            store = None
        _clients[pool.settings_json] = store
    return _clients[pool.settings_json]


def encoder_output_name(pool: PoolSettings, mm_hash: str) -> str:
    """Where a medium's encoder output is in the pool (its hash covers the pixels and every
    setting that changes them)."""
    return f"{pool.namespace}/encoder/{mm_hash}"


def _listening(address: str, timeout: float = 3.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


class MooncakeConnector(KVConnector):
    def __init__(self, pool: PoolSettings, block_bytes: int) -> None:
        super().__init__()
        self.pool = pool
        self.client = pool_client(pool)
        self.block_bytes = block_bytes
        self.staged: dict[str, bytes] = {}  # fetched for the requests looked up this step
        self.known: OrderedDict[str, None] = OrderedDict()  # in the pool: not put again
        self.warned_at = -QUIET_SECONDS

    def name(self, key: BlockHashWithGroup) -> str:
        return f"{self.pool.namespace}/{key[0].hex()}-{key[1]}"

    def find(self, keys: list[BlockHashWithGroup]) -> int:
        if self.client is None or self.pool.role == "kv_producer":
            return 0
        names = [self.name(k) for k in keys]
        n = 0
        while n < len(names) and names[n] in self.staged:
            n += 1
        if n == len(names):
            return n
        start = time.perf_counter()
        try:
            present = self.client.batch_is_exist(names[n:])
            m = 0
            while m < len(present) and present[m] == 1:
                m += 1
            values = self.client.get_batch(names[n:n + m]) if m else []
        except Exception as e:  # the pool's client raises on a lost connection
            self.warn(f"looking blocks up failed ({type(e).__name__}: {e})")
            return n
        finally:
            self.stats.fetch_seconds += time.perf_counter() - start
        for name, value in zip(names[n:], values):
            if value is None or len(value) != self.block_bytes:  # gone since, or not a block of this layout
                break
            self.staged[name] = value
            self.remember(name)
            n += 1
        return n

    def encoder_output(self, mm_hash: str) -> bytes | None:
        if self.client is None or self.pool.role == "kv_producer":
            return None
        name = encoder_output_name(self.pool, mm_hash)
        start = time.perf_counter()
        try:
            value = self.client.get_batch([name])[0] if self.client.batch_is_exist([name]) == [1] else None
        except Exception as e:  # the pool's client raises on a lost connection
            self.warn(f"looking an encoder output up failed ({type(e).__name__}: {e})")
            return None
        finally:
            self.stats.fetch_seconds += time.perf_counter() - start
        return value or None

    def reserve(self, keys: list[BlockHashWithGroup]) -> list[bytes]:
        return [self.staged.pop(self.name(k)) for k in keys]

    def computed(self, device_blocks: list[int], keys: list[BlockHashWithGroup]) -> None:
        if self.client is None or self.pool.role == "kv_consumer":
            return
        for block, key in zip(device_blocks, keys):
            name = self.name(key)
            if name not in self.known:
                self.step.saves_after.append((block, name))
                self.remember(name)
                self.stats.blocks_saved += 1

    def take_transfers(self):
        self.staged.clear()  # a request still waiting looks its blocks up again next step
        return super().take_transfers()

    def remember(self, name: str) -> None:
        self.known[name] = None
        self.known.move_to_end(name)
        if len(self.known) > MAX_KNOWN:
            self.known.popitem(last=False)

    def reset(self) -> None:
        self.known.clear()
        self.staged.clear()

    def warn(self, what: str) -> None:
        now = time.monotonic()
        if now - self.warned_at >= QUIET_SECONDS:
            self.warned_at = now
            logger.warning("the Mooncake pool: %s; the tokens are computed here instead", what)
