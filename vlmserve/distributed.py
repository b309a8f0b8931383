"""A tensor-parallel group: the ranks that each hold a part of every layer, and the two
collectives the layers need (a sum of partial outputs, a gather of column parts). With
one rank both are nothing, so a model that is not split runs the same code.

The groups are torch.distributed backends made directly over a store of their own (not
the process-wide default group): an engine's ranks stand apart from anything else in the
process, another engine's included, and go away with their engine."""

from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# how long a collective may wait for a rank (a rank that dies is seen at once: its
# connection closes; this bounds a rank that is alive but stuck)
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = field(default=None, repr=False)  # a torch.distributed backend (gloo or NCCL)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of their partial x (in place)."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of the ranks' x (in place)."""
        if self.size > 1:
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.MAX
            self.group.allreduce([x], options).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x (of one shape) side by side along dim, rank 0's first."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallel()


class Channel:
    """Rank 0's messages to every rank (any picklable object), over a gloo group of their
    own: apart from the model's collectives, and on the CPU whatever the model's device."""

    def __init__(self, group: Any, rank: int) -> None:
        self.group, self.rank = group, rank

    def send(self, message: Any) -> None:
        """Rank 0: every other rank receives message."""
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()]))
        self._broadcast(data)

    def receive(self) -> Any:
        size = torch.zeros(1, dtype=torch.long)
        self._broadcast(size)
        data = torch.empty(int(size), dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()


def join_group(backend: str, address: str, rank: int, size: int) -> tuple[TensorParallel, Channel]:
    """Joins the ranks (rank 0 listens on address, host:port): their group for the model's
    collectives (backend: gloo or nccl) and rank 0's channel to them."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT)
    gloo = dist.ProcessGroupGloo
    if backend == "nccl":
        model_group = dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, size)
    else:
        model_group = gloo(dist.PrefixStore("model", store), rank, size, COLLECTIVE_TIMEOUT)
    control = gloo(dist.PrefixStore("control", store), rank, size, COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size, model_group), Channel(control, rank)
