"""A GRPO group in one request: `sampling_params.n` = G against G separate requests.

    python benchmarks/group_prefill.py [--group 8] [--prompt-tokens 1500] [--new-tokens 16]
        [--repeats 3] [--json PATH]

The built-in engine prefills an `n` > 1 request's prompt once and copies its KV into the n rows
(as SGLang shares it through its radix cache); G separate requests for the same prompt, sent at
once, prefill it G times. Both on one engine process (the tiny model, CPU), in the same run:
wall time of the whole group and the prompt tokens the engine prefilled (its /get_server_info
counter), the median of --repeats.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_proc import start_engine  # noqa: E402
from benchmarks.results import row, write  # noqa: E402


def post(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST" if data else "GET",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def prefilled(url: str) -> int:
    return int(post(url, "/get_server_info")["internal_states"][0]["prefill_tokens"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    proc, url = start_engine("--model", "tiny", "--seed", "0", python=sys.executable)
    prompt = [10 + i % 1900 for i in range(args.prompt_tokens)]
    params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
    group_s, separate_s, group_tokens, separate_tokens = [], [], 0, 0
    try:
        post(url, "/generate", {"input_ids": prompt[:8], "sampling_params": params})  # warm-up
        for _ in range(args.repeats):
            before, start = prefilled(url), time.perf_counter()
            outs = post(url, "/generate", {"input_ids": prompt,
                                           "sampling_params": {**params, "n": args.group}})
            group_s.append(time.perf_counter() - start)
            group_tokens = prefilled(url) - before
            assert len(outs) == args.group

            before, start = prefilled(url), time.perf_counter()
            with ThreadPoolExecutor(args.group) as pool:
                list(pool.map(lambda _: post(url, "/generate", {"input_ids": prompt,
                                                                "sampling_params": params}),
                              range(args.group)))
            separate_s.append(time.perf_counter() - start)
            separate_tokens = prefilled(url) - before
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    ours, base = statistics.median(group_s), statistics.median(separate_s)
    print(f"group of {args.group}, {args.prompt_tokens}-token prompt, {args.new_tokens} new "
          f"tokens each: n={args.group} in one request {ours:.2f} s ({group_tokens} prompt "
          f"tokens prefilled); {args.group} requests {base:.2f} s ({separate_tokens} prefilled)")
    write(args.json, [row(
        f"GRPO group of {args.group} in one request (n), wall time", ours, base, "s",
        baseline_name=f"{args.group} separate requests for the same prompt, sent at once",
        higher_is_better=False,
        note=f"tiny model on CPU, {args.prompt_tokens}-token prompt, {args.new_tokens} new "
             f"tokens each; prompt tokens prefilled {group_tokens} vs {separate_tokens}; median "
             f"of {args.repeats}")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
