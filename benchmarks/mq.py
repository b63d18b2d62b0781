"""MessageQueue benchmark: samples/s and latency through the real MessageQueue role, beside raw
ZeroMQ of the same bytes (the floors) and a Ray actor queue built the way verl's fully-async
recipe builds its MessageQueue (benchmarks/ray_queue.py; skipped when ray is not installed).
Producer, consumer and queue are separate processes throughout.

    .venv/bin/python benchmarks/mq.py [--samples 4096] [--tokens 8192] [--n 1]
        [--batch-groups 32] [--prefetch 1] [--window 64] [--repeat 3] [--durable] [--json PATH]

Systems, each moving the same frames (an encoded PutGroups of one group of n samples):
- raw 1-hop: producer -PUSH/PULL-> consumer. No codec, no queue: the wire's floor.
- raw 2-hop: producer -PUSH-> a process running zmq.proxy(PULL, PUSH) -> consumer. A broker
  has two hops (the producer and the trainer never talk to each other), so this is the fair
  floor for one, and the floor the 70% target is judged on.
- Python forwarder (`py2`), and with a log (`py2d`): the second hop in Python, doing the least
  any (durable) Python broker must per message (`py_forward`); where the queue's gap to the
  floor is Python's and the log's, and where it is rollmesh's own.
- rollmesh MessageQueue: the real MessageQueue role (spawned by the Supervisor) between the
  rollouter's put path and the trainer's get path, the very code the roles run: the producer's
  groups become ready (at most `--window` waiting) and `rollmesh.mq.client.put_ready` sends what
  is ready in one PutGroups, two puts out at once; the consumer reads a `mq.client.BatchFeed`
  stream of batches of `--batch-groups` groups, one per step, with `--prefetch` steps of
  credit ahead, committing each step at the next (a trainer checkpointing every step). The
  groups are checked (strict decode, staleness, accounting) and written to the log (with
  `--durable`) by the queue, decoded again by the consumer.
- Ray actor queue: see benchmarks/ray_queue.py (`--window` puts in flight, `--prefetch`
  further gets in flight).

Two phases per system:
- throughput: the producer runs flat out (bounded by its window and the queue's capacity);
  samples/s is counted at the consumer after `--warmup` samples, from the last warm-up batch's
  arrival to the last batch's. Latency here is mostly time spent waiting in full buffers.
- latency: the producer is paced at `--latency-rate` samples/s (well below every system's
  capacity) and the consumer takes one group at a time (the MessageQueue's stream with its
  `--prefetch` steps of credit ahead, as a trainer's; Ray's one get at a time): p50/p99 of
  the time from the producer's send to the consumer's receipt (one clock: the same machine;
  the MessageQueue's producer stamps a group when it is ready to put). The JSON latency
  rows are this phase's p99.
Systems run interleaved, `--repeat` times; samples/s is the median run, percentiles pool the
runs, and the MessageQueue's ratio to each baseline is also printed round by round (a busy
machine moves both sides of a round together). Start-up (processes, connections, Ray) is
outside every clock. The queue runs in memory unless `--durable` (its write-ahead log on).
"""

from __future__ import annotations

import os
import sys

import argparse  # noqa: E402
import asyncio  # noqa: E402
import copy  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import zmq  # noqa: E402
import zmq.asyncio  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from benchmarks.engine_proc import with_repo_on_path  # noqa: E402

import collections  # noqa: E402

import structlog  # noqa: E402

from rollmesh.config import load_experiment, to_dict  # noqa: E402
from rollmesh.mq.client import STREAM_AHEAD, BatchFeed, put_ready  # noqa: E402
from rollmesh.wire.protocol import encode  # noqa: E402
from rollmesh.wire.messages import Group, PutGroups, Trajectory
from rollmesh.launcher.supervisor import Supervisor  # noqa: E402
from rollmesh.wire.transport import CurveKeys, RpcClient, Transport, free_port  # noqa: E402


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


