"""The Ray baseline of benchmarks/queue.py: a queue built the way verl's fully-async recipe
builds its MessageQueue (recipe/fully_async_policy/message_queue.py): an async Ray actor holding
a deque guarded by an asyncio.Condition, with put_sample / get_samples / get_sample, called by a
producer and a consumer that are Ray worker processes of their own (actors) on one local Ray
cluster. Ray is needed only here (`pip install "ray>=2.60"`); benchmarks/queue.py runs this file
as a child process and skips the Ray row when ray is not installed.

    .venv/bin/python benchmarks/ray_queue.py --samples 2000 [--tokens 8192] [--n 1] ...

Prints one JSON line: {"throughput": {...}, "latency": {...}} in the shape queue.py reports.

Two differences from verl, both in the baseline's favour or needed to count samples:
- verl's put_sample drops the oldest sample when the deque is full; here put waits on a second
  condition instead (back-pressure, as rollmesh's MessageQueue has), so every sample produced is
  consumed and the count is exact.
- verl's rollouter puts `ray.cloudpickle.dumps(sample)`; by default the group goes as the numpy
  arrays themselves (Ray's zero-copy numpy path through its object store), which is Ray at its
  fastest. `--serialize cloudpickle` does what verl does.
Ray's start, the actors' creation and a warm-up call happen before any clock starts.
"""

from __future__ import annotations

import os
import sys

# benchmarks/queue.py sits beside this file: keep the standard library's `queue` first.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402


def sample_arrays(tokens: int, i: int) -> dict[str, Any]:
    """The same arrays as benchmarks/queue.py's Trajectory (same recipe, same bytes)."""
    rng = np.random.default_rng(i)
    prompt = tokens // 8
    return {
        "sample_id": f"s-{i:08d}", "group_id": f"g-{i:08d}",
        "token_ids": rng.integers(0, 151_000, tokens, dtype=np.int32),
        "logprobs": -rng.random(tokens, dtype=np.float32),
        "versions": np.where(np.arange(tokens) < prompt, -1, 0).astype(np.int32),
        "loss_mask": (np.arange(tokens) >= prompt).astype(np.uint8),
        "prompt_len": prompt, "status": "finished", "reward": 1.0, "reward_status": "ok",
        "metadata": {"t": 0.0},
    }


def array_bytes(s: dict[str, Any]) -> int:
    return sum(v.nbytes for v in s.values() if isinstance(v, np.ndarray))


def define_actors(ray: Any) -> tuple[Any, Any, Any]:
    @ray.remote(max_concurrency=20)
    class MessageQueue:
        """verl's shape: deque + asyncio.Lock/Condition in an async actor."""

        def __init__(self, max_queue_size: int):
            self.max_queue_size = max_queue_size
            self.queue: collections.deque = collections.deque()
            self.current_param_version = 0
            self.staleness_threshold = 3
            self._lock = asyncio.Lock()
            self._consumer_condition = asyncio.Condition(self._lock)
            self._producer_condition = asyncio.Condition(self._lock)
            self.total_produced = self.total_consumed = self.dropped_samples = 0

        async def put_sample(self, sample: Any, param_version: int) -> bool:
            async with self._lock:
                if self.current_param_version - param_version > self.staleness_threshold:
                    self.dropped_samples += 1
                    return False
                while len(self.queue) >= self.max_queue_size:  # verl drops the oldest here
                    await self._producer_condition.wait()
                self.queue.append(sample)
                self.total_produced += 1
                self._consumer_condition.notify_all()
                return True

        async def get_samples(self, min_batch_count: int = 1) -> tuple[list[Any], int]:
            async with self._lock:
                while len(self.queue) < min_batch_count:
                    await self._consumer_condition.wait()
                samples = [self.queue.popleft() for _ in range(min_batch_count)]
                self.total_consumed += len(samples)
                self._producer_condition.notify_all()
                return samples, len(self.queue)

        async def get_sample(self) -> Any:
            async with self._lock:
                while not self.queue:
                    await self._consumer_condition.wait()
                data = self.queue.popleft()
                self.total_consumed += 1
                self._producer_condition.notify_all()
                return data

        async def get_statistics(self) -> dict[str, int]:
            async with self._lock:
                return {"queue_size": len(self.queue), "total_produced": self.total_produced,
                        "total_consumed": self.total_consumed}

    @ray.remote
    class Producer:
        def __init__(self, queue: Any, tokens: int, n: int, pickled: bool):
            self.queue = queue
            self.pickled = pickled
            self.groups = [[sample_arrays(tokens, g * n + k) for k in range(n)] for g in range(16)]

        def ready(self) -> bool:
            return True

        async def run(self, groups: int, window: int, rate: float) -> int:
            """Put `groups` groups, `window` puts in flight; `rate` > 0 paces them (groups/s)."""
            slots = asyncio.Semaphore(window)
            start = time.time()

            async def put(i: int) -> None:
                try:
                    now = time.time()
                    g = [{**s, "group_id": f"g-{i:08d}", "metadata": {"t": now}}
                         for s in self.groups[i % len(self.groups)]]
                    payload = ray.cloudpickle.dumps(g) if self.pickled else g
                    await self.queue.put_sample.remote(payload, 0)
                finally:
                    slots.release()

            tasks = []
            for i in range(groups):
                if rate > 0:
                    await asyncio.sleep(max(0.0, start + i / rate - time.time()))
                await slots.acquire()
                tasks.append(asyncio.create_task(put(i)))
            await asyncio.gather(*tasks)
            return groups

    @ray.remote
    class Consumer:
        def __init__(self, queue: Any, pickled: bool):
            self.queue = queue
            self.pickled = pickled

        def ready(self) -> bool:
            return True

        async def run(self, batches: int, batch_groups: int, prefetch: int,
                      warmup_batches: int) -> dict[str, Any]:
            refs: collections.deque = collections.deque()
            asked = 0
            got = 0
            lat: list[float] = []
            t0 = t_last = None
            for b in range(batches):
                while asked < batches and len(refs) < 1 + prefetch:
                    refs.append(self.queue.get_samples.remote(batch_groups))
                    asked += 1
                groups, _ = await refs.popleft()
                now = time.time()
                if b == warmup_batches - 1:
                    t0 = now  # the clock starts once the warm-up batches are in
                for g in groups:
                    g = ray.cloudpickle.loads(g) if self.pickled else g
                    assert g[0]["token_ids"].nbytes > 0
                    if b >= warmup_batches:
                        lat.extend(now - s["metadata"]["t"] for s in g)
                        got += len(g)
                t_last = now
            return {"samples": got, "seconds": (t_last - t0) if t0 else 0.0, "lat": lat}

    return MessageQueue, Producer, Consumer


