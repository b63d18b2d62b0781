"""MessageQueue benchmark: samples/s and latency through the real MessageQueue role, beside raw
ZeroMQ PUSH/PULL of the same bytes (the floor), producer and consumer in separate processes.

    .venv/bin/python benchmarks/queue.py [--samples 2000] [--tokens 8192]

Through the queue: producer -PutGroup-> MessageQueue process -GetBatch-> consumer (two hops,
with the staleness check and accounting at hand-out). The floor: producer -PUSH/PULL-> consumer
(one hop, no codec). Latency is from the producer's send to the consumer's receipt (one clock:
the same machine).
"""

from __future__ import annotations

import os
import sys

# This file is named queue.py: keep the standard library's `queue` (asyncio needs it) first.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rollmesh.config import load_experiment, to_dict  # noqa: E402
from rollmesh.protocol import GetBatch, Group, PutGroup, Trajectory, encode  # noqa: E402
from rollmesh.runtime import Supervisor  # noqa: E402
from rollmesh.transport import RpcClient, Transport, free_port  # noqa: E402


def sample(n: int, i: int) -> Group:
    rng = np.random.default_rng(i)
    prompt = n // 8
    t = Trajectory(sample_id=f"s-{i:08d}", group_id=f"g-{i:08d}",
                   token_ids=rng.integers(0, 151_000, n, dtype=np.int32),
                   logprobs=-rng.random(n, dtype=np.float32),
                   versions=np.where(np.arange(n) < prompt, -1, 0).astype(np.int32),
                   loss_mask=(np.arange(n) >= prompt).astype(np.uint8), prompt_len=prompt,
                   status="finished", reward=1.0, reward_status="ok", metadata={"t": 0.0})
    return Group(group_id=t.group_id, trajectories=[t])


# ---- the four processes ---------------------------------------------------------------------


async def produce_mq(address: str, n: int, tokens: int, window: int) -> None:
    groups = [sample(tokens, i) for i in range(16)]
    with Transport() as t:
        client = RpcClient(t, address, timeout_s=60)

        async def put(i: int) -> None:
            g = groups[i % len(groups)]
            g.trajectories[0].metadata["t"] = time.time()
            g.trajectories[0].sample_id = g.group_id = f"g-{i:08d}"
            while not (await client.request(PutGroup(group=g))).accepted:
                await asyncio.sleep(0.001)  # full: back-pressure

        for start in range(0, n, window):
            await asyncio.gather(*(put(i) for i in range(start, min(n, start + window))))
        client.close()


async def consume_mq(address: str, n: int) -> dict:
    lat, got = [], 0
    with Transport() as t:
        client = RpcClient(t, address, timeout_s=120)
        start = None
        while got < n:
            batch = await client.request(GetBatch(groups=1, version=0, timeout_s=30), timeout_s=60)
            now = time.time()
            start = start or now
            for g in batch.groups:
                lat.append(now - g.trajectories[0].metadata["t"])
                got += 1
        client.close()
    return {"samples": got, "seconds": time.time() - start, "lat": lat}


async def produce_raw(address: str, n: int, tokens: int) -> None:
    frames = [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f
              for f in encode(sample(tokens, 0))]
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(address)
    for _ in range(n):
        await sock.send_multipart([str(time.time()).encode(), *frames], copy=False)
    sock.close(linger=-1)
    ctx.term()


async def consume_raw(address: str, n: int) -> dict:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    print("ready", flush=True)
    lat, start = [], None
    for _ in range(n):
        frames = await sock.recv_multipart(copy=False)
        now = time.time()
        start = start or now
        lat.append(now - float(frames[0].bytes))
    sock.close(0)
    ctx.term()
    return {"samples": n, "seconds": time.time() - start, "lat": lat}


# ---- the driver -------------------------------------------------------------------------------


def child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def report(name: str, r: dict, floor: dict | None) -> None:
    rate = r["samples"] / r["seconds"]
    lat = np.array(r["lat"]) * 1e3
    ratio = f"{rate / (floor['samples'] / floor['seconds']):8.2f}x" if floor else "       -"
    print(f"{name:42s} {rate:10.0f} {np.percentile(lat, 50):9.2f} {np.percentile(lat, 99):9.2f}"
          f" {ratio}")


async def through_queue(n: int, tokens: int, window: int) -> dict:
    exp = load_experiment(ROOT / "configs/tiny_cpu.toml")
    with Transport() as t:
        sup = Supervisor(t, heartbeat_s=1.0)
        mq = sup.spawn("message_queue", "rollmesh.message_queue:main", config={
            "experiment": to_dict(exp), "bind": f"tcp://127.0.0.1:{free_port()}",
            "capacity_groups": 256}, env={"PYTHONPATH": str(ROOT)})
        address = (await sup.wait_ready(mq, 120))["rpc"]
        consumer = child("--consume-mq", address, str(n))
        producer = child("--produce-mq", address, str(n), str(tokens), str(window))
        out = await asyncio.to_thread(consumer.communicate)
        await asyncio.to_thread(producer.wait)
        await sup.close()
    return json.loads(out[0].splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=8, help="puts in flight from the producer")
    p.add_argument("--produce-mq", nargs=4, help=argparse.SUPPRESS)
    p.add_argument("--consume-mq", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--produce-raw", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--consume-raw", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.produce_mq:
        asyncio.run(produce_mq(a.produce_mq[0], int(a.produce_mq[1]), int(a.produce_mq[2]),
                               int(a.produce_mq[3])))
        return
    if a.consume_mq:
        print(json.dumps(asyncio.run(consume_mq(a.consume_mq[0], int(a.consume_mq[1])))))
        return
    if a.produce_raw:
        asyncio.run(produce_raw(a.produce_raw[0], int(a.produce_raw[1]), int(a.produce_raw[2])))
        return
    if a.consume_raw:
        print(json.dumps(asyncio.run(consume_raw(a.consume_raw[0], int(a.consume_raw[1])))))
        return

    kib = sum(f.nbytes if hasattr(f, "nbytes") else len(f) for f in encode(sample(a.tokens, 0))) / 1024
    print(f"{a.samples} samples of {a.tokens} tokens ({kib:.0f} KiB each), {os.cpu_count()} cores\n")
    address = f"tcp://127.0.0.1:{free_port()}"
    consumer = child("--consume-raw", address, str(a.samples))
    assert consumer.stdout.readline().strip() == "ready"
    producer = child("--produce-raw", address, str(a.samples), str(a.tokens))
    raw = json.loads(consumer.communicate()[0].splitlines()[-1])
    producer.wait()
    queued = asyncio.run(through_queue(a.samples, a.tokens, a.window))
    print(f"{'':42s} {'samples/s':>10s} {'p50 ms':>9s} {'p99 ms':>9s} {'vs floor':>9s}")
    report("raw ZeroMQ PUSH/PULL, same bytes (floor)", raw, None)
    report("rollmesh MessageQueue (put -> queue -> get)", queued, raw)


if __name__ == "__main__":
    main()
