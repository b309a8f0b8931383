"""The groups of a model split across ranks. A tensor-parallel group: the ranks that each
hold a part of every layer, and the collectives the layers need (a sum of partial outputs,
a gather of column parts). A pipeline: stages of consecutive layers, each a tensor-parallel
group, handing the hidden states on to the next stage. With one rank, one stage, all of it
is nothing, so a model that is not split runs the same code.

The groups are torch.distributed backends made directly over a store of their own (not
the process-wide default group): an engine's ranks stand apart from anything else in the
process, another engine's included, and go away with their engine."""

from __future__ import annotations

import datetime
import pickle
from collections import deque
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


@dataclass
class PipelineStage:
    """A rank's stage of the pipeline: stage `stage` of `size`, each `stride` ranks (its
    tensor-parallel group) wide, so that a rank's counterpart in the next stage is rank +
    stride. Hidden states go from stage to stage point to point; the last stage's output
    goes to every rank, which all sample the same tokens from it (as under tensor
    parallelism), so every rank's batch stays the same.

    Both go in the background: a forward sends its hidden state on and starts receiving
    the last stage's output, and the rank may go on with the next step's forward before
    it takes this one's (`wait_oldest`), as steps of other requests are pipelined."""

    stage: int = 0
    size: int = 1
    rank: int = 0  # among all the ranks
    stride: int = 1
    group: Any = field(default=None, repr=False)  # every rank's (gloo or NCCL)
    # per forward, oldest first: its send to the next stage (None on the last) and the
    # last stage's output reaching this rank
    _in_flight: deque = field(default_factory=deque, repr=False)
    _send: Any = field(default=None, repr=False)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def send_on(self, x: torch.Tensor) -> None:
        """To the next stage's counterpart of this rank."""
        self._send = self.group.send([x.contiguous()], self.rank + self.stride, 0)

    def receive(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """What the previous stage's counterpart of this rank sent on."""
        x = torch.empty(shape, dtype=dtype, device=device)
        self.group.recv([x], self.rank - self.stride, 0).wait()
        return x

    def share_output(self, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
        """The last stage's out (of shape) on every rank: filled once `wait_oldest` has
        returned for this forward."""
        if self.size == 1:
            return out
        x = out.contiguous() if self.is_last else torch.empty(shape, dtype=dtype, device=device)
        self._in_flight.append((self._send, self.group.broadcast(x, (self.size - 1) * self.stride)))
        self._send = None
        return x

    def wait_oldest(self) -> None:
        """Waits for the oldest forward's send and output (nothing: one stage)."""
        if self.size == 1:
            return
        for work in self._in_flight.popleft():
            if work is not None:
                work.wait()


ONE_STAGE = PipelineStage()


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


def join_group(backend: str, address: str, rank: int, tp_size: int, pp_size: int = 1
               ) -> tuple[TensorParallel, PipelineStage, Channel]:
    """Joins the tp_size x pp_size ranks (rank 0 listens on address, host:port; ranks
    stage-major): the tensor-parallel group of the rank's stage and the pipeline (backend:
    gloo or nccl, for the model's collectives), and rank 0's channel to them all."""
    host, port = address.rsplit(":", 1)
    size = tp_size * pp_size
    store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=COLLECTIVE_TIMEOUT)

    def group(name: str, rank: int, size: int, backend: str = backend) -> Any:
        if size == 1:
            return None
        if backend == "nccl":
            return dist.ProcessGroupNCCL(dist.PrefixStore(name, store), rank, size)
        return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, COLLECTIVE_TIMEOUT)

    stage, tp_rank = divmod(rank, tp_size)
    tp = TensorParallel(tp_rank, tp_size, group(f"model-{stage}", tp_rank, tp_size))
    pipeline = PipelineStage(stage, pp_size, rank, tp_size, group("pipeline", rank, size) if pp_size > 1 else None)
    return tp, pipeline, Channel(group("control", rank, size, "gloo"), rank)
