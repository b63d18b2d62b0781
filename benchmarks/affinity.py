"""Engine affinity: prompt tokens prefilled and samples/s over several engines, per routing.

    python benchmarks/affinity.py [--engines 2,4] [--clients 2] [--groups 32] [--group 8]
        [--credits 32] [--prompt-tokens 200] [--new-tokens 32] [--mt-groups 16] [--mt-group 4]
        [--turns 4] [--obs-tokens 30] [--routings least_loaded,affinity,router] [--repeats 3]
        [--seed 0] [--json PATH]

N built-in engine processes (tiny model, CPU, 1 torch thread each; not pinned: on a shared
machine a pinned engine that shares its core runs slower and the routings then measure that),
driven through rollmesh's real EngineClient by --clients separate clients (as separate
agent-worker processes would: each knows only its own requests in flight), each running
--credits samples at once, taking the next from one queue in group order as a worker takes what
the rollouter dispatches (so a group's samples spread over the clients), all in one run:

  least_loaded  each request to the healthy engine with the fewest in flight (rollmesh before
                affinity; `engine.routing = "least_loaded"`)
  affinity      the trajectory's group id as the affinity key (`engine.routing = "affinity"`,
                the default): rendezvous hashing with the load bound (EngineClient._pick)
  router        every client sends to one sglang-router (`python -m sglang_router.launch_router
                --policy cache_aware`) in front of the engines; reported unavailable, with the
                reason, where it cannot start or serve

Two loads, each started from empty prefix caches (/flush_cache):

  grpo   --groups prompts of --prompt-tokens random token ids, each sampled --group times
  tool   --mt-groups prompts x --mt-group trajectories, each --turns turns: a turn generates
         --new-tokens / 2 tokens, then the trajectory's next prompt is everything so far plus an
         observation of --obs-tokens tokens (a tool's answer); a trajectory stays with its client

Reported from the engines' own counters (/get_server_info, summed): prompt tokens prefilled;
samples/s is samples (grpo) or trajectories (tool) over wall time; the routings run in turn,
--repeats times over on the same engines, and the figures are medians. Ratios against
least_loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_proc import start_engine  # noqa: E402
from benchmarks.results import row, write  # noqa: E402
from rollmesh.engine.client import EngineClient  # noqa: E402

ROUTINGS = ("least_loaded", "affinity", "router")


class Unavailable(Exception):
    """A routing that cannot run here (the reason is reported instead of a figure)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(urls: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """sglang-router, cache_aware, in front of `urls`; (process, url) once it routes a
    /generate (its /health answers before its workers are registered)."""
    if importlib.util.find_spec("sglang_router") is None:
        raise Unavailable("sglang-router is not installed (pip install sglang-router==0.3.2)")
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
         "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    last = ""
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            req = urllib.request.Request(
                url + "/generate", method="POST", headers={"Content-Type": "application/json"},
                data=b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}')
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError as e:
            last = str(e)
            time.sleep(0.3)
    proc.kill()
    proc.wait(10)
    tail = log_path.read_text()[-400:].strip().replace("\n", " | ")
    raise Unavailable(f"sglang-router did not serve /generate within 60 s (exit code "
                      f"{proc.poll()}; last error: {last}; log: {tail})")


async def engine_counters(urls: list[str]) -> dict[str, int]:
    keys = ("prefill_tokens", "prompt_tokens", "cached_prompt_tokens", "generated_tokens")
    out = dict.fromkeys(keys, 0)
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(url + "/get_server_info") as r:
                state = (await r.json())["internal_states"][0]
            for k in keys:
                out[k] += int(state[k])
    return out


async def flush(urls: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.post(url + "/flush_cache") as r:
                assert r.status == 200, await r.text()


def make_prompts(n: int, length: int, rng: np.random.Generator) -> list[list[int]]:
    return [rng.integers(3, 2000, size=length).tolist() for _ in range(n)]


async def drain(clients: list[EngineClient], credits: int, items: list[tuple[int, int]],
                work) -> None:
    """Run `items` in order through `credits` slots per client, as agent workers with that
    many credits take the next sample the rollouter dispatches: a group's consecutive samples
    go to whichever slots free up first, so to several clients."""
    queue = list(reversed(items))

    async def slot(client: EngineClient) -> None:
        while queue:
            await work(client, *queue.pop())

    await asyncio.gather(*[slot(c) for c in clients for _ in range(credits)])


async def grpo(clients: list[EngineClient], keyed: bool, prompts: list[list[int]], group: int,
               new_tokens: int, credits: int) -> int:
    async def one(client: EngineClient, g: int, k: int) -> None:
        await client.generate(prompts[g], {"max_new_tokens": new_tokens, "temperature": 1.0,
                                           "ignore_eos": True,
                                           "sampling_seed": g * group + k},
                              affinity=f"g{g}" if keyed else None)

    await drain(clients, credits, [(g, k) for g in range(len(prompts)) for k in range(group)],
                one)
    return len(prompts) * group


async def tool(clients: list[EngineClient], keyed: bool, prompts: list[list[int]], group: int,
               turns: int, new_tokens: int, obs_tokens: int, seed: int, credits: int) -> int:
    async def one(client: EngineClient, g: int, k: int) -> None:
        rng = np.random.default_rng(seed * 100_003 + g * 101 + k)
        context = list(prompts[g])
        for turn in range(turns):  # a trajectory's turns stay with its worker (client)
            out = await client.generate(context, {"max_new_tokens": new_tokens,
                                                  "temperature": 1.0, "ignore_eos": True,
                                                  "sampling_seed": (g * group + k) * 16 + turn},
                                        affinity=f"t{g}" if keyed else None)
            context += out.output_ids + rng.integers(3, 2000, size=obs_tokens).tolist()

    await drain(clients, credits, [(g, k) for g in range(len(prompts)) for k in range(group)],
                one)
    return len(prompts) * group


async def run_one(engine_urls: list[str], routing: str, router_url: str | None, load: str,
                  args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    await flush(engine_urls)
    targets = [router_url] if routing == "router" else engine_urls
    clients = [EngineClient(targets, routing="least_loaded" if routing == "least_loaded"
                            else "affinity", retries=0,
                            affinity_load_factor=args.load_factor, affinity_slack=args.slack)
               for _ in range(args.clients)]
    keyed = routing == "affinity"
    for c in clients:
        await c.__aenter__()
    try:
        before = await engine_counters(engine_urls)
        start = time.perf_counter()
        if load == "grpo":
            samples = await grpo(clients, keyed, prompts, args.group, args.new_tokens,
                                 args.credits)
        else:
            samples = await tool(clients, keyed, prompts, args.mt_group, args.turns,
                                 max(1, args.new_tokens // 2), args.obs_tokens, args.seed,
                                 args.credits)
        wall = time.perf_counter() - start
        after = await engine_counters(engine_urls)
    finally:
        for c in clients:
            await c.close()
    d = {k: after[k] - before[k] for k in after}
    return {"wall": wall, "samples": samples, "samples_per_s": samples / wall,
            "prefill_tokens": d["prefill_tokens"], "prompt_tokens": d["prompt_tokens"],
            "hit_rate": d["cached_prompt_tokens"] / max(d["prompt_tokens"], 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--engines", default="2,4")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--credits", type=int, default=32,
                   help="samples (trajectories) each client runs at once")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--load-factor", type=float, default=1.25,
                   help="EngineClient affinity_load_factor")
    p.add_argument("--slack", type=int, default=32, help="EngineClient affinity_slack")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--mt-groups", type=int, default=16)
    p.add_argument("--mt-group", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--obs-tokens", type=int, default=30)
    p.add_argument("--concurrency", type=int, default=64, help="engine max running requests")
    p.add_argument("--routings", default=",".join(ROUTINGS))
    p.add_argument("--loads", default="grpo,tool")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    routings = args.routings.split(",")
    loads = args.loads.split(",")
    for r in routings:
        if r not in ROUTINGS:
            p.error(f"--routings: {r!r} is not one of {', '.join(ROUTINGS)}")
    rng = np.random.default_rng(args.seed)
    prompts = {"grpo": make_prompts(args.groups, args.prompt_tokens, rng),
               "tool": make_prompts(args.mt_groups, args.prompt_tokens, rng)}
    cpus = sorted(os.sched_getaffinity(0))
    print(f"model {args.model}; grpo: {args.groups} groups of {args.group}, prompts "
          f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens; tool: {args.mt_groups} "
          f"groups of {args.mt_group} trajectories x {args.turns} turns of "
          f"{max(1, args.new_tokens // 2)} new tokens + {args.obs_tokens} observation tokens; "
          f"{args.clients} clients x {args.credits} credits; engines 1 torch thread each, cpus {len(cpus)}, load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    rows, lines = [], []
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"affinity-bench-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    for n in (int(x) for x in args.engines.split(",")):
        procs = [start_engine("--model", args.model, "--max-running-requests",
                              str(args.concurrency), "--seed", str(args.seed), "--threads", "1",
                              python=sys.executable)
                 for i in range(n)]
        urls = [u for _, u in procs]
        router, router_url, unavailable = None, None, None
        try:
            if "router" in routings:
                try:
                    router, router_url = start_router(urls, logs / f"router-{n}.log")
                except Unavailable as e:
                    unavailable = str(e)
                    print(f"{n} engines: router unavailable: {unavailable}", flush=True)
            results: dict[tuple[str, str], list[dict[str, float]]] = {}
            for _ in range(args.repeats):
                for load in loads:
                    for routing in routings:
                        if routing == "router" and router_url is None:
                            continue
                        try:
                            res = asyncio.run(run_one(urls, routing, router_url, load, args,
                                                      prompts[load]))
                        except Exception as e:  # noqa: BLE001 - said, not made up
                            if routing != "router":
                                raise
                            unavailable = f"{type(e).__name__}: {e}"
                            print(f"{n} engines, {load}: router failed: {unavailable}",
                                  flush=True)
                            continue
                        results.setdefault((load, routing), []).append(res)
                        print(f"  {n} engines {load:5} {routing:12} wall {res['wall']:6.2f} s "
                              f"samples/s {res['samples_per_s']:7.2f} prefilled "
                              f"{res['prefill_tokens']:8,} hit {res['hit_rate']:.0%}",
                              flush=True)
        finally:
            if router is not None:
                router.send_signal(signal.SIGTERM)
                try:
                    router.wait(20)
                except subprocess.TimeoutExpired:
                    router.kill()
            for proc, _ in procs:
                proc.send_signal(signal.SIGTERM)
            for proc, _ in procs:
                proc.wait(60)
        for load in loads:
            med = {}
            for routing in routings:
                done = results.get((load, routing))
                if done:
                    med[routing] = {k: statistics.median(r[k] for r in done) for k in done[0]}
            base = med.get("least_loaded")
            lines.append(f"{n} engines, {load}:")
            for routing in routings:
                m = med.get(routing)
                if m is None:
                    lines.append(f"  {routing:12} unavailable: {unavailable}")
                    continue
                ratio = ("" if base is None else
                         f"  prefilled {m['prefill_tokens'] / base['prefill_tokens']:.2f}x, "
                         f"samples/s {m['samples_per_s'] / base['samples_per_s']:.2f}x")
                lines.append(f"  {routing:12} prefilled {m['prefill_tokens']:8,.0f}  samples/s "
                             f"{m['samples_per_s']:7.2f}  hit {m['hit_rate']:.0%}{ratio}")
                if base is None or routing == "least_loaded":
                    continue
                note = (f"{n} engines, {args.clients} clients x {args.credits} at once, {load} load; model {args.model}, "
                        f"1 torch thread per engine; "
                        + (f"{args.groups} groups of {args.group}, {args.prompt_tokens}-token "
                           f"prompts, {args.new_tokens} new tokens" if load == "grpo" else
                           f"{args.mt_groups} x {args.mt_group} trajectories, {args.turns} "
                           f"turns, {args.obs_tokens}-token observations"))
                target = load == "grpo" and n == 2 and routing == "affinity"
                rows.append(row(f"prompt tokens prefilled, {load}, {n} engines ({routing})",
                                m["prefill_tokens"], base["prefill_tokens"], "tokens",
                                baseline_name="fewest in flight", higher_is_better=False,
                                target=0.3 if target else None, note=note))
                rows.append(row(f"samples/s, {load}, {n} engines ({routing})",
                                m["samples_per_s"], base["samples_per_s"], "samples/s",
                                baseline_name="fewest in flight", higher_is_better=True,
                                target=1.2 if target else None, note=note))
    shutil.rmtree(logs, ignore_errors=True)
    print("\n".join(lines))
    write(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
