"""Partial rollout (resume interrupted generations) vs abort-and-restart, with a sync every K s.

    .venv/bin/python benchmarks/partial_rollout.py [--samples 1024] [--concurrency 32]
        [--sync-every K | --sync-every-tails 1.5] [--sync-pause 0.1] [--median-len 48] [--sigma 1.0] [--max-len 400]
        [--modes resume,restart,in_place] [--engine-cpus ""] [--seed 0] [--json PATH]

One real `rollmesh engine` process (the built-in engine, the tiny model) serves both modes, one
after the other, driven by the same loop over its HTTP API (docs/sglang-api.md):

  * --samples requests (chat-templated prompts of configs/data/letters_train.jsonl), each with
    its own target length drawn from a lognormal (seeded; ignore_eos, temperature 1), at most
    --concurrency of them in flight;
  * every K seconds a weight sync is played (K = --sync-every, or by default --sync-every-tails
    times the time the longest sample takes to generate at full concurrency, measured on the
    engine first, so that the figure means the same on a slow and a fast machine): POST /pause_generation {"mode": "abort"}
    (the engine answers every in-flight /generate with its partial output, finish_reason abort,
    as rollmesh's pause does), a --sync-pause wait standing in for the broadcast, then
    POST /continue_generation; the interrupted samples go back to the front of the queue (the
    cancel queue) and are submitted again:
      resume   rollmesh's partial rollout: prompt + the tokens generated so far as the new
               prefix, max_new_tokens = what is still missing (nothing generated twice);
      restart  abort-and-restart (slime's fully-async mode): the partial output is thrown away
               and the sample is generated again from its prompt.
    and, in the same run, the in-place sync (`sync.pause_mode = "in_place"`):
      in_place POST /pause_generation {"mode": "in_place"}: the engine keeps every in-flight
               request and its KV through the sync and continues it afterwards; nothing is
               aborted, re-submitted or prefilled again.
    Each sync also bumps the engine's weight version (/update_weight_version, no abort), so the
    in-place requests that cross a sync report tokens of two versions
    (`output_token_weight_versions`).

Measured per mode: decode tokens spent per completed sample (every token the engine generated:
the sum of completion_tokens over all responses, aborted ones included, checked against the
engine's own generated_tokens counter), and the wall time until all --samples are complete. In
restart mode a sample longer than what the engine decodes in --sync-every seconds can never
finish (long-tail starvation); a mode that does not finish within --timeout is reported with
the samples it completed. Also per mode: useful tokens per second (the target lengths of the
completed samples over the wall time), decode tokens thrown away (restart's aborted outputs),
prompt tokens prefilled (the engine's counter: a resumed sample prefills its prompt and partial
again), the sync pause as the driver sees it (from /pause_generation until /continue_generation
answered: in the abort modes it includes waiting for every partial to come back), and how many
answers span two or more weight versions.
"""

from __future__ import annotations

import os
import sys

import argparse
import asyncio
import collections
import json
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.engine_proc import start_engine  # noqa: E402
from benchmarks.results import row, write  # noqa: E402
from rollmesh.models.loading import tiny_tokenizer  # noqa: E402

PYTHON = ROOT / ".venv" / "bin" / "python"


@dataclass
class Sample:
    index: int
    prompt: list[int]
    target: int
    partial: list[int] = field(default_factory=list)
    done: bool = False
    interrupted: int = 0


