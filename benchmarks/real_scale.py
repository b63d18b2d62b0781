"""Benchmark at a real model's size on CPU: Qwen2.5-0.5B's shape with random weights.

    python benchmarks/real_scale.py [--dir DIR] [--only load,train,sync,decode] [--ranks 1,2]
        [--seqs 4] [--tokens 256] [--requests 8] [--new-tokens 64] [--threads 2] [--json PATH]

What a user's first run on CPU meets, each figure beside a baseline measured in the same run:
    load    peak host memory (RSS high-water mark, `ru_maxrss`) per trainer rank of building the
            policy and the reference model with 2 ranks: shard-by-shard loading
            (`rollmesh.models.sharded`) vs every rank building the whole models, then sharding
            (the trainer's path before it);
    train   time and peak RSS per rank of one trainer step (`prepare`: old log-probs, then
            `update_policy`: forward, backward, AdamW), --seqs x --tokens, float32, for each
            rank count of --ranks, vs one plain step (transformers forward, token cross-entropy,
            backward, torch AdamW) on the same tokens in one process;
    sync    one weight sync trainer -> built-in engine over gloo on the real path
            (`rollmesh.training.weight_sender.WeightSender.broadcast`: gather, buckets, HTTP announcements, the
            engine loading each bucket), float32, vs one raw gloo broadcast of a flat buffer of
            the same bytes to another process (the floor);
    decode  built-in engine tokens/s for --requests greedy requests x --new-tokens (ignore_eos),
            all sent at once, vs transformers `generate` of the same batch (left-padded).
The checkpoint (config of Qwen2.5-0.5B: hidden 896, 24 layers, 14 heads, 2 kv heads,
intermediate 4864, vocab 151936, tied embeddings, rope_theta 1e6, max_position 32768; random
bfloat16 weights, 0.99 GB; the tiny tokenizer, whose ids all fall in the vocabulary) is written
once into --dir. Every measured process runs alone, one after the other; a part that would not
fit in the free memory is skipped with the reason printed.
"""

from __future__ import annotations

import os
import sys

import argparse
import asyncio
import json
import resource
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.engine_proc import start_engine, with_repo_on_path  # noqa: E402
from benchmarks.results import row, write  # noqa: E402

GIB = 2**30
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, use_sliding_window=False)


def peak_rss() -> int:
    """This process's RSS high-water mark, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def write_checkpoint(path: Path, shape: dict[str, Any] | None = None) -> Path:
    """Qwen2.5-0.5B's config (or the Qwen2 `shape` given) with random bfloat16 weights
    (N(0, 0.02); norms 1), once."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from rollmesh.models.loading import tiny_tokenizer

    if (path / "complete").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer()
    config = Qwen2Config(**(shape or QWEN25_05B), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                         dtype="bfloat16")
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Qwen2ForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(path)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "complete").write_text("")
    return path


def experiment(path: Path, *overrides: str) -> Any:
    from rollmesh.config import ExperimentConfig, apply_overrides, parse_config

    base = {"seed": 1, "model": {"path": str(path), "dtype": "float32", "max_context": 2048},
            "data": {"train_path": "unused.jsonl", "format": "jsonl", "group_size": 4},
            "rollout": {"max_new_tokens": 256, "batch_groups": 1, "temperature": 1.0},
            "algorithm": {"advantage": "grpo", "loss": "ppo", "old_logprobs": "recompute"},
            "trainer": {"lr": 1e-6, "warmup_steps": 0, "lr_schedule": "constant",
                        "total_steps": 10, "micro_batch_tokens": 1024, "mini_batches": 1,
                        "device": "cpu", "backend": "gloo"},
            "sync": {"backend": "gloo", "bucket_mb": 512.0, "load_format": "flattened_bucket"}}
    return parse_config(ExperimentConfig, apply_overrides(base, overrides, "real_scale"),
                        "real_scale")


