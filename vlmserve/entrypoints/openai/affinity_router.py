"""A Ray Serve request router that sends a request to the engine replica most likely to
hold its prefix and its pictures: the keys of a request (see `replicas.affinity_keys`) are
the `mm_hash` of each picture or video, or for a text-only prompt its opening text; the router
remembers which replica each key last went to and picks the replica holding most of them
— unless that replica has `imbalance` more requests in flight than the least loaded one,
which then gets the request. Ray Serve's stock prefix router keys on the prompt text only,
so two chats about one picture may land on two replicas and both encode it.

The router runs in the process that holds the deployment handle (the ingress); what it
decides is counted in `routing_stats.ROUTING`, which the ingress exports on /metrics.
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# a module, not its ROUTING: Ray Serve pickles this module by value to build the router,
# so a global of it would be a copy, not the counters the ingress exports
from vlmserve.entrypoints.openai import routing_stats

KEYS_KWARG = "affinity_keys"  # the generate() keyword argument that carries a request's keys
PICTURE_KEY = "mm:"  # keys of pictures and videos start with it; the prompt's text key with "text:"
MAX_UNROUTED = 10_000  # decisions kept for requests not routed yet (one cancelled first never is)


class PictureAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance: int = 4, max_keys: int = 200_000) -> None:
        self.imbalance = imbalance
        self.max_keys = max_keys
        self.owner: OrderedDict[str, ReplicaID] = OrderedDict()  # key -> replica it last went to (LRU)
        self.in_flight: dict[ReplicaID, int] = {}
        self.turn = 0  # equally loaded replicas take turns
        self.request_replica: dict[str, ReplicaID] = {}  # internal request id -> its replica
        self.pending_decision: OrderedDict[str, tuple[str, int, int]] = OrderedDict()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        load = {r.replica_id: self.in_flight.get(r.replica_id, 0) for r in candidate_replicas}
        by_load = sorted(candidate_replicas, key=lambda r: load[r.replica_id])
        keys = list((pending_request.kwargs.get(KEYS_KWARG) if pending_request else None) or [])
        score = {r.replica_id: 0 for r in candidate_replicas}
        for key in keys:
            owner = self.owner.get(key)
            if owner in score:
                score[owner] += 1
        best = max(by_load, key=lambda r: score[r.replica_id])  # ties: the least loaded
        least = [r for r in by_load if load[r.replica_id] == load[by_load[0].replica_id]]
        lightest = least[self.turn % len(least)]
        if score[best.replica_id] == 0:
            chosen, decision = lightest, "least_loaded"
            self.turn += 1
        elif load[best.replica_id] - load[lightest.replica_id] > self.imbalance:
            chosen, decision = lightest, "imbalanced"
        else:
            chosen, decision = best, "affinity"
        if pending_request is not None:
            pictures = [k for k in keys if k.startswith(PICTURE_KEY)]
            hits = sum(self.owner.get(k) == chosen.replica_id for k in pictures)
            self.pending_decision[pending_request.metadata.internal_request_id] = (decision, len(pictures), hits)
            while len(self.pending_decision) > MAX_UNROUTED:
                self.pending_decision.popitem(last=False)
        return [[chosen], [r for r in by_load if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        decision = self.pending_decision.pop(request_id, None)
        if decision is not None:
            routing_stats.ROUTING.count(*decision)
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self.request_replica[request_id] = replica_id
        for key in pending_request.kwargs.get(KEYS_KWARG) or []:
            self.owner[key] = replica_id
            self.owner.move_to_end(key)
        while len(self.owner) > self.max_keys:
            self.owner.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.request_replica.pop(internal_request_id, None) is not None:
            self.in_flight[replica_id] = max(0, self.in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.in_flight.pop(replica_id, None)
        for request_id in [r for r, replica in self.request_replica.items() if replica == replica_id]:
            del self.request_replica[request_id]
        for key in [k for k, owner in self.owner.items() if owner == replica_id]:
            del self.owner[key]
