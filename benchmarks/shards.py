"""Rollout and queue shards on CPU (issue 33): N rollouters x M queue shards against 1 x 1 on a
load where the rollouter is the bottleneck, samples/s and each process's CPU.

    .venv/bin/python benchmarks/shards.py [--configs 1x1,2x2] [--repeat 1] [--groups 160]
        [--warmup-groups 24] [--new-tokens 1] [--prompt-tokens 32] [--group-size 16]
        [--agents N] [--rewards N] [--engines 1] [--sync] [--costs PATH] [--json PATH]

Every role is its own process, wired as `rollmesh launch` wires shards (rollmesh/launcher/
plan.py): M MessageQueues (shard j of M, durable log each), N rollouters (shard i of N, its
journal; `message_queue` queue 0, `queue_shards` every queue in order when M > 1), --engines
built-in engines (the random `tiny` model; every rollouter and agent worker is given them all),
--agents agent workers and --rewards reward workers (`letter_share`, in their sandbox) dealt to
the rollouters in turn (worker k to rollouter k % N; by default the same workers in every
configuration, 2 agent and 2 reward workers per rollouter of the largest: a reward worker scores
8 samples at once, and with fewer the credits, not the rollouter, bound the 1 x 1 run). This
script plays the trainer (each step's batch with `ShardedFeed` over one RpcClient per queue, a
`BatchFeed` when M == 1, step k-1 committed) and, with --sync, the synchronizer after every
batch: Pause (abort) to every rollouter at once (`Fanout`, the synchronizer's), every engine's
version bumped, WeightVersion to every queue, Resume to every rollouter. Without --sync the
staleness bound is off (the version stays 0).

The load is meant to be rollouter-bound: --new-tokens tokens per response from the tiny model
(ignore_eos), short prompts, a cheap reward, a large max_concurrent, so each sample costs the
engine little and the rollouter its fixed per-sample work (Assign, Returned, Score, Scored, its
share of a put and of the journal, admission). Configurations (--configs, NxM) alternate within
one invocation, --repeat times; the figures are medians over the repeats.

Measured over the window from the --warmup-groups-th group (counted over all rollouters) after
the last worker joined, for --groups groups: samples/s (samples queued by all rollouters / the
window), and per process (rollouter i, queue j, agent worker k, reward worker k and its sandbox
children, engine e) the CPU seconds per second of its main thread and of all its threads
(/proc/PID/task/TID/schedstat). The rollouter's (resp. queue's) main-thread microseconds per
sample it queued (resp. per sample put in and handed out) are given gross and net of its idle
rate (measured for --idle-s before any worker joined), as benchmarks/rollout_cost.py does.

`--costs PATH` writes the per-shard costs of the largest configuration (the one with most
processes, normally 2x2) as a JSON object `benchmarks/simulate.py --process-costs PATH` reads:
`rollouter_per_sample_us` and `queue_per_sample_us` such that simulate.py's per-sample cost
model (its ProcessCosts defaults for the per-group, per-prompt-token, per-put, per-token, codec
and worker-choice terms, which this single setting cannot separate) gives the net main-thread
cost measured per shard here; `rollouter_idle_cores` and `queue_idle_cores`, each shard's idle
rate (a fixed load per process, whatever its share of the samples). The queue's puts are taken
as one group each (its per-put term at its largest): the put loop puts more at once when more
is ready, so the per-sample figure derived is if anything low by at most per_put / group size.

On a machine with few cores every process shares them: the total CPU of all processes is
printed beside the core count and the machine's busy CPU (other work on it included), and where
that reaches the cores, more shards cannot go faster. At the window's end the rollouters' samples
in flight, waiting for an agent worker (pending) and for a reward worker (to_score) are printed:
a backlog there says the workers, not the rollouter, were the bound.
"""

from __future__ import annotations

import os
import sys

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.engine_proc import start_engine, with_repo_on_path  # noqa: E402
from benchmarks.results import row, write  # noqa: E402
from benchmarks.rollout_cost import cpu_s, write_dataset  # noqa: E402
from benchmarks.simulate import (  # noqa: E402
    ProcessCosts,
    Workload,
    queue_seconds_per_sample,
    rollouter_seconds_per_sample,
)
from rollmesh.config import load_experiment, to_dict  # noqa: E402
from rollmesh.engine.client import EngineClient  # noqa: E402
from rollmesh.launcher.supervisor import Supervisor  # noqa: E402
from rollmesh.mq.client import BatchFeed, ShardedFeed  # noqa: E402
from rollmesh.sync.role import Fanout  # noqa: E402
from rollmesh.wire.messages import Pause, Resume, StatsRequest, WeightVersion  # noqa: E402
from rollmesh.wire.transport import RpcClient, Transport, free_port  # noqa: E402