def batch(seqs: int, tokens: int, vocab_used: int = 2000) -> Any:
    """One group of `seqs` sequences of `tokens` tokens (1/8 prompt), rewards 0 and 1."""
    import numpy as np

    from rollmesh.training.batching import from_groups
    from rollmesh.wire.messages import Group, Trajectory

    rng = np.random.default_rng(0)
    prompt_len = tokens // 8
    prompt = rng.integers(3, vocab_used, prompt_len)
    trajs = []
    for i in range(seqs):
        ids = np.concatenate([prompt, rng.integers(3, vocab_used, tokens - prompt_len)])
        mask = (np.arange(tokens) >= prompt_len).astype(np.uint8)
        trajs.append(Trajectory(
            sample_id=f"s-{i}", group_id="g", token_ids=ids.astype(np.int32),
            logprobs=(-5.0 * mask).astype(np.float32),
            versions=np.where(mask == 1, 0, -1).astype(np.int32), loss_mask=mask,
            prompt_len=prompt_len, index=i, status="finished", reward=float(i % 2),
            reward_status="ok"))
    return from_groups([Group(group_id="g", trajectories=trajs)])


# -- the measured processes ------------------------------------------------------------------------


def rank_process(args: argparse.Namespace) -> dict[str, Any]:
    """One trainer rank: build (load), or build and take one step (train)."""
    from rollmesh.training.ranks import close_ranks, init_ranks
    from rollmesh.training.state import build_state
    from rollmesh.training.step import prepare, update_policy

    torch.set_num_threads(args.threads)
    ranks = init_ranks(args.rendezvous, args.rank, args.world, "gloo")
    out: dict[str, Any] = {"rank": args.rank, "rss_start": peak_rss()}
    try:
        overrides = [f"trainer.ranks={args.world}"]
        if args.role == "load":
            overrides.append("algorithm.use_reference=true")
        start = time.perf_counter()
        state = build_state(experiment(Path(args.dir), *overrides), ranks,
                            whole=args.mode == "whole")
        out.update(build_s=time.perf_counter() - start, rss_built=peak_rss())
        if args.role == "train":
            data = batch(args.seqs, args.tokens)
            start = time.perf_counter()
            stats = update_policy(state, prepare(state, data))
            out.update(step_s=time.perf_counter() - start, loss=stats["loss"])
        out["rss_peak"] = peak_rss()
    finally:
        close_ranks(ranks)
    return out