results = _load("results")
ray_queue = _load("ray_queue")  # imports ray only when run as its own process


def trajectory(tokens: int, i: int) -> Trajectory:
    s = ray_queue.sample_arrays(tokens, i)  # the Ray baseline's very arrays
    return Trajectory(sample_id=s["sample_id"], group_id=s["group_id"], token_ids=s["token_ids"],
                      logprobs=s["logprobs"], versions=s["versions"], loss_mask=s["loss_mask"],
                      prompt_len=s["prompt_len"], status=s["status"], reward=s["reward"],
                      reward_status=s["reward_status"], metadata={"t": 0.0})


def group(tokens: int, n: int, i: int) -> Group:
    ts = [trajectory(tokens, i * n + k) for k in range(n)]
    for k, t in enumerate(ts):
        t.group_id, t.index = f"g-{i:08d}", k
    return Group(group_id=f"g-{i:08d}", trajectories=ts)


def frames_of(g: Group) -> list[bytes]:
    return [f if isinstance(f, bytes) else bytes(memoryview(f).cast("B"))
            for f in encode(PutGroups(groups=[g]))]


class Clock:
    """Consumer-side counting: the clock opens when the warm-up is in."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.seen = 0
        self.samples = 0
        self.t0: float | None = None
        self.t_last = 0.0
        self.lat: list[float] = []

    def arrived(self, sent_times: list[float], now: float) -> None:
        if self.seen >= self.warmup:
            self.samples += len(sent_times)
            self.lat.extend(now - t for t in sent_times)
        self.seen += len(sent_times)
        if self.t0 is None and self.seen >= self.warmup:
            self.t0 = now
        self.t_last = now

    def result(self) -> dict[str, Any]:
        return {"samples": self.samples, "seconds": self.t_last - (self.t0 or self.t_last),
                "lat": self.lat}


async def paced(i: int, start: float, rate: float) -> None:
    if rate > 0:
        await asyncio.sleep(max(0.0, start + i / rate - time.time()))


# ---- raw ZeroMQ ------------------------------------------------------------------------------


async def raw_produce(p: dict[str, Any]) -> None:
    frames = frames_of(group(p["tokens"], p["n"], 0))
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.connect(p["address"])
    start = time.time()
    for i in range(p["groups"]):
        await paced(i, start, p["rate"] / p["n"])
        await sock.send_multipart([str(time.time()).encode(), *frames], copy=False)
    sock.close(linger=-1)
    ctx.term()


async def raw_consume(p: dict[str, Any]) -> dict[str, Any]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.bind(p["address"])
    print("ready", flush=True)
    clock, n = Clock(p["warmup"]), p["n"]
    for _ in range(p["groups"]):
        frames = await sock.recv_multipart(copy=False)
        clock.arrived([float(frames[0].bytes)] * n, time.time())
    sock.close(0)
    ctx.term()
    return clock.result()


def forward_sockets(p: dict[str, Any]) -> tuple[zmq.Socket, zmq.Socket]:
    """The second hop's sockets: PULL bound at p["bind"], PUSH connected to p["connect"]."""
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.setsockopt(zmq.SNDHWM, 1000)
        s.setsockopt(zmq.RCVHWM, 1000)
    pull.bind(p["bind"])
    push.connect(p["connect"])
    return pull, push


def raw_forward(p: dict[str, Any]) -> None:
    """The second hop: a pure ZeroMQ device (no Python per message), until killed."""
    pull, push = forward_sockets(p)
    print("ready", flush=True)
    zmq.proxy(pull, push)