def parse_configs(text: str) -> list[tuple[int, int]]:
    """"1x1,2x2" -> [(1, 1), (2, 2)]: (rollouters, queue shards)."""
    out = []
    for item in text.split(","):
        if not item.strip():
            continue
        n, _, m = item.strip().lower().partition("x")
        if not (n.isdigit() and m.isdigit()) or int(n) < 1 or int(m) < 1:
            raise SystemExit(f"--configs: expected NxM items like 2x2, got {item!r}")
        out.append((int(n), int(m)))
    if not out:
        raise SystemExit("--configs: no configuration")
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (the reward worker's sandbox children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                kids = Path(f"/proc/{p}/task/{tid}/children").read_text().split()
                out += [int(k) for k in kids]
                todo += [int(k) for k in kids]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every process, this stack's or not):
    /proc/stat's first line, all but idle and iowait."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


class Probe:
    """CPU seconds of each named process: main thread, all threads, and (`tree` names) all
    threads of its descendants; and the machine's busy seconds."""

    def __init__(self, pids: dict[str, int], tree: tuple[str, ...] = ()):
        self.pids, self.tree = pids, tree

    def read(self) -> dict[str, float]:
        out = {"t": time.monotonic(), "machine": machine_busy_s()}
        for name, pid in self.pids.items():
            out[f"{name}_main"] = cpu_s(pid, True)
            out[f"{name}_all"] = cpu_s(pid, False)
            if name in self.tree:
                out[f"{name}_children"] = sum(cpu_s(k, False) for k in descendants(pid))
        return out


def dealt(total: int, n: int) -> list[int]:
    """The rollouter of each of `total` workers: worker k to rollouter k % n (the launcher's)."""
    return [k % n for k in range(total)]


async def measure(args: argparse.Namespace, n_roll: int, n_queue: int, work: Path) -> dict:
    """One run of N rollouters x M queue shards; the figures of its measured window."""
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{n_roll}x{n_queue}"
    g = args.group_size
    rows = max(64, 4 * n_roll * (args.warmup_groups + args.groups + 8 * args.batch_groups))
    dataset = work / f"data-{tag}.jsonl"
    write_dataset(dataset, rows, args.prompt_tokens, g)
    exp = load_experiment(ROOT / "configs/tiny_cpu.toml", overrides=[
        f"data.train_path={json.dumps(str(dataset))}", f"data.group_size={g}",
        f"data.max_prompt_tokens={args.prompt_tokens + 200}",
        f"model.max_context={args.prompt_tokens + 300}",
        f"rollout.max_new_tokens={args.new_tokens}", f"rollout.batch_groups={args.batch_groups}",
        f"rollout.max_concurrent={args.max_concurrent}", "rollout.eval_every=0",
        # without syncs the version stays 0: a bound past the run's length admits freely
        f"staleness.max_staleness={1 if args.sync else 10_000}"])
    spec = to_dict(exp)
    env = {k: v for k, v in with_repo_on_path().items() if k == "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    # the same workers in every configuration (2 of each per rollouter of the largest), so
    # that only the shards differ: a reward worker scores 8 at once (2 sandbox children x 4),
    # an agent worker runs 64
    agents = args.agents or 2 * args.most_rollouters
    rewards = args.rewards or 2 * args.most_rollouters
    if agents < n_roll or rewards < n_roll:
        raise SystemExit(f"{tag}: --agents and --rewards must give each of the {n_roll} "
                         f"rollouters at least one (got {agents} and {rewards})")
    engines: list[Any] = []
    urls: list[str] = []
    t = Transport()
    sup = Supervisor(t, heartbeat_s=1.0, liveness=60, log_dir=work / f"logs-{tag}")
    clients: list[RpcClient] = []
    try:
        for e in range(args.engines):
            proc, url = await asyncio.to_thread(
                start_engine, "--model", "tiny", "--seed", "0", "--weight-version", "0",
                "--max-running-requests", str(args.max_concurrent * g), python=sys.executable)
            engines.append(proc)
            urls.append(url)
        queues = [sup.spawn("message_queue", "rollmesh.mq.role:main", instance=j, env=env,
                            config={"experiment": spec, "bind": f"tcp://127.0.0.1:{free_port()}",
                                    "state_dir": str(work / f"mq-{tag}-{j}"),
                                    "shard": j, "shards": n_queue})
                  for j in range(n_queue)]
        q_rpc = [(await sup.wait_ready(q, 120))["rpc"] for q in queues]
        rollouters = [sup.spawn("rollouter", "rollmesh.rollout.role:main", instance=i, env=env,
                                config={"experiment": spec,
                                        "bind": f"tcp://127.0.0.1:{free_port()}",
                                        "control": f"tcp://127.0.0.1:{free_port()}",
                                        "message_queue": q_rpc[0],
                                        "queue_shards": q_rpc if n_queue > 1 else [],
                                        "engines": urls,
                                        "state_dir": str(work / f"rollouter-{tag}-{i}"),
                                        "shard": i, "shards": n_roll})
                      for i in range(n_roll)]
        eps = [await sup.wait_ready(r, 120) for r in rollouters]
        pids = {f"rollouter{i}": r.process.pid for i, r in enumerate(rollouters)}
        pids.update({f"queue{j}": q.process.pid for j, q in enumerate(queues)})
        pids.update({f"engine{e}": p.pid for e, p in enumerate(engines)})
        probe = Probe(dict(pids))
        # idle rate: the loops that tick whatever the load, before any worker joins
        await asyncio.sleep(1.0)
        idle0 = probe.read()
        await asyncio.sleep(args.idle_s)
        idle1 = probe.read()
        idle = {k: (idle1[k] - idle0[k]) / (idle1["t"] - idle0["t"]) for k in idle0
                if k not in ("t", "machine")}
        for k, i in enumerate(dealt(rewards, n_roll)):
            w = sup.spawn("reward_worker", "rollmesh.rewards.role:main", instance=k, env=env,
                          config={"experiment": spec, "rollouter": eps[i]["channel"]})
            await sup.wait_ready(w, 120)
            pids[f"reward{k}"] = w.process.pid
        for k, i in enumerate(dealt(agents, n_roll)):
            w = sup.spawn("agent_worker", "rollmesh.agents.role:main", instance=k, env=env,
                          config={"experiment": spec, "rollouter": eps[i]["channel"],
                                  "engines": urls})
            await sup.wait_ready(w, 120)
            pids[f"agent{k}"] = w.process.pid
        # this process too: the trainer's and synchronizer's part, played here
        pids["bench"] = os.getpid()
        probe = Probe(pids, tree=tuple(f"reward{k}" for k in range(rewards)))
        ro = [RpcClient(t, ep["rpc"], timeout_s=120, name=f"rollouter {i}")
              for i, ep in enumerate(eps)]
        qs = [RpcClient(t, a, timeout_s=120, name=f"message queue {j}")
              for j, a in enumerate(q_rpc)]
        clients += ro + qs
        every_rollouter, every_queue = Fanout(ro), Fanout(qs)

        async def consume() -> None:
            """The trainer's and the synchronizer's part: batches out, a sync after each."""
            version = step = 0
            feed = (BatchFeed(qs[0], args.batch_groups) if n_queue == 1
                    else ShardedFeed(qs, args.batch_groups))
            feeds.append(feed)
            while True:
                batch = await feed.get(step + 1, version, step + 1, step, timeout_s=60.0)
                if batch is None:
                    raise RuntimeError(f"{tag}: no batch within 60 s after step {step}")
                step += 1
                if args.sync:
                    await every_rollouter.request(Pause(mode="abort"))
                    version += 1
                    async with EngineClient(urls) as client:  # every engine
                        await client.update_weight_version(str(version))
                    await every_queue.request(WeightVersion(version=version))
                    await every_rollouter.request(Resume(version=version))

        async def stats() -> tuple[list[dict], list[dict]]:
            r = await asyncio.gather(*(c.request(StatsRequest()) for c in ro))
            q = await asyncio.gather(*(c.request(StatsRequest()) for c in qs))
            return [x.values for x in r], [x.values for x in q]

        async def until(samples: int) -> tuple[dict, list[dict], list[dict]]:
            while True:
                if consumer.done():
                    consumer.result()  # its error, if it failed
                r, q = await stats()
                if sum(x.get("queued_samples", 0) for x in r) >= samples:
                    return probe.read(), r, q
                await asyncio.sleep(0.25)

        feeds: list[Any] = []
        consumer = asyncio.create_task(consume())
        try:
            # counted from now: generation began when the first agent worker joined
            base = sum(x.get("queued_samples", 0) for x in (await stats())[0])
            start = await until(base + args.warmup_groups * g)
            end = await until(sum(x.get("queued_samples", 0) for x in start[1]) + args.groups * g)
            opened = feeds[0].opened if feeds else 0
        finally:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
    finally:
        for c in clients:
            c.close()
        await sup.close(grace_s=10)
        t.close()
        for proc in engines:
            proc.terminate()
        for proc in engines:
            await asyncio.to_thread(proc.wait, 30)

    (p0, r0, q0), (p1, r1, q1) = start, end
    span = p1["t"] - p0["t"]
    queued = [b.get("queued_samples", 0) - a.get("queued_samples", 0) for a, b in zip(r0, r1)]
    # the queue's work per sample is one put and one hand-out: the mean of the two counts
    handed = [((b["put_samples"] - a["put_samples"])
               + (b["consumed_samples"] - a["consumed_samples"])) / 2 for a, b in zip(q0, q1)]
    out: dict[str, Any] = {
        "config": tag, "rollouters": n_roll, "queues": n_queue, "engines": args.engines,
        "agents": agents, "rewards": rewards, "span_s": span, "queued_samples": sum(queued),
        "samples_per_s": sum(queued) / span, "queued_by_rollouter": queued,
        "handed_by_queue": handed, "idle_cpu_per_s": idle, "streams_opened": opened,
        "resumes": sum(b.get("interrupted", 0) - a.get("interrupted", 0)
                       for a, b in zip(r0, r1))}
    cpu: dict[str, dict[str, float]] = {}
    for name in pids:
        c = {part: (p1[f"{name}_{part}"] - p0[f"{name}_{part}"]) / span
             for part in ("main", "all")}
        if f"{name}_children" in p1:
            c["children"] = (p1[f"{name}_children"] - p0[f"{name}_children"]) / span
        cpu[name] = c
    out["cpu_per_s"] = cpu
    out["cpu_total_per_s"] = sum(c["all"] + c.get("children", 0.0) for c in cpu.values())
    out["machine_busy_per_s"] = (p1["machine"] - p0["machine"]) / span
    # where the samples were at the window's end, summed over the rollouters: waiting for an
    # agent worker's credit (pending), for a reward worker's (to_score), in flight in all
    out["at_end"] = {k: sum(x.get(k, 0) for x in r1) for k in ("in_flight", "pending",
                                                               "to_score", "ready_groups")}
    per_sample: dict[str, dict[str, float]] = {}
    for names, counts in (([f"rollouter{i}" for i in range(n_roll)], queued),
                          ([f"queue{j}" for j in range(n_queue)], handed)):
        for name, n in zip(names, counts):
            gross = cpu[name]["main"] * span
            per_sample[name] = {"main_us": 1e6 * gross / max(n, 1),
                                "main_net_us": 1e6 * (gross - idle[f"{name}_main"] * span)
                                / max(n, 1), "samples": n}
    out["per_sample"] = per_sample
    # what the rollouters could carry if each had a core of its own: each one's samples per
    # second of net main-thread CPU, summed (the figure sharding multiplies)
    out["rollouter_capacity_per_s"] = sum(1e6 / per_sample[f"rollouter{i}"]["main_net_us"]
                                          for i in range(n_roll))
    out["cpu_us_per_sample"] = 1e6 * out["cpu_total_per_s"] / out["samples_per_s"]
    return out


def median_of(runs: list[dict]) -> dict:
    """One record per configuration: the median of every number over the repeats (nested
    dicts and lists element by element)."""
    def med(values: list[Any]) -> Any:
        v0 = values[0]
        if isinstance(v0, (bool, str)) or all(v == v0 for v in values):
            return v0
        if isinstance(v0, (int, float)):
            return statistics.median(values)
        if isinstance(v0, dict):
            return {k: med([v[k] for v in values]) for k in v0}
        if isinstance(v0, list):
            return [med([v[i] for v in values]) for i in range(len(v0))]
        return v0
    return med(runs)


def shard_costs(r: dict, args: argparse.Namespace) -> dict[str, float]:
    """The per-shard figures of run `r` as ProcessCosts fields (see the module's docstring)."""
    base = ProcessCosts()
    roll = statistics.mean(v["main_net_us"] for k, v in r["per_sample"].items()
                           if k.startswith("rollouter"))
    queue = statistics.mean(v["main_net_us"] for k, v in r["per_sample"].items()
                            if k.startswith("queue"))
    tokens = args.prompt_tokens + args.new_tokens
    resumes = r["resumes"] / max(r["queued_samples"], 1)
    w = Workload(model="shards bench", cell_gpus=0, label=r["config"], samples_per_gpu_s=0.0,
                 rollout_fraction=0.0, seqs_per_rollout_gpu=0.0,
                 prompt_tokens=float(args.prompt_tokens), tokens_per_sample=float(tokens),
                 resumes_per_sample=resumes, group_size=args.group_size)
    zero = dataclasses.replace(base, rollouter_per_sample_us=0.0, queue_per_sample_us=0.0)
    # what the model's other terms (its defaults) give at this setting; the rest is per sample
    r_other = 1e6 * rollouter_seconds_per_sample(w, zero, r["agents"] // r["rollouters"],
                                                 r["rewards"] // r["rollouters"])
    q_other = 1e6 * queue_seconds_per_sample(w, zero)
    idle = r["idle_cpu_per_s"]
    return {
        "rollouter_per_sample_us": max(0.0, roll - r_other),
        "queue_per_sample_us": max(0.0, queue - q_other),
        "rollouter_idle_cores": statistics.mean(v for k, v in idle.items()
                                                if k.startswith("rollouter") and
                                                k.endswith("_main")),
        "queue_idle_cores": statistics.mean(v for k, v in idle.items()
                                            if k.startswith("queue") and k.endswith("_main")),
    }


def report(r: dict) -> None:
    print(f"{r['config']}: {r['samples_per_s']:.0f} samples/s over {r['span_s']:.1f} s "
          f"({r['queued_samples']:.0f} samples; by rollouter "
          f"{', '.join(f'{x:.0f}' for x in r['queued_by_rollouter'])}); {r['agents']} agent "
          f"and {r['rewards']} reward workers, {r['engines']} engine(s); all processes "
          f"{r['cpu_total_per_s']:.2f} CPU s/s on {os.cpu_count()} cores, the machine "
          f"{r['machine_busy_per_s']:.2f} (other work included) "
          f"({r['cpu_us_per_sample']:.0f} us of CPU per sample in all); rollouters' capacity "
          f"at a full main thread each {r['rollouter_capacity_per_s']:.0f} samples/s; batch "
          f"streams opened {r['streams_opened']}; at the end " +
          ", ".join(f"{k} {v}" for k, v in r["at_end"].items()), flush=True)
    print(f"  {'process':12s} {'main CPU/s':>10s} {'all CPU/s':>10s} {'us/sample':>10s} "
          f"{'net':>7s}")
    for name, c in r["cpu_per_s"].items():
        ps = r["per_sample"].get(name)
        extra = (f" {ps['main_us']:10.0f} {ps['main_net_us']:7.0f}" if ps else "")
        kids = (f"   (+ sandbox children {c['children']:.2f})" if "children" in c else "")
        print(f"  {name:12s} {c['main']:10.2f} {c['all']:10.2f}{extra}{kids}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1x1,2x2",
                   help="ROLLOUTERSxQUEUE_SHARDS, alternated in this one invocation")
    p.add_argument("--repeat", type=int, default=1, help="runs of every configuration (medians)")
    p.add_argument("--batch-groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=1, help="tokens per response (ignore_eos)")
    p.add_argument("--max-concurrent", type=int, default=64, help="rollout.max_concurrent (groups)")
    p.add_argument("--warmup-groups", type=int, default=24)
    p.add_argument("--groups", type=int, default=160, help="groups in the measured window")
    p.add_argument("--agents", type=int, default=0,
                   help="agent workers in all, dealt to the rollouters in turn (0: 2 per "
                        "rollouter of the largest configuration, in every configuration)")
    p.add_argument("--rewards", type=int, default=0,
                   help="reward workers in all, dealt in turn (0: as --agents)")
    p.add_argument("--engines", type=int, default=1, help="built-in engines (tiny model)")
    p.add_argument("--sync", action="store_true",
                   help="a weight sync after every batch (default: none, staleness bound off)")
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--costs", help="write the largest configuration's per-shard costs here "
                                   "(simulate.py --process-costs)")
    p.add_argument("--json", help="write result rows (benchmarks/results.py) here")
    args = p.parse_args()
    configs = parse_configs(args.configs)
    args.most_rollouters = max(n for n, _ in configs)
    for n, m in configs:
        if args.batch_groups < m:
            p.error(f"--batch-groups {args.batch_groups}: fewer than the {m} queue shards")
    load = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="rollmesh-shards-") as tmp:
        for rep in range(args.repeat):
            for n, m in configs:
                r = asyncio.run(measure(args, n, m, Path(tmp) / f"rep{rep}"))
                r["repeat"] = rep
                runs.setdefault(r["config"], []).append(r)
                report(r)
    merged = {k: median_of(v) for k, v in runs.items()}
    first = f"{configs[0][0]}x{configs[0][1]}"
    if args.repeat > 1:
        print(f"\nmedians of {args.repeat} runs:")
        for r in merged.values():
            report(r)
    print()
    rows = []
    ref = merged[first]
    for name, r in merged.items():
        ratio = r["samples_per_s"] / ref["samples_per_s"]
        cap = r["rollouter_capacity_per_s"] / ref["rollouter_capacity_per_s"]
        print(f"{name}: {r['samples_per_s']:.0f} samples/s, {ratio:.2f}x {first}; rollouters' "
              f"capacity at a core each {r['rollouter_capacity_per_s']:.0f} samples/s, "
              f"{cap:.2f}x {first}")
        if name == first:
            continue
        r_main = max(c["main"] for k, c in r["cpu_per_s"].items() if k.startswith("rollouter"))
        ref_main = max(c["main"] for k, c in ref["cpu_per_s"].items()
                       if k.startswith("rollouter"))
        rows.append(row(
            f"samples/s, {r['rollouters']} rollouters x {r['queues']} queue shards vs {first}",
            r["samples_per_s"], ref["samples_per_s"], "samples/s",
            baseline_name=f"{ref['rollouters']} rollouter(s) x {ref['queues']} queue shard(s)",
            higher_is_better=True, target=1.7 if name == "2x2" else None,
            note=f"{args.prompt_tokens}-token prompts, {args.new_tokens} new token(s), group "
                 f"{args.group_size}, tiny model, {args.engines} built-in engine(s), "
                 f"{'a sync per batch' if args.sync else 'no sync'}; all processes "
                 f"{r['cpu_total_per_s']:.2f} vs {ref['cpu_total_per_s']:.2f} CPU s/s on "
                 f"{os.cpu_count()} cores; busiest rollouter main thread {r_main:.2f} vs "
                 f"{ref_main:.2f}; the machine busy {r['machine_busy_per_s']:.2f} vs "
                 f"{ref['machine_busy_per_s']:.2f} cores (other work included)"))
    for name, r in merged.items():
        for who in ("rollouter", "queue"):
            net = [v["main_net_us"] for k, v in r["per_sample"].items() if k.startswith(who)]
            rows.append(row(f"{who} main-thread CPU per sample (net of idle), {name}",
                            statistics.mean(net), statistics.mean(
                                v["main_us"] for k, v in r["per_sample"].items()
                                if k.startswith(who)), "us",
                            baseline_name="the same, idle ticking included",
                            higher_is_better=False,
                            note=f"mean over the {len(net)} {who} shard(s)"))
    biggest = max(merged.values(), key=lambda r: (r["rollouters"] * r["queues"],
                                                  r["rollouters"]))
    costs = shard_costs(biggest, args)
    print(f"per-shard costs ({biggest['config']}; simulate.py --process-costs): " +
          ", ".join(f"{k} {v:.3g}" for k, v in costs.items()))
    print(f"machine: {os.cpu_count()} cpus, 1-min load average {load:.1f} at the start "
          f"({started}), {os.getloadavg()[0]:.1f} at the end")
    if args.costs:
        Path(args.costs).write_text(json.dumps(costs, indent=1))
    write(args.json, rows)
    print(json.dumps({"runs": runs, "costs": costs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
