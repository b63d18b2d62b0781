"""Benchmark of the built-in engine: throughput on long-tail requests, and abort latency.

    python benchmarks/engine.py [--model tiny] [--requests 128] [--concurrency 64] [--seed 0]
                                [--threads 1] [--skip-hf-cb] [--json PATH]

1. The same request stream (GSM8K prompts in the chat template, lognormal max_new_tokens,
   ignore_eos, temperature 1) through
   a. `rollmesh engine` (a server process, over HTTP, all requests sent at once, at most
      --concurrency running),
   b. transformers `generate` on static batches of --concurrency requests in arrival order
      (a batch runs until its longest request is done),
   c. transformers' own continuous batching manager (`init_continuous_batching`, in-process),
   reporting useful tokens/s (the tokens the requests asked for) and the ratios.
2. The time from POST /abort_request to the aborted /generate's partial response, with the
   engine busy with --concurrency other requests, against the engine's mean decode-step time.
"""

from __future__ import annotations

import os
import sys

import argparse
import asyncio
import json
import signal
import statistics
import time
from pathlib import Path

import aiohttp
import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_proc import start_engine  # noqa: E402
from benchmarks.results import row, write  # noqa: E402
from rollmesh.models.loading import build_tiny, load_model  # noqa: E402

GSM8K = Path("/work/shared/data/gsm8k/test.jsonl")


def make_requests(tokenizer, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    if GSM8K.exists():
        questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[:n]]
    else:
        questions = [f"Question {i}: what is {i} + {i}?" for i in range(n)]
    lengths = np.clip(np.round(rng.lognormal(np.log(96), 0.9, size=n)), 8, 1024).astype(int)
    return [
        (tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True)["input_ids"], int(m))
        for q, m in zip(questions, lengths)
    ]


# ---- rollmesh engine over HTTP ----
async def _generate(session, url, ids, max_new, rid, **extra):
    body = {"input_ids": ids, "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0,
                                "ignore_eos": True, **extra}}
    async with session.post(url + "/generate", json=body) as resp:
        return await resp.json()


async def engine_throughput(url: str, requests) -> tuple[float, int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await _generate(session, url, requests[0][0], 4, "warmup-0000")
        start = time.perf_counter()
        outs = await asyncio.gather(*[_generate(session, url, ids, m, f"r-{i:06d}")
                                      for i, (ids, m) in enumerate(requests)])
        wall = time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert tokens == sum(m for _, m in requests)
    return wall, tokens


async def abort_latency(url: str, requests, concurrency: int, trials: int = 10):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def info():
            async with session.get(url + "/get_server_info") as r:
                return (await r.json())["internal_states"][0]

        background = [asyncio.create_task(_generate(session, url, ids, 3000, f"bg-{i:06d}"))
                      for i, (ids, _) in enumerate(requests[: concurrency - 1])]
        await asyncio.sleep(1.0)
        before, t_before = (await info())["decode_steps"], time.perf_counter()
        latencies, partial = [], []
        for k in range(trials):
            rid = f"target-{k:04d}"
            target = asyncio.create_task(_generate(session, url, requests[0][0], 3000, rid))
            await asyncio.sleep(0.5)
            t0 = time.perf_counter()
            async with session.post(url + "/abort_request", json={"rid": rid}) as r:
                assert r.status == 200
            out = await target
            latencies.append(time.perf_counter() - t0)
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            partial.append(out["meta_info"]["completion_tokens"])
        steps, elapsed = (await info())["decode_steps"] - before, time.perf_counter() - t_before
        async with session.post(url + "/abort_request", json={"abort_all": True}):
            pass
        await asyncio.gather(*background)
    return latencies, partial, elapsed / max(steps, 1)


# ---- transformers baselines ----
def hf_static(model, tokenizer, requests, batch_size: int, seed: int) -> tuple[float, int, int]:
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    useful = computed = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(m for _, m in batch)
        config = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad,
                                  eos_token_id=None)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert out.shape[1] == width + longest
        useful += sum(m for _, m in batch)
        computed += len(batch) * longest
    return time.perf_counter() - start, useful, computed