def plain_step(args: argparse.Namespace) -> dict[str, Any]:
    """The baseline step: transformers forward, token cross-entropy, backward, AdamW."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    data = batch(args.seqs, args.tokens)
    mb = data.rows(list(range(data.size)))
    start = time.perf_counter()
    logits = model(input_ids=mb["tokens"], attention_mask=mb["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb["tokens"][:, 1:, None])
    mask = mb["mask"][:, 1:]
    loss = -(logp[..., 0] * mask).sum() / mask.sum()
    loss.backward()
    optimizer.step()
    return {"step_s": time.perf_counter() - start, "rss_peak": peak_rss()}


def floor_receiver(args: argparse.Namespace) -> None:
    from rollmesh.weight_sync.group import init_weight_update_group

    group = init_weight_update_group("127.0.0.1", args.port, 1, 2, "floor", "gloo", 600)
    flat = torch.zeros(args.bytes, dtype=torch.uint8)
    for _ in range(args.repeats):
        torch.distributed.all_reduce(torch.zeros(1), group=group)
        torch.distributed.broadcast(flat, src=0, group=group)
        torch.distributed.all_reduce(torch.zeros(1), group=group)
    os._exit(0)  # skip gloo's teardown


def run_ranks(args: argparse.Namespace, role: str, world: int, mode: str = "sharded",
              ) -> list[dict[str, Any]]:
    from rollmesh.wire.transport import free_port

    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--role", role, "--rank", str(r), "--world", str(world),
         "--rendezvous", rendezvous, "--mode", mode, "--dir", str(args.dir),
         "--seqs", str(args.seqs), "--tokens", str(args.tokens),
         "--threads", str(max(1, args.threads // world))],
        stdout=subprocess.PIPE, text=True, env=with_repo_on_path(REPO))
        for r in range(world)]
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{role} rank exited with {p.returncode}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def child(args: argparse.Namespace, role: str, **extra: Any) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--role", role, "--dir", str(args.dir),
           "--seqs", str(args.seqs), "--tokens", str(args.tokens), "--threads", str(args.threads)]
    for key, value in extra.items():
        cmd += [f"--{key}", str(value)]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True,
                         env=with_repo_on_path(REPO)).stdout
    return json.loads(out.strip().splitlines()[-1])


# -- the parts -------------------------------------------------------------------------------------


def part_load(args: argparse.Namespace) -> list[dict]:
    print("load: policy + reference model, 2 ranks, float32 master weights", flush=True)
    runs = {}
    for mode in ("whole", "sharded"):
        outs = run_ranks(args, "load", 2, mode)
        runs[mode] = outs
        for o in outs:
            print(f"  {mode:8s} rank {o['rank']}: peak RSS {o['rss_peak'] / GIB:5.2f} GiB "
                  f"(at start {o['rss_start'] / GIB:4.2f}), build {o['build_s']:5.1f} s",
                  flush=True)
    sharded = max(o["rss_peak"] for o in runs["sharded"]) / GIB
    whole = max(o["rss_peak"] for o in runs["whole"]) / GIB
    note = ("Qwen2.5-0.5B shape, random bf16 checkpoint, policy + reference in float32, 2 ranks "
            "(FSDP2 over gloo), the larger rank's ru_maxrss; "
            "the sharded figure includes the checkpoint pages the rank read (mmap: shared, "
            "reclaimable page cache, about half of the 0.99 GB file); "
            f"build {max(o['build_s'] for o in runs['sharded']):.1f} s sharded vs "
            f"{max(o['build_s'] for o in runs['whole']):.1f} s whole; each process starts at "
            f"{runs['sharded'][0]['rss_start'] / GIB:.2f} GiB (python, torch, transformers)")
    return [row("trainer load: peak host memory per rank, 2 ranks", sharded, whole, "GiB",
                baseline_name="every rank builds the whole models, then shards (before)",
                higher_is_better=False, note=note)]


def part_train(args: argparse.Namespace) -> list[dict]:
    tokens = args.seqs * args.tokens
    print(f"train: one step on {args.seqs} x {args.tokens} tokens, float32, AdamW", flush=True)
    need = 12 * GIB
    if available() < need:
        print(f"  skipped: {available() / GIB:.1f} GiB available, the baseline needs ~12")
        return []
    base = child(args, "plain")
    print(f"  plain step (1 process): {base['step_s']:6.1f} s, peak RSS "
          f"{base['rss_peak'] / GIB:5.2f} GiB", flush=True)
    rows = []
    for world in args.ranks:
        need = (13 if world == 1 else 8 * world) * GIB
        if available() < need:
            print(f"  {world} ranks skipped: {available() / GIB:.1f} GiB available, "
                  f"~{need / GIB:.0f} needed", flush=True)
            continue
        outs = run_ranks(args, "train", world)
        step = max(o["step_s"] for o in outs)
        rss = max(o["rss_peak"] for o in outs) / GIB
        for o in outs:
            print(f"  {world} rank(s), rank {o['rank']}: step {o['step_s']:6.1f} s, peak RSS "
                  f"{o['rss_peak'] / GIB:5.2f} GiB, loss {o['loss']:.4f}", flush=True)
        note = (f"{args.seqs} x {args.tokens} tokens, float32, micro_batch_tokens 1024, "
                f"{args.threads} torch threads in all; the rollmesh step also recomputes the old "
                "log-probs (a forward pass the plain step has not)")
        rows.append(row(f"trainer step time, {world} rank(s)", step, base["step_s"], "s",
                        baseline_name="plain transformers step + torch AdamW, 1 process",
                        higher_is_better=False, note=note))
        rows.append(row(f"trainer step tokens/s, {world} rank(s)", tokens / step,
                        tokens / base["step_s"], "tokens/s",
                        baseline_name="plain transformers step + torch AdamW, 1 process",
                        higher_is_better=True, note=note))
        rows.append(row(f"trainer step peak host memory per rank, {world} rank(s)", rss,
                        base["rss_peak"] / GIB, "GiB",
                        baseline_name="plain transformers step + torch AdamW, 1 process",
                        higher_is_better=False, note=note))
    return rows


def engine_rss(proc: subprocess.Popen) -> int:
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


async def sync_three(args: argparse.Namespace, url: str) -> tuple[dict[str, float], int, int]:
    """Syncs of versions 1 (it also builds the weight-update group) and 2 in flattened buckets,
    3 one broadcast per tensor (the config's default): {what: seconds}, bytes, peak RSS."""
    import dataclasses

    from rollmesh.training.state import build_state
    from rollmesh.training.weight_sender import WeightSender
    from rollmesh.wire.transport import Transport

    exp = experiment(args.dir)
    state = build_state(exp)
    times = {}
    with Transport() as t:
        publisher = WeightSender(t, {"engines": [url], "synchronizer": "tcp://127.0.0.1:9"},
                              exp.sync, torch.device("cpu"))
        await publisher.open()
        try:
            for version, what in ((1, "first"), (2, "flattened_bucket"), (3, "tensor")):
                publisher.sync = dataclasses.replace(
                    exp.sync, load_format="tensor" if what == "tensor" else "flattened_bucket")
                start = time.perf_counter()
                sent = await publisher.broadcast(state.model, state.compute_dtype, version)
                times[what] = time.perf_counter() - start
        finally:
            await publisher.close()
    return times, sent, peak_rss()


def floor_broadcast(args: argparse.Namespace, nbytes: int, repeats: int = 2) -> float:
    from rollmesh.wire.transport import free_port
    from rollmesh.weight_sync.group import init_weight_update_group

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--role", "floor", "--port", str(port),
                             "--bytes", str(nbytes), "--repeats", str(repeats)],
                            env=with_repo_on_path(REPO))
    group = init_weight_update_group("127.0.0.1", port, 0, 2, "floor", "gloo", 600)
    flat = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        torch.distributed.all_reduce(torch.zeros(1), group=group)
        start = time.perf_counter()
        torch.distributed.broadcast(flat, src=0, group=group)
        torch.distributed.all_reduce(torch.zeros(1), group=group)
        times.append(time.perf_counter() - start)
    proc.wait(120)
    torch.distributed.destroy_process_group(group)
    return statistics.median(times)


