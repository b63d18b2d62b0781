"""CPU per sample of the rollouter and the MessageQueue, measured on real role processes: the
per-message costs `benchmarks/simulate.py --scale` turns into the cluster size at which one of
them saturates.

    .venv/bin/python benchmarks/rollout_cost.py [--settings 32:16:0,1024:16:0,32:4:0,32:16:1]
        [--queue-tokens 43,1033,3227] [--queue-group-sizes 1,16] [--repeat 1] [--costs PATH]
        [--json PATH]

1. The rollout stack (--settings PROMPT_TOKENS:GROUP_SIZE:SYNC, one run each). Each role is its
   own process, as `rollmesh launch` runs the rollout side: one built-in engine (the random
   `tiny` model), the MessageQueue with its durable log, the rollouter with its journal and its
   engine health probe, --agents agent workers (64 credits each, the launcher's figure) and
   --rewards reward workers (`letter_share`, in their sandbox). This script plays trainer and
   synchronizer over the real protocol (as tests/helpers/rollout_stack.py does): the batch for
   step k from the queue's stream (`BatchFeed`, the trainer's) with step k-1 committed, and with SYNC 1 a weight sync after every batch (Pause in abort
   mode, the engine's weight version bumped, WeightVersion to the queue, Resume), so
   trajectories are interrupted and resumed as in a run. The engine is cheap because it is
   small, not replaced: the tiny model and --new-tokens tokens per response (ignore_eos). The
   rollouter does per sample what it does at any size (Assign, Returned, Score, Scored, its
   share of a PutGroups and of the journal); the settings differ in prompt length (its per
   token cost: the chat template and the arrays of each new trajectory), group size (its per
   group cost) and syncs (its cost per resume).
2. The MessageQueue alone (--queue-tokens x --queue-group-sizes): the real role process with
   its durable log, fed by PutGroups of one group each (one in flight: the cost of a put of
   one group; the rollouter's `put_ready` puts what is ready, more at once when it can) and
   drained by the trainer's stream of batches (`BatchFeed`) of --queue-batch-samples samples
   from this process, with samples of each length:
   its cost per
   token carried and per put, which the stack above cannot resolve (its engine makes long
   samples slow, and idle ticking then weighs as much as the signal).
3. In this process, on the real code: the rollouter's choice of a worker (run for every Assign
   and every Score): the index it keeps (`WorkerPool`: the freest worker, give, take back; a
   cost per dispatch that hardly grows with the workers) and, beside it, the scan of every
   worker of the kind it replaced (a cost per worker); and the codec's encode + decode of a trajectory at 39 and 8,192
   tokens (what carrying a longer response costs the rollouter per message).

Measured per run: the CPU time of the process's main thread (the one Python thread that
saturates: /proc/PID/task/PID/schedstat) and of the whole process (ZeroMQ's I/O thread
included), per sample the rollouter queued (resp. per sample the queue took in and handed out),
from the --warmup-groups-th group after the last worker joined, over --groups groups. "net"
subtracts the idle rate of the same thread (measured for --idle-s before any worker joins:
heartbeats, stats and health polls, the put loop's 10 ms tick), which at scale is spread over
far more samples. The capacity of one such process is 1 / (net main-thread seconds per sample).
`--costs PATH` writes the fitted figures as a JSON object `simulate.py --process-costs PATH`
reads.
"""

from __future__ import annotations

import os
import sys

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
import timeit
import types
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_proc import start_engine, with_repo_on_path  # noqa: E402
from benchmarks.results import row, write  # noqa: E402
from rollmesh.config import load_experiment, to_dict  # noqa: E402
from rollmesh.rollout.data import PromptRow, render_prompt  # noqa: E402
from rollmesh.engine.client import EngineClient  # noqa: E402
from rollmesh.models.loading import tiny_tokenizer  # noqa: E402
from rollmesh.core.trajectory import new_trajectory  # noqa: E402
from rollmesh.wire.protocol import decode, encode
from rollmesh.mq.client import BatchFeed  # noqa: E402
from rollmesh.wire.messages import (
    Group,
    Pause,
    PutGroups,
    Resume,
    Returned,
    StatsRequest,
    Trajectory,
    WeightVersion,
)
from rollmesh.rollout.workers import Worker, WorkerPool  # noqa: E402
from rollmesh.launcher.supervisor import Supervisor  # noqa: E402
from rollmesh.wire.transport import RpcClient, Transport, free_port  # noqa: E402

