"""Wire benchmark: rollmesh's codec and a two-process round trip, each beside its baseline.

1. encode + decode of a realistic sample (8,192 tokens: ids, log-probs, versions, mask) with
   rollmesh's protocol vs the same arrays as plain msgpack lists (what a naive msgpack wire
   does), with and without turning the lists back into arrays;
2. a request-reply round trip to a second process: rollmesh's RpcClient -> RpcServer (encode,
   send, decode, handler, encode, send, decode) vs raw ZeroMQ frames of the same bytes echoed
   by a raw ROUTER (the floor: no codec at all).

    .venv/bin/python benchmarks/wire.py [--tokens 8192] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import zmq

from rollmesh.wire.protocol import decode, encode
from rollmesh.wire.messages import Trajectory
from rollmesh.wire.transport import RpcClient, RpcServer, Transport, free_port

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.results import row, write  # noqa: E402


def sample(n: int) -> Trajectory:
    rng = np.random.default_rng(0)
    prompt = n // 8
    return Trajectory(
        sample_id="s-00000042", group_id="g-00000007",
        token_ids=rng.integers(0, 151_000, n, dtype=np.int32),
        logprobs=np.where(np.arange(n) < prompt, 0, -rng.random(n)).astype(np.float32),
        versions=np.where(np.arange(n) < prompt, -1, 5).astype(np.int32),
        loss_mask=(np.arange(n) >= prompt).astype(np.uint8),
        prompt_len=prompt, agent_loop="single_turn", status="finished", finish_reason="stop",
        reward=1.0, reward_status="ok", label="72", metadata={"source": "gsm8k", "index": 42},
    )


def timeit(fn, seconds: float) -> float:
    """Mean seconds per call, over at least `seconds` of calls."""
    fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def codec(n: int, seconds: float) -> list[tuple[str, float]]:
    rec = sample(n)

    def ours():
        frames = [bytes(f) if isinstance(f, bytes) else f for f in encode(rec)]
        decode(frames)

    plain = {name: getattr(rec, name) for name in ("sample_id", "group_id", "prompt_len", "label")}

    def as_lists():
        body = msgpack.packb({**plain, **{k: getattr(rec, k).tolist() for k in
                                          ("token_ids", "logprobs", "versions", "loss_mask")}})
        return msgpack.unpackb(body)

    def as_lists_to_arrays():
        out = as_lists()
        for k, dt in (("token_ids", np.int32), ("logprobs", np.float32), ("versions", np.int32),
                      ("loss_mask", np.uint8)):
            out[k] = np.asarray(out[k], dtype=dt)

    return [("rollmesh encode+decode", timeit(ours, seconds)),
            ("msgpack lists encode+decode", timeit(as_lists, seconds)),
            ("msgpack lists + back to arrays", timeit(as_lists_to_arrays, seconds))]


# ---- the server process -----------------------------------------------------------------------


def serve(raw_port: int, rpc_port: int) -> None:
    def raw_echo():
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"tcp://127.0.0.1:{raw_port}")
        while True:
            sock.send_multipart(sock.recv_multipart(copy=False), copy=False)

    threading.Thread(target=raw_echo, daemon=True).start()

    async def main():
        async def same(msg, peer):
            return msg

        with Transport() as t:
            server = RpcServer(t, f"tcp://127.0.0.1:{rpc_port}", {Trajectory: same})
            print("ready", flush=True)
            await server.serve()

    asyncio.run(main())


async def round_trips(n: int, seconds: float, raw_port: int, rpc_port: int) -> list[tuple[str, list[float]]]:
    rec = sample(n)
    frames = [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in encode(rec)]
    results = []
    with Transport() as t:
        raw = t.socket(zmq.DEALER, connect=f"tcp://127.0.0.1:{raw_port}")
        client = RpcClient(t, f"tcp://127.0.0.1:{rpc_port}", timeout_s=10)

        async def raw_once():
            await raw.send_multipart([b"corr-id1", *frames], copy=False)
            await raw.recv_multipart(copy=False)

        async def rpc_once():
            await client.request(rec)

        for name, once in (("raw ZeroMQ frames (floor)", raw_once), ("rollmesh RpcClient/RpcServer", rpc_once),
                           ("raw ZeroMQ frames (floor, again)", raw_once)):
            for _ in range(50):
                await once()  # warm up connections and caches
            lat, start = [], time.perf_counter()
            while time.perf_counter() - start < seconds:
                t0 = time.perf_counter()
                await once()
                lat.append(time.perf_counter() - t0)
            results.append((name, lat))
        client.close()
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--serve", nargs=2, type=int, help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the comparisons here (benchmarks/results.py rows)")
    args = p.parse_args()
    if args.serve:
        serve(*args.serve)
        return

    n = args.tokens
    rec = sample(n)
    payload = sum(getattr(rec, k).nbytes for k in ("token_ids", "logprobs", "versions", "loss_mask"))
    print(f"sample: {n} tokens, {payload / 1024:.0f} KiB of arrays; machine: {os.cpu_count()} cores\n")

    rows = codec(n, args.seconds)
    base = rows[0][1]
    print(f"{'codec (one sample)':40s} {'us/sample':>12s} {'vs rollmesh':>12s}")
    for name, secs in rows:
        print(f"{name:40s} {secs * 1e6:12.1f} {secs / base:11.1f}x")
    out = [row(f"codec: encode+decode of one {n}-token sample", base * 1e6, secs * 1e6, "us",
               baseline_name=name, higher_is_better=False)
           for name, secs in rows[1:]]

    raw_port, rpc_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(raw_port), str(rpc_port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        results = asyncio.run(round_trips(n, args.seconds, raw_port, rpc_port))
    finally:
        server.kill()
        server.wait()
    floor = statistics.median(min((lat for name, lat in results if "floor" in name), key=statistics.median))
    print(f"\n{'round trip to a second process':40s} {'p50 us':>10s} {'p99 us':>10s} {'msgs/s':>10s} {'vs floor':>9s}")
    for name, lat in results:
        p50 = statistics.median(lat)
        p99 = float(np.percentile(lat, 99))
        print(f"{name:40s} {p50 * 1e6:10.1f} {p99 * 1e6:10.1f} {1 / statistics.mean(lat):10.0f} "
              f"{p50 / floor:8.2f}x")
    rpc = statistics.median(next(lat for name, lat in results if "rollmesh" in name))
    out.append(row("request-reply round trip to a second process, p50", rpc * 1e6, floor * 1e6,
                   "us", baseline_name="raw ZeroMQ frames, same bytes (floor)",
                   higher_is_better=False,
                   note="the cost of the codec, handler dispatch and asyncio on both sides"))
    write(args.json, out)


if __name__ == "__main__":
    main()
