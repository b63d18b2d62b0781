"""The workers registered with the rollouter, and what is out with each of them.

`Worker` is one agent or reward worker as the rollouter knows it (its credits, the trajectories
out with it as they were dispatched, those it holds through a sync); `WorkerPool` indexes them
so that a dispatch finds the freest worker of a kind in O(log workers).
"""

from __future__ import annotations

import collections
import heapq
import itertools
from dataclasses import dataclass, field

from rollmesh.wire.messages import Trajectory

__all__ = ["Worker", "WorkerPool"]


@dataclass
class Worker:
    peer: bytes
    name: str
    kind: str
    credits: int
    out: dict[str, Trajectory] = field(default_factory=dict)  # sample id -> as dispatched
    held: set[str] = field(default_factory=set)  # of `out`: held by the worker through a sync

    @property
    def free(self) -> int:
        return self.credits - len(self.out)


class WorkerPool:
    """The registered workers, with an index of the freest one per kind.

    A dispatch takes the worker of its kind with the most free credits (ties: the one that has
    waited longest), in O(log workers): one lazy max-heap per kind whose entries are
    (free credits when pushed, order, worker), pushed at every change of a worker's load and
    checked against its load now when they reach the top (benchmarks/simulate.py --scale: the
    scan of every worker per dispatch made one rollouter saturate at ~1,100 GPUs). Trajectories
    go to a worker and come back only through `give` and `take_back`, which keep the per-kind
    counts of what is out (what a pause drains) exact.
    """

    def __init__(self) -> None:
        self._by_peer: dict[bytes, Worker] = {}
        self._heaps: dict[str, list[tuple[int, int, Worker]]] = collections.defaultdict(list)
        self._out: collections.Counter[str] = collections.Counter()
        self._order = itertools.count()

    def get(self, peer: bytes) -> Worker | None:
        return self._by_peer.get(peer)

    def values(self):
        return self._by_peer.values()

    def __len__(self) -> int:
        return len(self._by_peer)

    def add(self, worker: Worker) -> None:
        self._by_peer[worker.peer] = worker
        self._out[worker.kind] += len(worker.out)
        self._push(worker)

    def remove(self, worker: Worker) -> bool:
        """Forget the worker (what it held is the caller's to re-queue); False if unknown."""
        if self._by_peer.get(worker.peer) is not worker:
            return False
        del self._by_peer[worker.peer]
        self._out[worker.kind] -= len(worker.out)
        return True

    def give(self, worker: Worker, traj: Trajectory) -> None:
        if traj.sample_id not in worker.out:
            self._out[worker.kind] += 1
        worker.out[traj.sample_id] = traj
        self._push(worker)

    def take_back(self, worker: Worker, sample_id: str) -> Trajectory | None:
        traj = worker.out.pop(sample_id, None)
        if traj is not None:
            self._out[worker.kind] -= 1
            self._push(worker)
        return traj

    def out(self, kind: str) -> int:
        """Trajectories out with the workers of this kind."""
        return self._out[kind]

    def freest(self, kind: str) -> Worker | None:
        heap = self._heaps[kind]
        while heap:
            neg_free, _, worker = heap[0]
            if (self._by_peer.get(worker.peer) is worker and worker.free > 0
                    and -neg_free == worker.free):
                return worker
            heapq.heappop(heap)  # outdated: the worker's load changed since, or it is gone
        return None

    def _push(self, worker: Worker) -> None:
        if self._by_peer.get(worker.peer) is not worker:
            return
        heap = self._heaps[worker.kind]
        heapq.heappush(heap, (-worker.free, next(self._order), worker))
        if len(heap) > 4 * len(self._by_peer) + 64:  # outdated entries buried deep: rebuild
            heap[:] = [(-w.free, next(self._order), w) for w in self._by_peer.values()
                       if w.kind == worker.kind]
            heapq.heapify(heap)