def py_forward(p: dict[str, Any]) -> None:
    """The second hop in Python, doing the least any Python broker must per message: receive
    it, (`durable`) append it to a log with a crc32 per record, fsynced every second from a
    thread and started anew at 64 MiB, then send it on (zero-copy both ways; no decode, no
    validation, no accounting, no reply). Its gap to `raw_forward` is Python's and the log's
    own cost; the MessageQueue's gap to it is rollmesh's."""
    import threading
    import zlib

    pull, push = forward_sockets(p)
    log_dir = p["log_dir"]
    fd, size, files, lock = -1, 0, 0, threading.Lock()

    def roll() -> None:
        nonlocal fd, size, files
        old = fd
        path = os.path.join(log_dir, f"log.{files}")
        fd, size, files = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 0, files + 1
        if old >= 0:
            os.close(old)
            os.unlink(os.path.join(log_dir, f"log.{files - 2}"))

    def syncing() -> None:
        while True:
            time.sleep(1.0)
            with lock:
                dup = os.dup(fd)
            os.fsync(dup)
            os.close(dup)

    if log_dir:
        roll()
        threading.Thread(target=syncing, daemon=True).start()
    print("ready", flush=True)
    while True:
        frames = pull.recv_multipart(copy=False)
        if log_dir:
            views = [f.buffer for f in frames]
            crc = 0
            for v in views:
                crc = zlib.crc32(v, crc)
            size += os.writev(fd, [sum(v.nbytes for v in views).to_bytes(4, "little")
                                   + crc.to_bytes(4, "little"), *views])
            if size > 64 << 20:
                with lock:
                    roll()
        push.send_multipart(frames, copy=False)


# ---- rollmesh MessageQueue -------------------------------------------------------------------


def fresh(tr: Trajectory, group_id: str, sent: float) -> Trajectory:
    """A new trajectory record with these arrays (what a rollouter holds: records decoded from
    its workers' messages, not copies made field by field)."""
    out = copy.copy(tr)
    out.group_id, out.metadata = group_id, {"t": sent}
    return out


async def mq_produce(p: dict[str, Any]) -> None:
    """The rollouter's put path (`rollmesh.mq.client.put_ready`): groups become ready (flat out,
    or paced) while at most `window` wait to be queued, and go to the queue as it puts them."""
    groups = [group(p["tokens"], p["n"], i) for i in range(16)]
    log = structlog.get_logger("bench")
    with Transport(CurveKeys.load(p["keys"], "rollouter-0") if p.get("keys") else None) as t:
        client = RpcClient(t, p["address"], timeout_s=60)
        ready: collections.deque[Group] = collections.deque()
        added, room = asyncio.Event(), asyncio.Event()
        done = [0]

        def queued(g: Group) -> None:
            done[0] += 1
            room.set()

        putting = asyncio.create_task(put_ready(client, ready, added, queued, log=log))
        start = time.time()
        for i in range(p["groups"]):
            await paced(i, start, p["rate"] / p["n"])
            while len(ready) >= p["window"]:
                room.clear()
                await room.wait()
            # a fresh record per group (sharing the arrays); ids are never reused
            gid, now = f"{p['phase']}-{i:08d}", time.time()
            ready.append(Group(group_id=gid, trajectories=[
                fresh(tr, gid, now) for tr in groups[i % len(groups)].trajectories]))
            added.set()
        while done[0] < p["groups"]:
            room.clear()
            await room.wait()
        putting.cancel()
        client.close()


