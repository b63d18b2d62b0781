"""The GRPO group prefilled once: prefill time per group and engine tokens/s, with and without.

    python benchmarks/group_prefill.py [--model tiny] [--groups 16] [--group 8]
        [--prompt-tokens 200-500] [--new-tokens 64] [--concurrency 64] [--stagger-ms 2]
        [--threads 1] [--seed 0] [--repeats 3] [--json PATH]

A GRPO-shaped load on one built-in engine process per mode, all in the same run: --groups
prompts (random token ids, lengths uniform in --prompt-tokens), each sampled --group times
(temperature 1, ignore_eos; a group's samples get the same max_new_tokens, lognormal around
--new-tokens across groups), every request sent at once, a group's samples --stagger-ms apart
as agent workers send them. Three modes:

  off     `--disable-radix-cache`: every request prefills its prompt itself (the baseline)
  cache   the default engine, separate requests per sample (what rollmesh's rollout sends):
          requests admitted together share one prefill row, later ones find the prompt in the
          prefix cache and prefill its last token only
  n       the default engine, one request per group with `sampling_params.n` = group size

Reported from the engine's own counters (/get_server_info): prefill seconds per group (model
forwards over prompts, the KV copies and the cache's bookkeeping included), prompt tokens
prefilled, and output tokens/s over the whole load (wall time). `off` and `cache` use the same
per-request sampling seeds: the script also counts the samples whose tokens are identical.
The modes run in turn, --repeats times over (a fresh engine each time); the figures are the
medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_proc import start_engine  # noqa: E402
from benchmarks.results import row, write  # noqa: E402

MODES = {"off": ["--disable-radix-cache"], "cache": [], "n": []}


def make_load(groups: int, lo: int, hi: int, new_tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 2000, size=int(rng.integers(lo, hi + 1))).tolist()
               for _ in range(groups)]
    lengths = np.clip(np.round(rng.lognormal(np.log(new_tokens), 0.6, size=groups)), 8,
                      8 * new_tokens).astype(int).tolist()
    return prompts, lengths


async def _post(session, url, body):
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def run_load(url: str, mode: str, prompts, lengths, group: int, stagger: float):
    async def one(g: int, k: int):
        await asyncio.sleep(k * stagger)
        sp = {"max_new_tokens": lengths[g], "temperature": 1.0, "ignore_eos": True}
        if mode == "n":
            out = await _post(session, url, {"input_ids": prompts[g], "rid": f"g{g:05d}",
                                             "sampling_params": {**sp, "n": group}})
            return [o["output_ids"] for o in out]
        out = await _post(session, url, {"input_ids": prompts[g], "rid": f"g{g:05d}-{k:03d}",
                                         "sampling_params": {**sp,
                                                             "sampling_seed": g * group + k}})
        return [out["output_ids"]]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(url + "/get_server_info") as r:
            before = (await r.json())["internal_states"][0]
        start = time.perf_counter()
        ks = [0] if mode == "n" else range(group)
        outs = await asyncio.gather(*[one(g, k) for g in range(len(prompts)) for k in ks])
        wall = time.perf_counter() - start
        async with session.get(url + "/get_server_info") as r:
            after = (await r.json())["internal_states"][0]
    delta = {k: after[k] - before[k] for k in ("prefill_seconds", "prefill_tokens",
                                              "prefill_forwards", "generated_tokens",
                                              "prompt_tokens", "cached_prompt_tokens")}
    return wall, delta, [o for out in outs for o in out]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-tokens", default="200-500", help="LO-HI")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--stagger-ms", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="off,cache,n")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    lo, hi = (int(x) for x in args.prompt_tokens.split("-"))
    prompts, lengths = make_load(args.groups, lo, hi, args.new_tokens, args.seed)
    modes = args.modes.split(",")
    print(f"model {args.model}, {args.groups} groups of {args.group}, prompts {lo}-{hi} tokens "
          f"(mean {np.mean([len(x) for x in prompts]):.0f}), max_new_tokens per group median "
          f"{int(np.median(lengths))}, concurrency {args.concurrency}, torch threads "
          f"{args.threads}, cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
    runs: dict[str, list] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode in modes:
            proc, url = start_engine("--model", args.model, "--max-running-requests",
                                     str(args.concurrency), "--seed", str(args.seed),
                                     "--threads", str(args.threads), *MODES[mode],
                                     python=sys.executable)
            try:
                # warm-up: a prompt no group has, so nothing of the load is cached by it
                asyncio.run(run_load(url, "cache", [[1, 2, 3, 4]], [4], 1, 0.0))
                runs[mode].append(asyncio.run(run_load(url, mode, prompts, lengths, args.group,
                                                       args.stagger_ms / 1000)))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    results = {}
    for mode, done in runs.items():  # the median run by wall time, its figures
        median_prefill = statistics.median(d["prefill_seconds"] for _, d, _ in done)
        wall, d, outputs = sorted(done, key=lambda r: r[0])[len(done) // 2]
        results[mode] = (wall, {**d, "prefill_seconds": median_prefill}, outputs)
    print(f"{'mode':6} {'wall s':>8} {'tokens/s':>9} {'prefill s/group':>16} "
          f"{'prompt tokens prefilled':>24} {'forwards':>9} {'cache hit':>9}")
    for mode, (wall, d, _) in results.items():
        print(f"{mode:6} {wall:8.2f} {d['generated_tokens'] / wall:9.1f} "
              f"{d['prefill_seconds'] / args.groups * 1000:13.1f} ms "
              f"{d['prefill_tokens']:24,} {d['prefill_forwards']:9} "
              f"{d['cached_prompt_tokens'] / max(d['prompt_tokens'], 1):9.0%}")
    if "off" in results and "cache" in results:
        same = sum(a == b for a, b in zip(results["off"][2], results["cache"][2], strict=True))
        print(f"cache vs off, same seeds: {same} of {len(results['off'][2])} samples identical")
    rows = []
    base = results.get("off")
    note = (f"model {args.model}, {args.groups} groups of {args.group}, prompts {lo}-{hi} "
            f"tokens, ~{args.new_tokens} new tokens, concurrency {args.concurrency}, torch "
            f"threads {args.threads}; one engine process per mode, same run")
    for mode in ("cache", "n"):
        if base is None or mode not in results:
            continue
        wall, d, _ = results[mode]
        label = "separate requests, prefix cache" if mode == "cache" else "one request with n"
        rows.append(row(f"GRPO group prefill time per group ({label})",
                        d["prefill_seconds"] / args.groups,
                        base[1]["prefill_seconds"] / args.groups, "s",
                        baseline_name="--disable-radix-cache (every sample prefills its prompt)",
                        higher_is_better=False, note=note))
        rows.append(row(f"engine tokens/s on a GRPO load ({label})",
                        d["generated_tokens"] / wall, base[1]["generated_tokens"] / base[0],
                        "tokens/s", baseline_name="--disable-radix-cache",
                        higher_is_better=True, note=note))
    for r in rows:
        print(f"{r['figure']}: {r['rollmesh']:.4g} vs {r['baseline']:.4g} {r['unit']} "
              f"= {r['ratio']:.2f}x")
    write(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