def make_samples(n: int, median: float, sigma: float, lo: int, hi: int,
                 seed: int) -> list[Sample]:
    tok = tiny_tokenizer()
    rows = [json.loads(line) for line in
            (ROOT / "configs/data/letters_train.jsonl").read_text().splitlines() if line]
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(median), sigma, size=n)), lo, hi).astype(int)
    out = []
    for i in range(n):
        ids = tok.apply_chat_template([{"role": "user", "content": rows[i % len(rows)]["prompt"]}],
                                      add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append(Sample(i, list(ids), int(lengths[i])))
    return out


async def _post(session: aiohttp.ClientSession, url: str, path: str, body: dict) -> dict:
    async with session.post(url + path, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{path}: HTTP {r.status}: {await r.text()}")
        return await r.json(content_type=None) if r.content_type == "application/json" else {}


async def engine_tokens(session: aiohttp.ClientSession, url: str) -> int:
    return (await engine_counters(session, url))["generated_tokens"]


async def engine_counters(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/get_server_info") as r:
        return (await r.json())["internal_states"][0]


async def drive(url: str, samples: list[Sample], mode: str, args: argparse.Namespace) -> dict:
    """Generate every sample to its target length with a sync every --sync-every seconds."""
    for s in samples:
        s.partial, s.done, s.interrupted = [], False, 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        counters = await engine_counters(session, url)
        before, prefill_before = counters["generated_tokens"], counters["prefill_tokens"]
        version = int(counters["weight_version"])
        queue = collections.deque(samples)
        inflight: dict[asyncio.Task, Sample] = {}
        decoded = done = syncs = discarded = spanning = 0
        pauses: list[float] = []
        seq = 0

        def submit(s: Sample) -> None:
            nonlocal seq
            seq += 1
            if mode == "resume":
                ids, budget = s.prompt + s.partial, s.target - len(s.partial)
            else:
                s.partial = []
                ids, budget = s.prompt, s.target
            body = {"input_ids": ids, "rid": f"{mode}-{s.index:05d}-{seq:07d}",
                    "sampling_params": {"max_new_tokens": budget, "temperature": 1.0,
                                        "ignore_eos": True}}
            inflight[asyncio.create_task(_post(session, url, "/generate", body))] = s

        def handle(task: asyncio.Task) -> None:
            nonlocal decoded, done, discarded, spanning
            s = inflight.pop(task)
            out = task.result()
            got = out["output_ids"]
            decoded += len(got)
            spanning += len(set(out["meta_info"].get("output_token_weight_versions") or [])) > 1
            if out["meta_info"]["finish_reason"]["type"] == "abort":
                s.interrupted += 1
                if mode == "resume":
                    s.partial += got
                else:
                    discarded += len(got)
                interrupted.append(s)
            else:
                assert len(s.partial) + len(got) == s.target if mode == "resume" else \
                    len(got) == s.target, (mode, s.index, len(s.partial), len(got), s.target)
                s.done = True
                done += 1

        start = time.perf_counter()
        next_sync = start + args.sync_every
        timed_out = False
        while done < len(samples):
            now = time.perf_counter()
            if now - start > args.timeout:
                timed_out = True
                break
            while queue and len(inflight) < args.concurrency:
                submit(queue.popleft())
            interrupted: list[Sample] = []
            finished, _ = await asyncio.wait(list(inflight), timeout=max(0.0, next_sync - now),
                                             return_when=asyncio.FIRST_COMPLETED)
            for t in finished:
                handle(t)
            if time.perf_counter() >= next_sync and done < len(samples):
                # a weight sync: pause (abort modes: abort in flight and wait for the partials;
                # in_place: keep them), "broadcast" (a new version), continue
                paused_at = time.perf_counter()
                await _post(session, url, "/pause_generation",
                            {"mode": "in_place" if mode == "in_place" else "abort"})
                if inflight and mode != "in_place":
                    finished, _ = await asyncio.wait(list(inflight))
                    for t in sorted(finished, key=lambda t: inflight[t].index):
                        handle(t)
                await asyncio.sleep(args.sync_pause)
                version += 1
                await _post(session, url, "/update_weight_version",
                            {"new_version": str(version), "abort_all_requests": False})
                await _post(session, url, "/continue_generation", {})
                pauses.append(time.perf_counter() - paused_at)
                syncs += 1
                next_sync = time.perf_counter() + args.sync_every
            queue.extendleft(reversed(interrupted))  # the cancel queue goes first
        wall = time.perf_counter() - start
        if inflight:
            await _post(session, url, "/abort_request", {"abort_all": True})
            for t in (await asyncio.wait(list(inflight)))[0]:
                handle(t)
        counters = await engine_counters(session, url)
        engine_count = counters["generated_tokens"] - before
    useful = sum(s.target for s in samples if s.done)
    return {"mode": mode, "completed": done, "wall_s": wall, "decoded": decoded,
            "engine_decoded": engine_count, "useful": useful, "syncs": syncs,
            "interruptions": sum(s.interrupted for s in samples), "timed_out": timed_out,
            "tokens_per_sample": decoded / max(done, 1), "useful_per_s": useful / wall,
            "discarded": discarded, "prefilled": counters["prefill_tokens"] - prefill_before,
            "pause_mean_s": float(np.mean(pauses)) if pauses else 0.0,
            "pause_max_s": max(pauses, default=0.0), "spanning": spanning}


async def decode_rate(url: str, samples: list[Sample], concurrency: int,
                      tokens: int = 64) -> float:
    """Tokens/s one sequence gets with `concurrency` running (after a warm-up)."""
    async def batch(n: int, tag: str) -> None:
        await asyncio.gather(*(_post(session, url, "/generate", {
            "input_ids": samples[i % len(samples)].prompt, "rid": f"{tag}-{i}",
            "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}})
            for i in range(concurrency)))

    async with aiohttp.ClientSession() as session:
        await batch(8, "warm")
        start = time.perf_counter()
        await batch(tokens, "probe")
        return tokens / (time.perf_counter() - start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--sync-every", type=float, default=None,
                   help="seconds between syncs (K); default: --sync-every-tails times the time "
                        "the longest sample takes at full concurrency (measured first)")
    p.add_argument("--sync-every-tails", type=float, default=1.5,
                   help="K in units of the longest sample's generation time (> 1: every sample "
                        "can finish in restart mode once it starts right after a sync)")
    p.add_argument("--sync-pause", type=float, default=0.1,
                   help="seconds the engine stays paused per sync (the broadcast)")
    p.add_argument("--median-len", type=float, default=48)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--max-len", type=int, default=400)
    p.add_argument("--modes", default="resume,restart,in_place")
    p.add_argument("--engine-cpus", default="", help="pin the engine ('' = unpinned)")
    p.add_argument("--threads", type=int, default=1, help="engine torch threads")
    p.add_argument("--timeout", type=float, default=120, help="seconds per mode, at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write result rows (benchmarks/results.py) here")
    args = p.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("resume", "restart", "in_place"):
            p.error(f"--modes: unknown mode {m!r}")
    samples = make_samples(args.samples, args.median_len, args.sigma, args.min_len,
                           args.max_len, args.seed)
    lengths = np.array([s.target for s in samples])
    print(f"partial rollout: {len(samples)} samples, concurrency {args.concurrency}, "
          f"built-in engine (tiny), {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f} (other processes on "
          f"the cores skew the wall times)")
    print(f"target lengths: lognormal median {args.median_len:g} sigma {args.sigma:g} clipped "
          f"[{args.min_len}, {args.max_len}]: mean {lengths.mean():.0f}, p90 "
          f"{np.percentile(lengths, 90):.0f}, max {lengths.max()}, total {lengths.sum()}")
    cpus = {int(c) for c in args.engine_cpus.split(",")} if args.engine_cpus.strip() else None
    proc, url = start_engine("--model", "tiny", "--max-running-requests", str(args.concurrency),
                             "--seed", str(args.seed), "--weight-version", "0",
                             "--threads", str(args.threads), python=str(PYTHON), cpus=cpus)
    results: dict[str, dict] = {}
    try:
        rate = asyncio.run(decode_rate(url, samples, args.concurrency))
        if args.sync_every is None:
            args.sync_every = args.sync_every_tails * int(lengths.max()) / rate
        print(f"engine: {rate:.0f} tokens/s per sequence with {args.concurrency} running; the "
              f"longest sample needs {lengths.max() / rate:.2f}s uninterrupted; sync every "
              f"{args.sync_every:.2f}s (paused {args.sync_pause:g}s each)", flush=True)
        for m in modes:
            r = asyncio.run(drive(url, samples, m, args))
            results[m] = r
            note = (f"  NOT FINISHED in {args.timeout:g}s: {r['completed']}/{len(samples)} "
                    "completed" if r["timed_out"] else "")
            print(f"  {m:8s} {r['tokens_per_sample']:8.1f} decode tokens/completed sample "
                  f"(useful {r['useful'] / max(r['completed'], 1):.1f}), {r['wall_s']:7.2f}s "
                  f"wall, {r['syncs']} syncs, {r['interruptions']} interruptions, "
                  f"{r['decoded']} tokens decoded (engine counted {r['engine_decoded']}){note}",
                  flush=True)
            print(f"  {'':8s} {r['useful_per_s']:8.0f} useful tokens/s, {r['discarded']} decode "
                  f"tokens thrown away, {r['prefilled']} prompt tokens prefilled, sync pause "
                  f"{r['pause_mean_s'] * 1000:.0f} ms mean / {r['pause_max_s'] * 1000:.0f} ms "
                  f"max, {r['spanning']} answers spanning 2+ weight versions", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    rows = []
    if "resume" in results and "restart" in results:
        a, b = results["resume"], results["restart"]
        print(f"\n{'':34s} {'resume':>10s} {'restart':>10s} {'ratio':>7s}")
        print(f"{'decode tokens / completed sample':34s} {a['tokens_per_sample']:10.1f} "
              f"{b['tokens_per_sample']:10.1f} "
              f"{a['tokens_per_sample'] / b['tokens_per_sample']:6.2f}x")
        print(f"{'wall time (s)':34s} {a['wall_s']:10.2f} {b['wall_s']:10.2f} "
              f"{a['wall_s'] / b['wall_s']:6.2f}x")
        note = (f"{args.samples} samples, lognormal lengths median {args.median_len:g} sigma "
                f"{args.sigma:g} max {args.max_len}, concurrency {args.concurrency}, sync every "
                f"{args.sync_every:.2f}s, built-in engine (tiny)")
        if b["timed_out"]:
            note += (f"; restart did not finish in {args.timeout:g}s ({b['completed']}/"
                     f"{args.samples} completed): its figures are lower bounds")
        rows.append(row("partial rollout: decode tokens per completed sample",
                        a["tokens_per_sample"], b["tokens_per_sample"], "tokens/sample",
                        baseline_name="abort-and-restart (slime fully-async)",
                        higher_is_better=False, note=note))
        rows.append(row(f"partial rollout: wall time for {args.samples} samples", a["wall_s"],
                        b["wall_s"], "s", baseline_name="abort-and-restart (slime fully-async)",
                        higher_is_better=False, note=note))
    if "in_place" in results and ("resume" in results or "restart" in results):
        rows += compare_in_place(results, args)
    write(args.json, rows)
    return 0


def compare_in_place(results: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    """The in-place sync against the abort modes, side by side; result rows against resume
    (rollmesh's abort mode: partial rollout)."""
    modes = [m for m in ("in_place", "resume", "restart") if m in results]
    figures = [("wall time (s)", "wall_s", "{:.2f}"),
               ("useful tokens / s", "useful_per_s", "{:.0f}"),
               ("decode tokens / completed sample", "tokens_per_sample", "{:.1f}"),
               ("decode tokens thrown away", "discarded", "{:d}"),
               ("prompt tokens prefilled", "prefilled", "{:d}"),
               ("sync pause mean (ms)", "pause_mean_s", "{:.0f}"),
               ("sync pause max (ms)", "pause_max_s", "{:.0f}"),
               ("interrupted requests", "interruptions", "{:d}"),
               ("answers spanning 2+ versions", "spanning", "{:d}"),
               ("syncs", "syncs", "{:d}")]
    print(f"\n{'in-place sync vs abort':34s}" + "".join(f" {m:>10s}" for m in modes))
    for label, key, fmt in figures:
        scale = 1000 if key.startswith("pause") else 1
        print(f"{label:34s}" + "".join(f" {fmt.format(results[m][key] * scale):>10s}"
                                       for m in modes))
    if "resume" not in results:
        return []
    a, b = results["in_place"], results["resume"]
    note = (f"{args.samples} samples, lognormal lengths median {args.median_len:g} sigma "
            f"{args.sigma:g} max {args.max_len}, concurrency {args.concurrency}, sync every "
            f"{args.sync_every:.2f}s (paused {args.sync_pause:g}s), built-in engine (tiny)")
    base = "abort + resume (partial rollout, sync.pause_mode = abort)"
    return [
        row("in-place sync: useful tokens per second", a["useful_per_s"], b["useful_per_s"],
            "tokens/s", baseline_name=base, higher_is_better=True, note=note),
        row("in-place sync: prompt tokens prefilled", a["prefilled"], b["prefilled"], "tokens",
            baseline_name=base, higher_is_better=False, note=note),
        row("in-place sync: sync pause (driver's view, mean)", a["pause_mean_s"],
            b["pause_mean_s"], "s", baseline_name=base, higher_is_better=False, note=note),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