async def generate_all(url: str, prompts: list[list[int]], new_tokens: int) -> float:
    import aiohttp

    async def one(session: Any, ids: list[int], rid: str) -> int:
        body = {"input_ids": ids, "rid": rid, "sampling_params": {
            "max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
        async with session.post(url + "/generate", json=body) as resp:
            return (await resp.json())["meta_info"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await one(session, prompts[0], "warmup")
        start = time.perf_counter()
        got = await asyncio.gather(*[one(session, p, f"r{i}") for i, p in enumerate(prompts)])
        wall = time.perf_counter() - start
    assert sum(got) == new_tokens * len(prompts), got
    return wall


def prompts(n: int) -> list[list[int]]:
    from rollmesh.models.loading import tiny_tokenizer

    tok = tiny_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": f"What is {i} times {i + 7}?"}],
                                    add_generation_prompt=True, tokenize=True)["input_ids"]
            for i in range(n)]


def part_sync_decode(args: argparse.Namespace, parts: set[str]) -> list[dict]:
    rows = []
    if available() < 8 * GIB:
        print(f"sync/decode skipped: {available() / GIB:.1f} GiB available, ~8 needed")
        return rows
    nbytes = 0
    if "sync" in parts:
        from rollmesh.training.weight_sender import weight_specs
        from rollmesh.models.sharded import empty_causal_lm

        nbytes = sum(s.nbytes for s in weight_specs(empty_causal_lm(args.dir, torch.float32),
                                                    torch.float32))
        floor = floor_broadcast(args, nbytes)
        print(f"sync floor: one raw gloo broadcast of {nbytes / 1e9:.2f} GB: {floor:.2f} s",
              flush=True)
    proc, url = start_engine("--model", str(args.dir), "--dtype", "float32", "--threads",
                             str(args.threads), python=sys.executable, timeout_s=600)
    try:
        if "sync" in parts:
            times, sent, rss = asyncio.run(sync_three(args, url))
            print(f"sync: first {times['first']:.2f} s (builds the group), then flattened "
                  f"buckets {times['flattened_bucket']:.2f} s, per tensor {times['tensor']:.2f} s,"
                  f" {sent / 1e9:.2f} GB; trainer peak RSS {rss / GIB:.2f} GiB, engine "
                  f"{engine_rss(proc) / GIB:.2f} GiB", flush=True)
            for what in ("flattened_bucket", "tensor"):
                note = (f"Qwen2.5-0.5B shape, float32 ({sent / 1e9:.2f} GB), 1 engine process, "
                        f"load_format {what}, 512 MiB buckets, gloo on one host; a sync after "
                        f"the first (which also builds the group: {times['first']:.2f} s); peak "
                        f"RSS trainer {rss / GIB:.2f} GiB (1 rank, no optimizer state), engine "
                        f"{engine_rss(proc) / GIB:.2f} GiB")
                rows.append(row(f"weight sync trainer -> built-in engine, 0.5B float32, {what}",
                                times[what], floor, "s",
                                baseline_name="one raw gloo broadcast of the same bytes as one "
                                "flat buffer, to one process", higher_is_better=False, note=note))
        if "decode" in parts:
            batch_prompts = prompts(args.requests)
            wall = asyncio.run(generate_all(url, batch_prompts, args.new_tokens))
            engine_tps = args.requests * args.new_tokens / wall
            print(f"decode: engine {engine_tps:.1f} tokens/s ({args.requests} x "
                  f"{args.new_tokens} in {wall:.1f} s), engine peak RSS "
                  f"{engine_rss(proc) / GIB:.2f} GiB", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    if "decode" in parts:
        hf = child(args, "generate", requests=args.requests, **{"new-tokens": args.new_tokens})
        hf_tps = args.requests * args.new_tokens / hf["seconds"]
        print(f"decode: transformers generate {hf_tps:.1f} tokens/s, peak RSS "
              f"{hf['rss_peak'] / GIB:.2f} GiB", flush=True)
        rows.append(row("engine decode tokens/s, 0.5B float32", engine_tps, hf_tps, "tokens/s",
                        baseline_name="transformers generate, the same batch",
                        higher_is_better=True,
                        note=f"{args.requests} requests x {args.new_tokens} new tokens, greedy, "
                             f"ignore_eos, all at once; {args.threads} torch threads each"))
    return rows


def hf_generate(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    batch_prompts = prompts(args.requests)
    pad = model.config.pad_token_id
    width = max(len(p) for p in batch_prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts])
    config = GenerationConfig(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False, pad_token_id=pad, eos_token_id=None)
    warm = GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=pad, eos_token_id=None)
    model.generate(input_ids=ids[:1, -4:], generation_config=warm)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    seconds = time.perf_counter() - start
    assert out.shape[1] == width + args.new_tokens
    return {"seconds": seconds, "rss_peak": peak_rss()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=Path("/tmp/rollmesh-qwen25-05b-random"))
    p.add_argument("--only", default="load,train,sync,decode",
                   type=lambda s: set(s.split(",")))
    p.add_argument("--ranks", default=[1, 2], type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads in all per part")
    p.add_argument("--json", default=None, metavar="PATH")
    for hidden in ("role", "rendezvous", "mode"):
        p.add_argument(f"--{hidden}", default=None, help=argparse.SUPPRESS)
    for hidden in ("rank", "world", "port", "bytes", "repeats"):
        p.add_argument(f"--{hidden}", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    roles = {"load": rank_process, "train": rank_process, "plain": plain_step,
             "generate": hf_generate}
    if args.role == "floor":
        floor_receiver(args)
        return 0
    if args.role in roles:
        print(json.dumps(roles[args.role](args)), flush=True)
        return 0
    unknown = args.only - {"load", "train", "sync", "decode"}
    if unknown:
        p.error(f"--only: unknown parts {sorted(unknown)} (expected load, train, sync, decode)")
    started = time.time()
    write_checkpoint(args.dir)
    print(f"checkpoint {args.dir} ({(args.dir / 'model.safetensors').stat().st_size / 1e9:.2f} "
          f"GB); cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, "
          f"{available() / GIB:.1f} GiB available", flush=True)
    rows = []
    parts = [(part_load, {"load"}), (part_train, {"train"}),
             (lambda a: part_sync_decode(a, a.only), {"sync", "decode"})]
    for part, names in parts:
        if args.only & names:
            since = os.getloadavg()[0]
            rows += loaded(part(args), since)
    print(f"done in {(time.time() - started) / 60:.1f} min, load average "
          f"{os.getloadavg()[0]:.2f}")
    write(args.json, rows)
    return 0


def loaded(rows: list[dict], since: float) -> list[dict]:
    """Each row's note says the 1-minute load average at its part's start and end."""
    now = os.getloadavg()[0]
    for r in rows:
        r["note"] += f"; load average {since:.1f} -> {now:.1f} (2 cores, shared machine)"
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