def run(a: argparse.Namespace) -> dict[str, Any]:
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=a.object_store_mb << 20, configure_logging=False)
    try:
        MessageQueue, Producer, Consumer = define_actors(ray)
        pickled = a.serialize == "cloudpickle"
        out: dict[str, Any] = {"ray": ray.__version__,
                               "sample_array_bytes": array_bytes(sample_arrays(a.tokens, 0))}
        phases = {"throughput": (a.samples, a.batch_groups, a.prefetch, a.window, 0.0, a.warmup),
                  "latency": (a.latency_samples, 1, 0, 1, a.latency_rate, a.latency_warmup)}
        for phase, (samples, bg, prefetch, window, rate, warmup) in phases.items():
            if samples <= 0:
                continue
            groups_per_batch = bg
            batches = -(-(samples // a.n) // groups_per_batch)
            warmup_batches = max(1, -(-(warmup // a.n) // groups_per_batch))
            total_groups = (batches + warmup_batches) * groups_per_batch
            q = MessageQueue.remote(a.capacity)
            prod = Producer.remote(q, a.tokens, a.n, pickled)
            cons = Consumer.remote(q, pickled)
            ray.get([prod.ready.remote(), cons.ready.remote(), q.get_statistics.remote()])
            r_cons = cons.run.remote(batches + warmup_batches, groups_per_batch, prefetch,
                                     warmup_batches)
            r_prod = prod.run.remote(total_groups, window, rate / a.n if rate else 0.0)
            out[phase] = ray.get(r_cons, timeout=a.timeout_s)
            ray.get(r_prod, timeout=a.timeout_s)
            for actor in (prod, cons, q):
                ray.kill(actor)
        return out
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--batch-groups", type=int, default=32)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--capacity", type=int, default=256)
    p.add_argument("--warmup", type=int, default=64)
    p.add_argument("--latency-samples", type=int, default=300)
    p.add_argument("--latency-rate", type=float, default=100.0)
    p.add_argument("--latency-warmup", type=int, default=20)
    p.add_argument("--serialize", choices=("arrays", "cloudpickle"), default="arrays")
    p.add_argument("--object-store-mb", type=int, default=2048)
    p.add_argument("--timeout-s", type=float, default=600.0)
    a = p.parse_args()
    try:
        import ray  # noqa: F401
    except ImportError:
        print(json.dumps({"skipped": "ray is not installed (pip install 'ray>=2.60')"}))
        return
    print(json.dumps(run(a)))


if __name__ == "__main__":
    sys.exit(main())
