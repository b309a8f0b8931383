"""What one schedule() call has decided so far: the requests it takes, their tokens,
blocks, media and drafts, and the budgets left. It lives for that call only."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmserve.request import Request


@dataclass
class StepPlan:
    """What one schedule() call has decided so far; it lives for that call only."""

    token_budget: int
    encoder_budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)  # request -> its media encoded now
    encoder_cost: dict[str, int] = field(default_factory=dict)  # request -> encoder budget it took
    new_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)  # per attention group
    running: list[Request] = field(default_factory=list)  # running before, scheduled now
    new: list[Request] = field(default_factory=list)  # from the waiting queue
    preempted: list[Request] = field(default_factory=list)
    encoding: set[str] = field(default_factory=set)  # mm_hashes sent to the encoder (or loaded)
    encoder_loads: dict[str, bytes] = field(default_factory=dict)  # mm_hash -> its output from a KV connector
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request -> its drafts checked now

    def add(self, request: Request, num_new: int, to_encode: list[int], cost: int, blocks: list[list[int]],
            new: bool = False) -> None:
        rid = request.request_id
        (self.new if new else self.running).append(request)
        self.num_scheduled[rid] = num_new
        self.token_budget -= num_new
        self.encoder_budget -= cost
        self.new_block_ids[rid] = blocks
        if to_encode:
            self.encoder_inputs[rid] = to_encode
            self.encoder_cost[rid] = cost

    def remove(self, request: Request) -> list[int]:
        """Takes a running request back out of the step; returns its encoder inputs."""
        rid = request.request_id
        self.running.remove(request)
        self.token_budget += self.num_scheduled.pop(rid)
        self.encoder_budget += self.encoder_cost.pop(rid, 0)
        self.new_block_ids.pop(rid)
        self.drafts.pop(rid, None)
        return self.encoder_inputs.pop(rid, [])