def hf_continuous(model, requests, concurrency: int) -> tuple[float, int] | str:
    """transformers' continuous batching manager; a string says why it could not run."""
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        config = GenerationConfig(max_new_tokens=1024, do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, eos_token_id=-1, pad_token_id=0)
        cb = ContinuousBatchingConfig(max_batch_tokens=concurrency * 8)
        manager = model.init_continuous_batching(generation_config=config,
                                                 continuous_batching_config=cb)
        manager.start()
        start = time.perf_counter()
        for i, (ids, m) in enumerate(requests):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=m)
        tokens, done = 0, 0
        while done < len(requests):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("no result in 60 s")
            if result.is_finished():
                done += 1
                tokens += len(result.generated_tokens)
        wall = time.perf_counter() - start
        manager.stop(block=True, timeout=10)
        return wall, tokens
    except Exception as e:  # report, do not hide: the figure is then missing, with the reason
        return f"{type(e).__name__}: {e}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads, the same for the engine and the baselines")
    p.add_argument("--skip-hf-cb", action="store_true")
    p.add_argument("--json", help="write result rows (benchmarks/results.py) here")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    if args.model.startswith("tiny"):
        model, tokenizer = build_tiny(args.model)
    else:
        model, tokenizer = load_model(args.model, torch.device("cpu"), torch.float32)
    requests = make_requests(tokenizer, args.requests, args.seed)
    lengths = [m for _, m in requests]
    print(f"model {args.model}, {len(requests)} requests, concurrency {args.concurrency}, "
          f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, load average "
          f"{os.getloadavg()[0]:.2f} (other processes on the cores skew every figure)")
    print(f"max_new_tokens: median {int(np.median(lengths))}, p90 "
          f"{int(np.percentile(lengths, 90))}, max {max(lengths)}, total {sum(lengths)}")

    proc, url = start_engine("--model", args.model, "--max-running-requests",
                             str(args.concurrency), "--seed", str(args.seed),
                             "--threads", str(args.threads), python=sys.executable)
    try:
        wall, tokens = asyncio.run(engine_throughput(url, requests))
        engine_tps = tokens / wall
        print(f"rollmesh engine (HTTP):     {tokens} tokens in {wall:6.2f} s = "
              f"{engine_tps:8.1f} tokens/s")
        lat, partial, step = asyncio.run(abort_latency(url, requests, args.concurrency))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

    wall, useful, computed = hf_static(model, tokenizer, requests, args.concurrency, args.seed)
    static_tps = useful / wall
    print(f"transformers static batches: {useful} tokens in {wall:6.2f} s = {static_tps:8.1f} "
          f"tokens/s ({computed} computed, {useful / computed:.0%} useful)")
    print(f"ratio engine / static:      {engine_tps / static_tps:.2f}x")
    note = (f"model {args.model}, {len(requests)} requests (lognormal max_new_tokens, ignore_eos), "
            f"concurrency {args.concurrency}, torch threads {args.threads}; useful tokens/s")
    rows = [row("engine throughput vs transformers static batches", engine_tps, static_tps,
                "tokens/s", baseline_name="transformers generate, static batches",
                higher_is_better=True, note=note)]
    if not args.skip_hf_cb:
        cb = hf_continuous(model, requests, args.concurrency)
        if isinstance(cb, str):
            print(f"transformers continuous batching: not measured ({cb})")
        else:
            print(f"transformers continuous batching: {cb[1]} tokens in {cb[0]:6.2f} s = "
                  f"{cb[1] / cb[0]:8.1f} tokens/s; engine / it: "
                  f"{engine_tps / (cb[1] / cb[0]):.2f}x")
            rows.append(row("engine throughput vs transformers continuous batching", engine_tps,
                            cb[1] / cb[0], "tokens/s",
                            baseline_name="transformers init_continuous_batching",
                            higher_is_better=True, note=note))
    print(f"abort -> partial response ({args.concurrency} running): median "
          f"{statistics.median(lat) * 1000:.1f} ms, max {max(lat) * 1000:.1f} ms over "
          f"{len(lat)} aborts (partials of {min(partial)}-{max(partial)} tokens); mean decode "
          f"step {step * 1000:.1f} ms")
    write(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
