"""The rollouter's worker index: the freest worker of a kind, as the scan it replaced chose it,
and exact counts of what is out, through registrations, dispatches, returns and losses."""

from __future__ import annotations

import random
from types import SimpleNamespace

from rollmesh.rollout.workers import Worker, WorkerPool


def scan(pool: WorkerPool, kind: str) -> int:
    """What the freest worker has free, by looking at every worker (0: none free)."""
    return max((w.free for w in pool.values() if w.kind == kind and w.free > 0), default=0)


def test_the_index_picks_a_freest_worker_through_a_random_history():
    rng = random.Random(7)
    pool, peers = WorkerPool(), iter(range(10**6))
    out: dict[str, set[str]] = {"agent": set(), "reward": set()}
    serial = iter(range(10**6))
    for _ in range(20_000):
        op = rng.random()
        kind = rng.choice(["agent", "reward"])
        if op < 0.05 or len(pool) == 0:  # a worker joins (credits 1-8)
            pool.add(Worker(next(peers).to_bytes(4, "big"), "w", kind, rng.randint(1, 8)))
        elif op < 0.08:  # a worker is lost with what it held
            w = rng.choice(list(pool.values()))
            held = set(w.out)
            assert pool.remove(w) and not pool.remove(w)
            out[w.kind] -= held
        elif op < 0.55:  # a dispatch
            w = pool.freest(kind)
            assert (w.free if w else 0) == scan(pool, kind)
            if w is not None:
                assert w.kind == kind
                sid = f"s{next(serial)}"
                pool.give(w, SimpleNamespace(sample_id=sid))
                out[kind].add(sid)
        else:  # a result comes back
            busy = [w for w in pool.values() if w.out]
            if busy:
                w = rng.choice(busy)
                sid = rng.choice(list(w.out))
                assert pool.take_back(w, sid).sample_id == sid
                assert pool.take_back(w, sid) is None  # a duplicate return
                out[w.kind].discard(sid)
        for k in ("agent", "reward"):
            assert pool.out(k) == len(out[k]) == sum(len(w.out) for w in pool.values()
                                                     if w.kind == k)


def test_a_lost_worker_is_never_chosen_and_its_returns_are_not_counted():
    pool = WorkerPool()
    a = Worker(b"a", "a", "agent", 4)
    b = Worker(b"b", "b", "agent", 2)
    pool.add(a)
    pool.add(b)
    assert pool.freest("agent") is a
    pool.give(a, SimpleNamespace(sample_id="x"))
    pool.give(a, SimpleNamespace(sample_id="y"))
    pool.give(a, SimpleNamespace(sample_id="z"))
    assert pool.freest("agent") is b  # a has 1 free, b 2
    assert pool.remove(b)
    assert pool.freest("agent") is a and pool.freest("reward") is None
    assert pool.out("agent") == 3
    # a worker re-registers under the same peer: a new Worker, the old one is gone
    assert pool.remove(a)
    again = Worker(b"a", "a", "agent", 1)
    pool.add(again)
    assert pool.freest("agent") is again and pool.out("agent") == 0
    pool.give(again, SimpleNamespace(sample_id="w"))
    assert pool.freest("agent") is None
