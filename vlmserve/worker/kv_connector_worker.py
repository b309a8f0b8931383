"""The runner's side of a KV connector (core/kv_connector.py keeps the books): it copies
blocks between the device cache and the connector's store as each step's KVTransfers say.
A block's bytes are one row of every attention layer's keys and values, as the device
cache lays them out, in layer order."""

from __future__ import annotations

import io
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vlmserve.core.kv_cache_spec import KVCacheConfig
from vlmserve.core.kv_connector import KVTransfers
from vlmserve.core.mooncake_pool import PoolSettings, encoder_output_name, pool_client

logger = logging.getLogger(__name__)


class KVConnectorWorker:
    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        """kv_caches: the attention layers' key and value caches, block id first (each once)."""
        # bytes, whatever the cache's dtype (an FP8 cache has no index ops of its own)
        self.device_caches = [t.view(torch.uint8) for t in kv_caches]
        self.seconds = {"save": 0.0, "load": 0.0}  # spent copying, cumulative (the pool's puts included)

    def timed(self, direction: str, since: float) -> None:
        self.seconds[direction] += time.perf_counter() - since

    def before_forward(self, transfers: KVTransfers) -> None:
        """The step's saves of evicted blocks, then its loads."""

    def after_forward(self, transfers: KVTransfers) -> None:
        """The step's saves of the blocks its forward filled."""

    def encoder_outputs(self, loads: dict[str, tuple[bytes, int]]) -> dict[str, torch.Tensor]:
        """Media outputs another engine made, as the encoder cache keeps them."""
        raise RuntimeError("this KV connector stores no encoder outputs")

    def encoder_outputs_made(self, outputs: dict[str, torch.Tensor]) -> None:
        """The step's media outputs, made here."""

    def shutdown(self) -> None:
        pass

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """(len(blocks), bytes a block) on the host."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device_caches[0].device)
        return torch.cat([t.index_select(0, index).reshape(len(blocks), -1) for t in self.device_caches],
                         dim=1).cpu()

    def write_blocks(self, blocks: list[int], rows: torch.Tensor) -> None:
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device_caches[0].device)
        start = 0
        for t in self.device_caches:
            width = t[0].numel()
            part = rows[:, start:start + width].reshape(len(blocks), *t.shape[1:])
            t.index_copy_(0, index, part.to(t.device))
            start += width


class HostKVStore(KVConnectorWorker):
    """The host tier's memory: a slot holds one block of every layer."""

    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        super().__init__(kv_caches)
        pin = kv_caches[0].device.type == "cuda"
        self.host_caches = [torch.empty((num_slots, *t.shape[1:]), dtype=torch.uint8, pin_memory=pin)
                            for t in self.device_caches]

    def before_forward(self, transfers: KVTransfers) -> None:
        if transfers.saves:
            start = time.perf_counter()
            blocks, slots = zip(*transfers.saves)
            self._copy(self.device_caches, blocks, self.host_caches, slots)
            self.timed("save", start)
        if transfers.loads:
            start = time.perf_counter()
            slots, blocks = zip(*transfers.loads)
            self._copy(self.host_caches, slots, self.device_caches, blocks)
            self.timed("load", start)

    @staticmethod
    def _copy(sources: list[torch.Tensor], rows: tuple[int, ...], destinations: list[torch.Tensor],
              to_rows: tuple[int, ...]) -> None:
        src_index = torch.tensor(rows, dtype=torch.int64, device=sources[0].device)
        dst_index = torch.tensor(to_rows, dtype=torch.int64, device=destinations[0].device)
        for src, dst in zip(sources, destinations):
            dst.index_copy_(0, dst_index, src.index_select(0, src_index).to(dst.device))


class PoolKVStore(KVConnectorWorker):
    """A Mooncake pool's: loads come with their bytes (fetched by the scheduler's side);
    saves are read off the device after the forward and put in the pool on a thread of
    their own (the next step does not wait for the network; a prefill replica's does)."""

    def __init__(self, kv_caches: list[torch.Tensor], pool: PoolSettings) -> None:
        super().__init__(kv_caches)
        self.pool = pool
        self.client = pool_client(pool)
        self.putter = ThreadPoolExecutor(1, thread_name_prefix="vlmserve-kv-put")
        # a prefill replica's output means its prompt is in the pool: it waits for its puts
        self.wait_for_puts = pool.role == "kv_producer"

    def before_forward(self, transfers: KVTransfers) -> None:
        if transfers.loads:
            start = time.perf_counter()
            data, blocks = zip(*transfers.loads)
            rows = torch.stack([torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data])
            self.write_blocks(list(blocks), rows)
            self.timed("load", start)

    def after_forward(self, transfers: KVTransfers) -> None:
        if transfers.saves_after and self.client is not None and self.pool.role != "kv_consumer":
            blocks, names = zip(*transfers.saves_after)
            rows = self.read_blocks(list(blocks)).numpy()
            self._submit(list(names), [row.tobytes() for row in rows])

    def encoder_outputs(self, loads: dict[str, tuple[bytes, int]]) -> dict[str, torch.Tensor]:
        outputs = {}
        for mm_hash, (data, rows) in loads.items():
            out = torch.load(io.BytesIO(data), weights_only=True)  # tensors only: nothing a store could run
            if not isinstance(out, torch.Tensor) or out.shape[0] != rows:
                raise RuntimeError(f"the Mooncake pool's encoder output of {mm_hash} is not {rows} embeddings")
            outputs[mm_hash] = out.to(self.device_caches[0].device)
        return outputs

    def encoder_outputs_made(self, outputs: dict[str, torch.Tensor]) -> None:
        if self.client is None or self.pool.role == "kv_consumer":
            return
        values = []
        for out in outputs.values():
            buf = io.BytesIO()
            torch.save(out.cpu(), buf)
            values.append(buf.getvalue())
        self._submit([encoder_output_name(self.pool, h) for h in outputs], values)

    def _submit(self, names: list[str], values: list[bytes]) -> None:
        done = self.putter.submit(self._put, names, values)
        if self.wait_for_puts:
            done.result()

    def _put(self, names: list[str], values: list[bytes]) -> None:
        start = time.perf_counter()
        try:
            rc = self.client.put_batch(names, values)
        except Exception as e:  # the pool's client raises on a lost connection
            rc = f"{type(e).__name__}: {e}"
        self.timed("save", start)
        if rc != 0:
            logger.warning("the Mooncake pool did not take %d KV blocks or encoder outputs (%s): other engines compute "
                           "them", len(names), rc)

    def shutdown(self) -> None:
        self.putter.shutdown(wait=True)


def make_connector_worker(config: KVCacheConfig, kv_caches: list[torch.Tensor]) -> KVConnectorWorker | None:
    """The runner's side of the KV connector the config names, if any."""
    if config.pool is not None:
        return PoolKVStore(kv_caches, config.pool)
    if config.num_host_blocks:
        return HostKVStore(kv_caches, config.num_host_blocks)
    return None