async def mq_consume(p: dict[str, Any]) -> dict[str, Any]:
    """The trainer's get path (`mq.client.BatchFeed`): one batch per step, `prefetch`
    steps of credit ahead, each step's checkpoint committed at the next (as a trainer that
    checkpoints every step)."""
    clock, bg = Clock(p["warmup"]), p["batch_groups"]
    with Transport(CurveKeys.load(p["keys"], "trainer-0") if p.get("keys") else None) as t:
        client = RpcClient(t, p["address"], timeout_s=120)
        feed = BatchFeed(client, bg)
        first, last = p["first_step"], p["first_step"] + -(-p["groups"] // bg) - 1
        step = first
        while step <= last:
            batch = await feed.get(step, 0, min(step + p["prefetch"], last), step - 1,
                                   timeout_s=30)
            now = time.time()
            if batch is None:  # nothing for a while: ask again
                continue
            step += 1
            clock.arrived([tr.metadata["t"] for g in batch.groups for tr in g.trajectories], now)
        feed.close()
        client.close()
    return clock.result()


# ---- the driver -------------------------------------------------------------------------------


def child(role: str, params: dict[str, Any]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--child", role, json.dumps(params)],
                            stdout=subprocess.PIPE, text=True,
                            env=with_repo_on_path(ROOT))


def last_json(proc: subprocess.Popen, timeout_s: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout_s)
    if proc.returncode:
        tail = "\n".join((err or "").strip().splitlines()[-15:])
        raise RuntimeError(f"benchmark process exited with {proc.returncode}\n{tail}")
    return json.loads(out.strip().splitlines()[-1])


def ready(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline().strip()  # type: ignore[union-attr]
    if line != "ready":
        raise RuntimeError(f"benchmark process did not start: {line!r}")


def phases(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Groups, warm-up and shape of each phase (whole batches, counted in groups)."""
    def whole(samples: int, bg: int) -> int:
        return -(-max(1, samples // a.n) // bg) * bg

    out = {"throughput": {"bg": a.batch_groups, "prefetch": a.prefetch, "window": a.window,
                          "rate": 0.0, "groups": whole(a.samples, a.batch_groups),
                          "warmup": whole(a.warmup, a.batch_groups)}}
    if a.latency_samples > 0:
        # one group per batch; the MessageQueue's consumer keeps its stream's credit ahead
        # (what the trainer's does), Ray's asks for one batch at a time (as before)
        out["latency"] = {"bg": 1, "prefetch": a.prefetch, "window": a.window,
                          "rate": a.latency_rate,
                          "groups": whole(a.latency_samples, 1),
                          "warmup": whole(a.latency_warmup, 1)}
    return out


def run_raw(a: argparse.Namespace, ph: dict[str, Any], hops: int,
            forward: str = "raw-forward", durable: bool = False) -> dict[str, Any]:
    total = ph["groups"] + ph["warmup"]
    address = f"tcp://127.0.0.1:{free_port()}"
    consumer = child("raw-consume", {"address": address, "groups": total,
                                     "warmup": ph["warmup"] * a.n, "n": a.n})
    ready(consumer)
    forwarder = None
    if hops == 2:
        front = f"tcp://127.0.0.1:{free_port()}"
        log_dir = tempfile.mkdtemp(prefix="rollmesh-bench-pylog-") if durable else None
        forwarder = child(forward, {"bind": front, "connect": address, "log_dir": log_dir})
        ready(forwarder)
        address = front
    producer = child("raw-produce", {"address": address, "groups": total, "rate": ph["rate"],
                                     "tokens": a.tokens, "n": a.n})
    try:
        return last_json(consumer, a.timeout_s)
    finally:
        producer.wait(a.timeout_s)
        if forwarder is not None:
            forwarder.kill()
            forwarder.wait()
        if durable:
            shutil.rmtree(log_dir, ignore_errors=True)


async def run_mq(a: argparse.Namespace, which: list[str],
                 curve: bool = False) -> dict[str, dict[str, Any]]:
    """`curve`: the run's keys in every process (as a launched run has them), so every socket,
    loopback included, is CURVE (`mqc`)."""
    exp = load_experiment(ROOT / "configs/tiny_cpu.toml")
    out = {}
    keys_dir = tempfile.mkdtemp(prefix="rollmesh-bench-keys-") if curve else None
    # each process its own key, as in a launched run: the queue checks who sends what
    keys = (CurveKeys.generate(Path(keys_dir) / "keys", ["launcher", "rollouter-0", "trainer-0"])
            if keys_dir else None)
    with Transport(keys) as t:
        sup = Supervisor(t, heartbeat_s=1.0, keys_dir=str(keys.directory) if keys else None)
        try:
            config = {"experiment": to_dict(exp), "bind": f"tcp://127.0.0.1:{free_port()}",
                      "capacity_groups": a.capacity}
            if a.durable:  # the queue's write-ahead log, in a fresh directory per run
                config["state_dir"] = tempfile.mkdtemp(prefix="rollmesh-bench-queue-")
            path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
            mq = sup.spawn("message_queue", a.mq_entry, config=config, env={"PYTHONPATH": path})
            address = (await sup.wait_ready(mq, 120))["rpc"]
            first_step = 1  # the consumers' steps go on from phase to phase, as a trainer's
            for name, ph in phases(a).items():
                if name not in which:
                    continue
                total = ph["groups"] + ph["warmup"]
                consumer = child("mq-consume", {
                    "address": address, "groups": total, "warmup": ph["warmup"] * a.n,
                    "batch_groups": ph["bg"], "prefetch": ph["prefetch"],
                    "first_step": first_step, "keys": str(keys.directory) if keys else None})
                first_step += -(-total // ph["bg"])
                producer = child("mq-produce", {
                    "phase": name, "address": address, "groups": total, "window": ph["window"],
                    "rate": ph["rate"], "tokens": a.tokens, "n": a.n,
                    "keys": str(keys.directory) if keys else None})
                out[name] = await asyncio.to_thread(last_json, consumer, a.timeout_s)
                await asyncio.to_thread(producer.wait, a.timeout_s)
        finally:
            await sup.close()
            if a.durable:
                shutil.rmtree(config["state_dir"], ignore_errors=True)
    if keys_dir:
        shutil.rmtree(keys_dir, ignore_errors=True)
    return out


def run_ray(a: argparse.Namespace) -> dict[str, Any]:
    args = ["--samples", a.samples, "--tokens", a.tokens, "--n", a.n, "--batch-groups",
            a.batch_groups, "--prefetch", a.prefetch, "--window", a.window, "--capacity",
            a.capacity, "--warmup", a.warmup, "--latency-samples", a.latency_samples,
            "--latency-rate", a.latency_rate, "--latency-warmup", a.latency_warmup,
            "--serialize", a.ray_serialize, "--timeout-s", a.timeout_s]
    proc = subprocess.Popen([sys.executable, str(HERE / "ray_queue.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return last_json(proc, a.timeout_s + 120)


def rate(r: dict[str, Any]) -> float:
    return r["samples"] / r["seconds"] if r["seconds"] > 0 else float("nan")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [rate(r) for r in runs]
    lat = np.concatenate([np.asarray(r["lat"], dtype=float) for r in runs]) * 1e3
    return {"rate": statistics.median(rates), "min": min(rates), "max": max(rates),
            "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=4096, help="samples per throughput run")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per sample")
    p.add_argument("--n", type=int, default=1, help="samples per GRPO group (one put each)")
    p.add_argument("--batch-groups", type=int, default=32, help="groups per batch")
    p.add_argument("--prefetch", type=int, default=STREAM_AHEAD,
                   help="batches the consumer takes ahead (Ray: further gets in flight)")
    p.add_argument("--window", type=int, default=64,
                   help="groups ready at the producer, at most (Ray: puts in flight)")
    p.add_argument("--capacity", type=int, default=256, help="queue capacity in groups")
    p.add_argument("--warmup", type=int, default=256, help="samples before the clock starts")
    p.add_argument("--latency-samples", type=int, default=400,
                   help="samples in the paced latency phase (0: skip it)")
    p.add_argument("--latency-rate", type=float, default=200.0,
                   help="samples/s offered in the latency phase")
    p.add_argument("--latency-warmup", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3, help="interleaved runs of every system")
    p.add_argument("--systems", default="raw1,raw2,mq,ray",
                   help="of raw1, raw2, py2, py2d, mq, mqc (CURVE on every socket), ray")
    p.add_argument("--ray-serialize", choices=("arrays", "cloudpickle"), default="arrays",
                   help="arrays: Ray's zero-copy numpy path; cloudpickle: as verl's rollouter")
    p.add_argument("--durable", action="store_true",
                   help="run the MessageQueue with its write-ahead log (state_dir) on")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", help="write the comparison rows here (benchmarks/results.py)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--mq-entry", default="rollmesh.mq.role:main", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        role, params = a.child[0], json.loads(a.child[1])
        if role in ("raw-forward", "py-forward"):
            (raw_forward if role == "raw-forward" else py_forward)(params)
            return
        fn = {"raw-produce": raw_produce, "raw-consume": raw_consume, "mq-produce": mq_produce,
              "mq-consume": mq_consume}[role]
        profile_dir = os.environ.get("BENCH_PROFILE_DIR")  # development: cProfile each child
        if profile_dir:
            import cProfile

            with cProfile.Profile(time.thread_time) as prof:
                out = asyncio.run(fn(params))
            prof.dump_stats(f"{profile_dir}/{role}.prof")
        else:
            out = asyncio.run(fn(params))
        if os.environ.get("BENCH_CPU_DIR"):  # development: CPU seconds of each child
            Path(os.environ["BENCH_CPU_DIR"], f"{role}.cpu").write_text(str(time.process_time()))
        if out is not None:
            print(json.dumps(out))
        return

    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    sample_kib = sum(len(f) for f in frames_of(group(a.tokens, 1, 0))) / 1024
    print(f"{a.samples} samples of {a.tokens} tokens ({sample_kib:.0f} KiB each on the wire), "
          f"n={a.n} per group, batches of {a.batch_groups} groups (+{a.prefetch} prefetched), "
          f"{a.window} groups ready at most, capacity {a.capacity} groups; latency phase: "
          f"{a.latency_samples} samples at {a.latency_rate:g}/s; {a.repeat} interleaved runs; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")
    if "ray" in systems and importlib.util.find_spec("ray") is None:
        print("ray is not installed: skipping the Ray actor queue "
              "(pip install 'ray>=2.60' to measure it)")
        systems.remove("ray")
    ph = phases(a)
    runs: dict[str, dict[str, list]] = {s: {k: [] for k in ph} for s in systems}
    for rep in range(a.repeat):
        for s in systems:
            t0 = time.time()
            if s in ("raw1", "raw2"):
                for name, phase in ph.items():
                    runs[s][name].append(run_raw(a, phase, 1 if s == "raw1" else 2))
            elif s in ("py2", "py2d"):
                for name, phase in ph.items():
                    runs[s][name].append(run_raw(a, phase, 2, "py-forward", s == "py2d"))
            elif s in ("mq", "mqc"):
                for name, r in asyncio.run(run_mq(a, list(ph), curve=s == "mqc")).items():
                    runs[s][name].append(r)
            elif s == "ray":
                r = run_ray(a)
                if "skipped" in r:
                    print(f"Ray actor queue skipped: {r['skipped']}")
                    systems.remove("ray")
                    del runs["ray"]
                    continue
                for name in ph:
                    runs[s][name].append(r[name])
            else:
                raise SystemExit(f"unknown system {s!r} (raw1, raw2, py2, py2d, mq, mqc, ray)")
            tp = runs[s]["throughput"][-1]
            print(f"  run {rep + 1}/{a.repeat} {s:5s} {rate(tp):9.0f} samples/s "
                  f"({time.time() - t0:.1f}s with start-up)", flush=True)

    names = {"raw1": "raw ZeroMQ 1-hop PUSH/PULL (floor)",
             "raw2": "raw ZeroMQ 2-hop via zmq.proxy (floor)",
             "py2": "2-hop via a Python forwarder",
             "py2d": "2-hop via a Python forwarder + log",
             "mq": "rollmesh MessageQueue (puts/stream)",
             "mqc": "rollmesh MessageQueue, CURVE everywhere",
             "ray": f"Ray actor queue, verl-style ({a.ray_serialize})"}
    summary = {s: {k: summarize(v) for k, v in runs[s].items()} for s in runs}
    print(f"\n{'':40s} {'samples/s':>9s} {'min-max':>13s} {'sat p50':>8s} {'sat p99':>8s}"
          f" {'lat p50':>8s} {'lat p99':>8s} {'vs 1hop':>7s} {'vs 2hop':>7s}")
    for s in runs:
        tp, lat = summary[s]["throughput"], summary[s].get("latency")
        vs = [f"{tp['rate'] / summary[f]['throughput']['rate']:6.2f}x" if f in summary else
              "      -" for f in ("raw1", "raw2")]
        lat_cols = f"{lat['p50']:8.2f} {lat['p99']:8.2f}" if lat else f"{'-':>8s} {'-':>8s}"
        print(f"{names[s]:40s} {tp['rate']:9.0f} {tp['min']:6.0f}-{tp['max']:<6.0f} "
              f"{tp['p50']:8.1f} {tp['p99']:8.1f} {lat_cols} {vs[0]} {vs[1]}")
    print("(sat: latency ms while running flat out, mostly buffer wait; lat: ms at "
          f"{a.latency_rate:g} samples/s offered, one group per get)")
    if "mq" in runs and a.repeat > 1:  # runs of one round are minutes apart at most: paired
        for f in ("raw2", "raw1", "ray", "mqc"):
            if f in runs:
                pairs = [rate(m) / rate(b) for m, b in zip(runs["mq"]["throughput"],
                                                           runs[f]["throughput"])]
                print(f"MessageQueue / {f} per round: "
                      + ", ".join(f"{r:.2f}" for r in pairs)
                      + f" (median {statistics.median(pairs):.2f})")

    rows = []
    if "mq" in summary:
        mq = summary["mq"]
        shape = (f"{a.tokens}-token samples, n={a.n}, batches of {a.batch_groups} groups "
                 f"+{a.prefetch} prefetched, {'durable' if a.durable else 'in-memory'} queue, "
                 f"median of {a.repeat}")
        label = "MessageQueue, durable log," if a.durable else "MessageQueue"
        if "ray" in summary:
            rows.append(results.row(
                f"{label} vs Ray actor queue", mq["throughput"]["rate"],
                summary["ray"]["throughput"]["rate"], "samples/s",
                baseline_name=f"Ray {a.ray_serialize} actor queue (verl recipe shape)",
                higher_is_better=True, target=5, note=shape))
        for f, target, what in (("raw2", 0.7, "the floor the target is judged on: a broker "
                                 "has two hops"), ("raw1", None, "one hop, no broker: "
                                                   "for reference")):
            if f in summary:
                rows.append(results.row(
                    f"{label} vs raw ZeroMQ floor" + ("" if target else " (1-hop)"),
                    mq["throughput"]["rate"], summary[f]["throughput"]["rate"], "samples/s",
                    baseline_name=names[f], higher_is_better=True, target=target,
                    note=f"{what}; {shape}"))
        if "latency" in mq:
            for f in ("ray", "raw2"):
                if f in summary and "latency" in summary[f]:
                    rows.append(results.row(
                        f"{label} p99 latency vs {names[f].split(' (')[0]}",
                        mq["latency"]["p99"], summary[f]["latency"]["p99"], "ms",
                        baseline_name=names[f], higher_is_better=False,
                        note=f"producer send -> consumer receipt at {a.latency_rate:g} "
                             f"samples/s offered, one group per get"))
    results.write(a.json, rows)
    if a.json:
        print(f"rows written to {a.json}")


if __name__ == "__main__":
    main()