def cpu_s(pid: int, main_thread: bool) -> float:
    """Seconds on a CPU of a process's main thread, or of all its threads (schedstat: ns)."""
    tids = [pid] if main_thread else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    total = 0
    for tid in tids:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    return total / 1e9


def prompt_of(tokens: int, tok: Any) -> str:
    """A text prompt that renders (chat template) to about `tokens` tokens."""
    base = "Tell me about a museum with words that have an e in them."
    text = base
    while len(render_prompt(PromptRow(0, text), tok)) < tokens:
        text += " Every member here needs seven green trees."
    return text


def write_dataset(path: Path, rows: int, tokens: int, group_size: int) -> None:
    text = prompt_of(tokens, tiny_tokenizer())
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"prompt": text, "label": "e",
                                "sampling": {"ignore_eos": True}}) + "\n")


class Probe:
    def __init__(self, pids: dict[str, int]):
        self.pids = pids

    def read(self) -> dict[str, float]:
        out = {"t": time.monotonic()}
        for name, pid in self.pids.items():
            out[f"{name}_main"] = cpu_s(pid, True)
            out[f"{name}_all"] = cpu_s(pid, False)
        return out


async def measure(args: argparse.Namespace, tokens: int, group_size: int, sync: bool,
                  work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    rows = args.warmup_groups + args.groups + 8 * args.batch_groups
    dataset = work / f"data-{tokens}-{group_size}.jsonl"
    write_dataset(dataset, rows, tokens, group_size)
    exp = load_experiment(ROOT / "configs/tiny_cpu.toml", overrides=[
        f"data.train_path={json.dumps(str(dataset))}", f"data.group_size={group_size}",
        f"data.max_prompt_tokens={tokens + 200}", f"model.max_context={tokens + 300}",
        f"rollout.max_new_tokens={args.new_tokens}", f"rollout.batch_groups={args.batch_groups}",
        f"rollout.max_concurrent={args.max_concurrent}", "rollout.eval_every=0",
        # without syncs the version stays 0: a bound past the run's length admits freely
        f"staleness.max_staleness={1 if sync else 10_000}"])
    spec = to_dict(exp)
    env = {k: v for k, v in with_repo_on_path().items() if k == "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    engine, url = await asyncio.to_thread(
        start_engine, "--model", "tiny", "--seed", "0", "--weight-version", "0",
        "--max-running-requests", str(args.max_concurrent * group_size),
        python=sys.executable)
    t = Transport()
    sup = Supervisor(t, heartbeat_s=1.0, liveness=60, log_dir=work / f"logs-{tokens}-{group_size}-{int(sync)}")
    clients: list[RpcClient] = []
    try:
        mq = sup.spawn("message_queue", "rollmesh.mq.role:main", env=env, config={
            "experiment": spec, "bind": f"tcp://127.0.0.1:{free_port()}",
            "state_dir": str(work / f"mq-{tokens}-{group_size}-{int(sync)}")})
        mq_rpc = (await sup.wait_ready(mq, 120))["rpc"]
        rollouter = sup.spawn("rollouter", "rollmesh.rollout.role:main", env=env, config={
            "experiment": spec, "bind": f"tcp://127.0.0.1:{free_port()}",
            "control": f"tcp://127.0.0.1:{free_port()}", "message_queue": mq_rpc,
            "engines": [url], "state_dir": str(work / f"rollouter-{tokens}-{group_size}-{int(sync)}")})
        eps = await sup.wait_ready(rollouter, 120)
        probe = Probe({"rollouter": rollouter.process.pid, "mq": mq.process.pid})
        # idle rate: the loops that tick whatever the load, before any worker joins
        await asyncio.sleep(1.0)
        idle0 = probe.read()
        await asyncio.sleep(args.idle_s)
        idle1 = probe.read()
        idle = {k: (idle1[k] - idle0[k]) / (idle1["t"] - idle0["t"]) for k in idle0 if k != "t"}
        for i in range(args.rewards):
            await sup.wait_ready(sup.spawn(
                "reward_worker", "rollmesh.rewards.role:main", instance=i, env=env,
                config={"experiment": spec, "rollouter": eps["channel"]}), 120)
        for i in range(args.agents):
            await sup.wait_ready(sup.spawn(
                "agent_worker", "rollmesh.agents.role:main", instance=i, env=env,
                config={"experiment": spec, "rollouter": eps["channel"], "engines": [url]}), 120)
        ro = RpcClient(t, eps["rpc"], timeout_s=120, name="rollouter")
        q = RpcClient(t, mq_rpc, timeout_s=120, name="message queue")
        clients += [ro, q]

        seen = {"samples": 0, "tokens": 0, "counting": False}

        async def consume() -> None:
            """The trainer's and the synchronizer's part: batches out, a sync after each."""
            version = step = 0
            feed = BatchFeed(q, args.batch_groups)
            while True:
                batch = await feed.get(step + 1, version, step + 1, step, timeout_s=60.0)
                if batch is None:
                    raise RuntimeError(f"no batch within 60 s after step {step}")
                step += 1
                if seen["counting"]:
                    for g in batch.groups:
                        seen["samples"] += len(g.trajectories)
                        seen["tokens"] += sum(len(tr.token_ids) for tr in g.trajectories)
                if sync:
                    await ro.request(Pause(mode="abort"))
                    version += 1
                    async with EngineClient([url]) as client:
                        await client.update_weight_version(str(version))
                    await q.request(WeightVersion(version=version))
                    await ro.request(Resume(version=version))

        async def until(samples: int) -> tuple[dict, dict, dict]:
            while True:
                if consumer.done():
                    consumer.result()  # its error, if it failed
                r = (await ro.request(StatsRequest())).values
                if r["queued_samples"] >= samples:
                    return (probe.read(), r, (await q.request(StatsRequest())).values)
                await asyncio.sleep(0.25)

        consumer = asyncio.create_task(consume())
        try:
            # counted from now: generation began when the first agent worker joined
            base = (await ro.request(StatsRequest())).values["queued_samples"]
            start = await until(base + args.warmup_groups * group_size)
            seen["counting"] = True
            end = await until(start[1]["queued_samples"] + args.groups * group_size)
        finally:
            consumer.cancel()
    finally:
        for c in clients:
            c.close()
        await sup.close(grace_s=10)
        t.close()
        engine.terminate()
        await asyncio.to_thread(engine.wait, 30)

    (p0, r0, q0), (p1, r1, q1) = start, end
    span = p1["t"] - p0["t"]
    queued = r1["queued_samples"] - r0["queued_samples"]
    # the queue's work per sample is one put and one hand-out: the mean of the two counts
    handed = ((q1["put_samples"] - q0["put_samples"])
              + (q1["consumed_samples"] - q0["consumed_samples"])) / 2
    resumes = r1.get("interrupted", 0) - r0.get("interrupted", 0)
    out = {"prompt_tokens": tokens, "group_size": group_size, "sync": sync, "span_s": span, "queued_samples": queued,
           "handed_samples": handed, "resumes": resumes,
           "tokens_per_sample": seen["tokens"] / max(seen["samples"], 1),
           "samples_per_s": queued / span, "idle_cpu_per_s": idle}
    for name, n in (("rollouter", queued), ("mq", handed)):
        for part in ("main", "all"):
            gross = p1[f"{name}_{part}"] - p0[f"{name}_{part}"]
            out[f"{name}_{part}_us"] = 1e6 * gross / n
            out[f"{name}_{part}_net_us"] = 1e6 * (gross - idle[f"{name}_{part}"] * span) / n
    return out


async def queue_alone(args: argparse.Namespace, tokens: int, group_size: int,
                      work: Path) -> dict:
    """The real MessageQueue process (durable log), PutGroups of one group one at a time from
    here, batches through the trainer's stream (`BatchFeed`) from here: its main thread's CPU
    per sample of `tokens` tokens in groups of `group_size`."""
    exp = load_experiment(ROOT / "configs/tiny_cpu.toml",  # the queue takes groups of any size
                          overrides=[f"rollout.batch_groups={args.batch_groups}"])
    env = {k: v for k, v in with_repo_on_path().items() if k == "PYTHONPATH"}
    t = Transport()
    sup = Supervisor(t, heartbeat_s=1.0, liveness=60, log_dir=work / "logs-queue")
    rng = np.random.default_rng(0)
    prompt = min(300, tokens // 2)

    def group(i: int) -> Group:
        trajs = []
        for k in range(group_size):
            mask = np.zeros(tokens, np.uint8)
            mask[prompt:] = 1
            versions = np.where(mask == 1, 0, -1).astype(np.int32)
            trajs.append(Trajectory(
                sample_id=f"g{i:07d}-{k:03d}", group_id=f"g{i:07d}", index=k,
                token_ids=rng.integers(0, 151_000, tokens, dtype=np.int32),
                logprobs=(-rng.random(tokens, dtype=np.float32)) * mask,
                versions=versions, loss_mask=mask, prompt_len=prompt, status="finished",
                reward=1.0, reward_status="ok", num_turns=1, finish_reason="length"))
        return Group(group_id=f"g{i:07d}", trajectories=trajs)

    per_get = max(1, args.queue_batch_samples // group_size)  # the same samples per batch
    n_groups = max(args.queue_samples // group_size, 4 * per_get)
    groups = [group(i) for i in range(n_groups)]
    try:
        mq = sup.spawn("message_queue", "rollmesh.mq.role:main", env=env, config={
            "experiment": to_dict(exp), "bind": f"tcp://127.0.0.1:{free_port()}",
            "capacity_groups": 3 * per_get,  # room for a batch and the next ones
            "state_dir": str(work / f"queue-{tokens}-{group_size}")})
        q = RpcClient(t, (await sup.wait_ready(mq, 120))["rpc"], timeout_s=120,
                      name="message queue")
        probe = Probe({"mq": mq.process.pid})
        warm = n_groups // 4
        marks: dict[str, Any] = {}

        async def produce() -> None:
            for i, g in enumerate(groups):
                if i == warm:
                    marks["start"] = probe.read()
                while not (await q.request(PutGroups(groups=[g]))).accepted:
                    await asyncio.sleep(0.005)

        async def consume() -> None:
            got, step = 0, 0
            feed = None
            while got < n_groups:
                size = min(per_get, n_groups - got)  # the last batch: what is left
                if feed is None or feed.groups != size:
                    if feed is not None:
                        feed.close()
                    feed = BatchFeed(q, size)
                batch = await feed.get(step + 1, 0, step + 1, step, timeout_s=30.0)
                if batch is None:
                    raise RuntimeError(f"no batch within 30 s after step {step}")
                step += 1
                got += len(batch.groups)
            feed.close()
            marks["end"] = probe.read()

        await asyncio.gather(produce(), consume())
        q.close()
    finally:
        await sup.close(grace_s=10)
        t.close()
    p0, p1 = marks["start"], marks["end"]
    n = (n_groups - warm) * group_size  # each put once and handed out once in the window
    return {"tokens": tokens, "group_size": group_size, "samples": n,
            "span_s": p1["t"] - p0["t"],
            "mq_main_us": 1e6 * (p1["mq_main"] - p0["mq_main"]) / n,
            "mq_all_us": 1e6 * (p1["mq_all"] - p0["mq_all"]) / n}


def codec_us(tokens: int) -> float:
    """encode + decode of one Returned trajectory (the frames copied once, as a socket does)."""
    traj = new_trajectory("s-0", "g-0", 0, list(range(tokens)), agent_loop="single_turn")
    msg = Returned(trajectory=traj)

    def once() -> None:
        frames = [bytes(memoryview(f).cast("B")) for f in encode(msg)]
        decode(frames, Returned)

    n = 1000
    return 1e6 * statistics.median(timeit.repeat(once, number=n, repeat=15,
                                                 timer=time.thread_time)) / n


def worker_scan_ns(workers: int, repeat: int = 15) -> float:
    """Nanoseconds per worker of the scan the rollouter used to choose a worker (before its
    WorkerPool index): the freest of every registered worker of the kind."""
    pool = {bytes([i % 256, i // 256 % 256, i // 65536]):
            Worker(peer=b"", name=f"agent-{i}", kind="agent", credits=64) for i in range(workers)}

    def scan() -> Worker | None:
        return max((w for w in pool.values() if w.kind == "agent" and w.free > 0),
                   key=lambda w: w.free, default=None)

    n = max(1, 20_000 // workers)
    # CPU time, not wall; the median of the repeats, as the stack's figures are means under
    # whatever load the machine has
    mid = statistics.median(timeit.repeat(scan, number=n, repeat=repeat, timer=time.thread_time))
    return 1e9 * mid / n / workers


def worker_index_ns(workers: int, repeat: int = 7) -> float:
    """Nanoseconds per dispatch of the rollouter's WorkerPool over `workers` agent workers:
    the freest worker, a trajectory given to it and taken back (the result's return)."""
    pool = WorkerPool()
    for i in range(workers):
        pool.add(Worker(peer=i.to_bytes(4, "big"), name=f"agent-{i}", kind="agent", credits=64))
    trajs = [types.SimpleNamespace(sample_id=f"s{i}") for i in range(64)]
    turn = itertools.count()

    def dispatch() -> None:
        worker = pool.freest("agent")
        traj = trajs[next(turn) % len(trajs)]
        pool.give(worker, traj)
        pool.take_back(worker, traj.sample_id)

    n = 5000
    mid = statistics.median(timeit.repeat(dispatch, number=n, repeat=repeat,
                                          timer=time.thread_time))
    return 1e9 * mid / n


def median_runs(runs: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """One record per setting: the median of each figure over its repeats."""
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    merged = []
    for rs in out.values():
        m = dict(rs[0])
        for k, v in rs[0].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in keys:
                m[k] = statistics.median(r[k] for r in rs)
        merged.append(m)
    return merged


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x (two points: the line through them)."""
    slope, icpt = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(icpt), float(slope)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="32:16:0,1024:16:0,32:4:0,32:16:1",
                   help="rollout stack runs, PROMPT_TOKENS:GROUP_SIZE:SYNC each ('' for none)")
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=4, help="tokens per response (ignore_eos)")
    p.add_argument("--max-concurrent", type=int, default=16, help="rollout.max_concurrent (groups)")
    p.add_argument("--warmup-groups", type=int, default=16)
    p.add_argument("--groups", type=int, default=64, help="groups in the measured window")
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--rewards", type=int, default=1)
    p.add_argument("--idle-s", type=float, default=4.0)
    p.add_argument("--queue-tokens", default="43,1033,3227",
                   help="sample lengths of the queue-alone runs ('' for none)")
    p.add_argument("--queue-group-sizes", default="1,16")
    p.add_argument("--queue-samples", type=int, default=2048, help="samples per queue-alone run")
    p.add_argument("--queue-batch-samples", type=int, default=128,
                   help="samples per batch in the queue-alone runs, whatever the group size")
    p.add_argument("--repeat", type=int, default=1, help="runs of everything; medians are used")
    p.add_argument("--costs", help="write the fitted costs here (simulate.py --process-costs)")
    p.add_argument("--json", help="write result rows (benchmarks/results.py) here")
    args = p.parse_args()
    settings = [tuple(int(x) for x in item.split(":")) for item in args.settings.split(",")
                if item.strip()]
    load = os.getloadavg()[0]
    stack, alone = [], []
    with tempfile.TemporaryDirectory(prefix="rollmesh-cost-") as tmp:
        for rep in range(args.repeat):
            for tokens, group_size, sync in settings:
                work = Path(tmp) / f"rep{rep}"
                r = asyncio.run(measure(args, tokens, group_size, bool(sync), work))
                r["repeat"] = rep
                stack.append(r)
                print(f"stack: prompt {tokens:5d} tokens (sample {r['tokens_per_sample']:.0f}), "
                      f"group {group_size:2d}, sync {'every batch' if sync else 'never':11s}: "
                      f"{r['samples_per_s']:.0f} samples/s over {r['span_s']:.1f} s, "
                      f"{r['resumes'] / r['queued_samples']:.2f} resumes/sample | rollouter "
                      f"main thread {r['rollouter_main_us']:.0f} us/sample (net "
                      f"{r['rollouter_main_net_us']:.0f}; process {r['rollouter_all_us']:.0f})"
                      f" | queue main thread {r['mq_main_us']:.0f} us/sample (net "
                      f"{r['mq_main_net_us']:.0f}; process {r['mq_all_us']:.0f})", flush=True)
            for group_size in [int(x) for x in args.queue_group_sizes.split(",") if x.strip()]:
                for tokens in [int(x) for x in args.queue_tokens.split(",") if x.strip()]:
                    r = asyncio.run(queue_alone(args, tokens, group_size,
                                                Path(tmp) / f"rep{rep}"))
                    r["repeat"] = rep
                    alone.append(r)
                    print(f"queue alone: {tokens:5d}-token samples, group {group_size:2d}: "
                          f"main thread {r['mq_main_us']:.0f} us/sample (process "
                          f"{r['mq_all_us']:.0f}) over {r['samples']} samples, "
                          f"{r['span_s']:.1f} s", flush=True)
    runs = {"stack": stack, "queue_alone": alone}
    stack = median_runs(stack, ("prompt_tokens", "group_size", "sync"))
    alone = median_runs(alone, ("tokens", "group_size"))
    index = {w: worker_index_ns(w) for w in (16, 256, 4096)}
    print("the rollouter's worker index (WorkerPool), per dispatch: " +
          ", ".join(f"{w} workers {ns:.0f} ns" for w, ns in index.items()))
    scan = {w: worker_scan_ns(w) for w in (16, 256, 4096)}
    print("the scan it replaced, per worker scanned: " +
          ", ".join(f"{w} workers {ns:.0f} ns" for w, ns in scan.items()))
    codec = {n: codec_us(n) for n in (39, 8192)}
    codec_ns = 1e3 * (codec[8192] - codec[39]) / (8192 - 39)
    print(f"codec, encode + decode of a Returned: {codec[39]:.1f} us at 39 tokens, "
          f"{codec[8192]:.1f} us at 8,192 ({codec_ns:.2f} ns per token)")

    # a slope within the noise of zero (the codec moves arrays as frames, not element by
    # element) is written as 0
    costs: dict[str, Any] = {"worker_scan_ns": statistics.median(scan.values()),
                             "worker_index_ns": max(index.values()),
                             "codec_per_token_ns": max(0.0, codec_ns)}
    base = [r for r in stack if not r["sync"]]
    ref = next((r for r in base if r["group_size"] == 16 and r["prompt_tokens"] == 32), None)
    if ref is not None:
        longer = [r for r in base if r["group_size"] == 16 and r["prompt_tokens"] != 32]
        if longer:
            b = longer[-1]
            per_tok = ((b["rollouter_main_net_us"] - ref["rollouter_main_net_us"])
                       / (b["tokens_per_sample"] - ref["tokens_per_sample"]))
            costs["rollouter_per_prompt_token_ns"] = 1e3 * per_tok
        smaller = [r for r in base if r["group_size"] != 16 and r["prompt_tokens"] == 32]
        if smaller:
            s4 = smaller[-1]
            # c(G) = per_group / G + per_sample: two group sizes give both
            per_group = ((s4["rollouter_main_net_us"] - ref["rollouter_main_net_us"])
                         / (1 / s4["group_size"] - 1 / 16))
            costs["rollouter_per_group_us"] = per_group
            costs["rollouter_per_sample_us"] = ref["rollouter_main_net_us"] - per_group / 16
        else:
            costs["rollouter_per_group_us"] = 0.0
            costs["rollouter_per_sample_us"] = ref["rollouter_main_net_us"]
        # the ref's prompt tokens are counted in per_sample above; take them out
        prompt = ref["tokens_per_sample"] - args.new_tokens
        costs["rollouter_per_sample_us"] -= (costs.get("rollouter_per_prompt_token_ns", 0.0)
                                             * 1e-3 * prompt)
        synced = [r for r in stack if r["sync"] and r["group_size"] == 16
                  and r["prompt_tokens"] == 32]
        if synced and synced[-1]["resumes"]:
            s1 = synced[-1]
            per = s1["resumes"] / s1["queued_samples"]
            costs["rollouter_per_resume_us"] = (s1["rollouter_main_net_us"]
                                                - ref["rollouter_main_net_us"]) / per
    for group_size in sorted({r["group_size"] for r in alone}):
        rs = [r for r in alone if r["group_size"] == group_size]
        if len(rs) >= 2:
            icpt, slope = fit_line([r["tokens"] for r in rs], [r["mq_main_us"] for r in rs])
            costs[f"queue_g{group_size}"] = {"fixed_us": icpt, "per_token_ns": 1e3 * slope}
    g = sorted({r["group_size"] for r in alone})
    if len(g) >= 2 and all(f"queue_g{x}" in costs for x in g[:1] + g[-1:]):
        # c(G, T) = per_put / G + per_sample + per_token x T: the intercepts at two group
        # sizes give per_put and per_sample; per_token is the slope at the larger group size
        # (rollmesh's groups are 8-16 samples; at G = 1 every sample is a put of its own,
        # and the slope there came out noisier)
        lo, hi = costs[f"queue_g{g[0]}"], costs[f"queue_g{g[-1]}"]
        per_put = (lo["fixed_us"] - hi["fixed_us"]) / (1 / g[0] - 1 / g[-1])
        costs["queue_per_put_us"] = per_put
        costs["queue_per_sample_us"] = hi["fixed_us"] - per_put / g[-1]
        costs["queue_per_token_ns"] = max(0.0, hi["per_token_ns"])
    print("fitted (us of main-thread CPU; simulate.py --process-costs):")
    for k, v in costs.items():
        print(f"  {k}: {v if isinstance(v, dict) else round(v, 2)}")
    print(f"machine: {os.cpu_count()} cpus, 1-min load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end")
    if args.costs:
        Path(args.costs).write_text(json.dumps(
            {k: v for k, v in costs.items() if not isinstance(v, dict)}, indent=1))
    rows = []
    if ref is not None:
        rows.append(row("rollouter main-thread CPU per sample (net of idle)",
                        ref["rollouter_main_net_us"], ref["rollouter_main_us"], "us",
                        baseline_name="the same, idle ticking included", higher_is_better=False,
                        note=f"{ref['tokens_per_sample']:.0f}-token samples, group 16, tiny "
                             f"model on the built-in engine"))
    write(args.json, rows)
    print(json.dumps({"runs": runs, "costs": costs,
                      "worker_scan_ns": scan, "worker_index_ns": index, "codec_us": codec}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
