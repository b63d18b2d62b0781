"""Benchmark of the weight sync: the bucketed broadcast against its floor, and the pause window.

    python benchmarks/weight_sync.py [--dtype bfloat16|float32] [--layers 24]
        [--buckets 16,64,256,1024] [--repeats 3] [--receivers 2] [--no-load] [--skip-pause]
        [--pause-trials 5] [--skip-broadcast] [--skip-handles] [--json PATH]

1. Broadcast, over gloo on this host, of a list of tensors shaped like Qwen2.5-0.5B's (vocab
   151936, hidden 896, intermediate 4864, 24 layers, 14 query / 2 key-value heads, tied
   embeddings: 494M parameters; bfloat16 by default, 0.99 GB) from a trainer-like process
   (rank 0) to --receivers engine-like processes, in one weight-update group built as the
   engines build it (`rollmesh.weight_sync.group.init_weight_update_group`):
     floor     one raw `torch.distributed.broadcast` of a single flat buffer of the same bytes,
               prepared beforehand (nothing else timed);
     flattened `rollmesh.weight_sync.buckets.BucketSender` (`send_buckets` below) for each
               bucket size of --buckets (MiB), pipelined as `weight_sync.sender` sends them: bucket
               i+1 is copied into one of two bucket buffers while bucket i is on the wire
               (`async_op=True`), a one-tensor bucket is sent as it is; receivers load as the
               built-in engine does (`receive_bucket_into`): the first run leaves each bucket's
               tensors as views of its receive buffer, later runs receive into them directly;
     tensor    one broadcast per tensor (the contract's form, what the built-in engine does);
               the bucket size only changes how many HTTP calls announce them, not the
               transport, so it is run once.
   Receivers "load" like an engine: flattened as above, per tensor each received tensor is
   copied into a preallocated model tensor (--no-load: received into a reused buffer and
   dropped). Each run ends with a barrier, so the time is until
   every receiver holds every tensor. Reported: median seconds over --repeats, GB/s of payload,
   and the ratio to the floor. `--json PATH` writes the rows of benchmarks/results.py.
   snapshot  what an overlapped sync (`sync.overlap`) costs the trainer instead: copying the
               same tensors into rank 0's snapshot (`rollmesh.weight_sync.buckets.Snapshot`, host
               memory, kept from sync to sync), beside the best flattened broadcast (what a
               blocking sync costs it, pause and verification left out).
2. By handle on one host (`sync.transport = "handles"`, the real path): rank 0 packs the same
   tensors into its shared-memory segment (`rollmesh.weight_sync.handles.Packed`, kept from sync
   to sync), POSTs /update_weights_from_tensor to a built-in engine process serving a random
   checkpoint of the same shapes (written to a temporary directory first), which maps the
   segment and copies every tensor into its model; the reply ends the clock. Beside it the
   memcpy floor: one `copy_` of the same bytes between two preallocated host buffers. On a GPU
   (`--device cuda`) the trainer's buffer is CUDA memory sent by IPC handle and the floor one
   device-to-device `copy_`. Both processes run one torch thread (--engine-threads).
3. The rollout pause window: the real rollout side (built-in engine with the tiny model,
   MessageQueue, rollouter, agent and reward workers, as tests/helpers/rollout_stack.py starts them)
   generating long responses; the time from Pause sent to Paused received (every in-flight
   generation aborted and back in the cancel queue), then Resume, --pause-trials times.
"""

from __future__ import annotations

import os
import sys

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results import row, write  # noqa: E402
from rollmesh.weight_sync.buckets import (  # noqa: E402
    BucketSender, Snapshot, WeightSpec, plan_buckets, receive_bucket, receive_bucket_into,
)
from rollmesh.weight_sync.group import (  # noqa: E402
    destroy_weight_update_group, init_weight_update_group,
)
from rollmesh.weight_sync.tensors import dtype_from_name  # noqa: E402
from rollmesh.weight_sync import handles  # noqa: E402

GROUP = "weight_update_group"


def qwen25_05b_specs(dtype: torch.dtype, layers: int = 24) -> list[WeightSpec]:
    vocab, hidden, inter, heads, kv_heads = 151936, 896, 4864, 14, 2
    head = hidden // heads
    specs = [WeightSpec("model.embed_tokens.weight", dtype, (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            WeightSpec(p + "self_attn.q_proj.weight", dtype, (heads * head, hidden)),
            WeightSpec(p + "self_attn.q_proj.bias", dtype, (heads * head,)),
            WeightSpec(p + "self_attn.k_proj.weight", dtype, (kv_heads * head, hidden)),
            WeightSpec(p + "self_attn.k_proj.bias", dtype, (kv_heads * head,)),
            WeightSpec(p + "self_attn.v_proj.weight", dtype, (kv_heads * head, hidden)),
            WeightSpec(p + "self_attn.v_proj.bias", dtype, (kv_heads * head,)),
            WeightSpec(p + "self_attn.o_proj.weight", dtype, (hidden, heads * head)),
            WeightSpec(p + "mlp.gate_proj.weight", dtype, (inter, hidden)),
            WeightSpec(p + "mlp.up_proj.weight", dtype, (inter, hidden)),
            WeightSpec(p + "mlp.down_proj.weight", dtype, (hidden, inter)),
            WeightSpec(p + "input_layernorm.weight", dtype, (hidden,)),
            WeightSpec(p + "post_attention_layernorm.weight", dtype, (hidden,)),
        ]
    specs.append(WeightSpec("model.norm.weight", dtype, (hidden,)))
    return specs


def experiments(args: argparse.Namespace) -> list[tuple[str, float]]:
    """(mode, bucket MiB) in the order every process runs them."""
    runs = [("floor", 0.0)]
    runs += [("flattened_bucket", float(b)) for b in args.buckets]
    runs.append(("tensor", 0.0))
    return runs


def send_buckets(sender: BucketSender, buckets: list[list[WeightSpec]], tensors: Any) -> int:
    """Rank 0: every bucket, pipelined (bucket i+1 packed while bucket i is on the wire), with
    no announcement in between (the receivers know them). `tensors`: every bucket's tensors in
    order."""
    it = iter(tensors)
    sent = 0
    for bucket in buckets:
        sent += sender.start(sender.pack(bucket, islice(it, len(bucket))))
    sender.wait()
    return sent


def barrier(group: dist.ProcessGroup) -> None:
    dist.all_reduce(torch.zeros(1), group=group)


# -- receiver -------------------------------------------------------------------------------------


def receiver(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dtype = dtype_from_name(args.dtype)
    specs = qwen25_05b_specs(dtype, args.layers)
    total = sum(s.nbytes for s in specs)
    model = {} if args.no_load else {s.name: torch.empty(s.shape, dtype=s.dtype) for s in specs}
    group = init_weight_update_group("127.0.0.1", args.port, args.rank, args.receivers + 1, GROUP,
                                     "gloo", 600)
    for mode, bucket_mb in experiments(args):
        # The floor's buffer exists (and is paged in) before the clock starts: pure transport.
        flat = torch.zeros(total, dtype=torch.uint8) if mode == "floor" else None
        # A receive buffer reused bucket after bucket, as the sender's (`buffer=`).
        reuse = (torch.zeros(min(total, int(bucket_mb * 2**20)), dtype=torch.uint8)
                 if mode == "flattened_bucket" and not model else None)
        for _ in range(args.repeats):
            barrier(group)
            if flat is not None:
                dist.broadcast(flat, src=0, group=group)
            else:
                size = int(bucket_mb * 2**20) if mode != "tensor" else total
                for bucket in plan_buckets(specs, size):
                    names = [s.name for s in bucket]
                    dtypes = [args.dtype] * len(bucket)
                    shapes = [list(s.shape) for s in bucket]
                    if model and mode == "flattened_bucket":  # what the built-in engine does
                        receive_bucket_into(group, model, names, dtypes, shapes, mode,
                                            scratch=reuse)
                        continue
                    got = receive_bucket(group, names, dtypes, shapes, mode, buffer=reuse)
                    for name, t in got:
                        if model:
                            model[name].copy_(t)
                    del got
            barrier(group)
        del flat, reuse
    destroy_weight_update_group(group)
    os._exit(0)  # skip gloo's teardown (it can abort at interpreter exit)


# -- sender ---------------------------------------------------------------------------------------


def sender(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)
    dtype = dtype_from_name(args.dtype)
    specs = qwen25_05b_specs(dtype, args.layers)
    total = sum(s.nbytes for s in specs)
    gen = torch.Generator().manual_seed(0)
    params = {s.name: torch.randn(s.shape, generator=gen).to(s.dtype) for s in specs}
    print(f"{len(specs)} tensors, {sum(t.numel() for t in params.values()) / 1e6:.1f}M parameters, "
          f"{total / 1e9:.3f} GB in {args.dtype}, {args.receivers} receivers over gloo", flush=True)
    from rollmesh.wire.transport import free_port

    port = free_port()
    cmd = [sys.executable, __file__, "--receiver-rank", "0", "--port", str(port),
           "--dtype", args.dtype, "--layers", str(args.layers), "--repeats", str(args.repeats),
           "--receivers", str(args.receivers),
           "--buckets", ",".join(str(b) for b in args.buckets)] + (["--no-load"] if args.no_load
                                                                    else [])
    procs = []
    for r in range(1, args.receivers + 1):
        cmd[3] = str(r)
        procs.append(subprocess.Popen(list(cmd), env={**os.environ, "OMP_NUM_THREADS": "1"}))
    group = init_weight_update_group("127.0.0.1", port, 0, args.receivers + 1, GROUP, "gloo", 600)
    results = []
    for mode, bucket_mb in experiments(args):
        flat = None
        if mode == "floor":
            flat = torch.empty(total, dtype=torch.uint8)
            offset = 0
            for s in specs:
                flat[offset:offset + s.nbytes] = params[s.name].reshape(-1).view(torch.uint8)
                offset += s.nbytes
        sender = None
        times, broadcasts = [], 0
        for _ in range(args.repeats):
            barrier(group)
            start = time.perf_counter()
            if flat is not None:
                dist.broadcast(flat, src=0, group=group)
                broadcasts = 1
            else:
                size = int(bucket_mb * 2**20) if mode != "tensor" else total
                buckets = plan_buckets(specs, size)
                # pipelined, as weight_sync.sender does it (its two buffers kept across syncs)
                sender = sender or BucketSender(group, mode, capacity=max(
                    (sum(s.nbytes for s in b) for b in buckets if len(b) > 1), default=0))
                send_buckets(sender, buckets, (params[s.name] for s in specs))
                broadcasts = len(buckets) if mode != "tensor" else len(specs)
            barrier(group)
            times.append(time.perf_counter() - start)
        del flat, sender
        seconds = statistics.median(times)
        results.append({"mode": mode, "bucket_mb": bucket_mb, "seconds": seconds,
                        "gb_per_s": total / seconds / 1e9, "broadcasts": broadcasts,
                        "times": times})
        floor = results[0]["seconds"]
        label = {"floor": "floor (1 flat buffer)", "tensor": "tensor (per tensor)"}.get(
            mode, f"flattened, {bucket_mb:g} MiB buckets")
        print(f"  {label:32s} {seconds:8.3f} s  {total / seconds / 1e9:6.2f} GB/s  "
              f"{broadcasts:4d} broadcasts  x{seconds / floor:5.2f} of floor  "
              f"(runs: {', '.join(f'{t:.3f}' for t in times)})", flush=True)
    destroy_weight_update_group(group)
    for p in procs:
        if p.wait(120) != 0:
            raise RuntimeError(f"receiver exited with {p.returncode}")
    snapshot, times = Snapshot(specs), []
    for _ in range(args.repeats):
        start = time.perf_counter()
        snapshot.fill(params[s.name] for s in specs)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    results.append({"mode": "snapshot", "bucket_mb": 0.0, "seconds": seconds,
                    "gb_per_s": total / seconds / 1e9, "broadcasts": 0, "times": times})
    best = min((r for r in results if r["mode"] == "flattened_bucket"),
               key=lambda r: r["seconds"], default=None)
    print(f"  {'snapshot copy (overlapped)':32s} {seconds:8.3f} s  {total / seconds / 1e9:6.2f} "
          f"GB/s  the trainer's wait at an overlapped sync"
          + (f", x{seconds / best['seconds']:.2f} of the best flattened broadcast (a blocking "
             f"sync's)" if best else "")
          + f"  (runs: {', '.join(f'{t:.3f}' for t in times)})", flush=True)
    return results


# -- by handle ------------------------------------------------------------------------------------


def qwen_checkpoint(path: Path, dtype: torch.dtype, layers: int) -> Path:
    """A random checkpoint of Qwen2.5-0.5B's shapes (tied embeddings) for the engine, with the
    tiny Qwen2.5 tokenizer (tests/helpers/hf_checkpoints.py)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.helpers.hf_checkpoints import build_tokenizer

    tok = build_tokenizer("qwen2.5")
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen2ForCausalLM._from_config(config, torch_dtype=dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def median_time(fn: Any, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def by_handle(args: argparse.Namespace) -> list[dict]:
    """The handles path into a real engine process, beside the memcpy (or d2d copy) floor."""
    from benchmarks.engine_proc import start_engine

    # one thread in this process and (--engine-threads) in the engine, as the broadcast's
    # processes: on a small host two multi-threaded processes would fight for the cores
    torch.set_num_threads(1)
    device = torch.device(args.device)
    dtype = dtype_from_name(args.dtype)
    specs = qwen25_05b_specs(dtype, args.layers)
    total = sum(s.nbytes for s in specs)
    gen = torch.Generator().manual_seed(1)
    params = {s.name: torch.randn(s.shape, generator=gen).to(s.dtype).to(device) for s in specs}
    src = torch.empty(total, dtype=torch.uint8, device=device).random_(generator=None)
    dst = torch.empty_like(src)

    def floor() -> None:
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    floor()  # pages (or the allocator) ready before the clock
    floor_s, floor_times = median_time(floor, args.repeats)
    results = [{"mode": "copy_floor", "seconds": floor_s, "times": floor_times}]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = qwen_checkpoint(Path(tmp) / "qwen", dtype, args.layers)
        proc, url = start_engine("--model", str(ckpt), "--dtype", args.dtype, "--device",
                                 args.device, "--weight-version", "0",
                                 "--threads", str(args.engine_threads), python=sys.executable,
                                 timeout_s=900)
        packed = handles.Packed(device)
        entries, size = handles.layout(specs)
        version = [0]
        pack_times: list[float] = []

        def sync() -> None:
            start = time.perf_counter()
            packed.ensure(size)
            packed.fill(entries, (params[s.name] for s in specs))
            pack_times.append(time.perf_counter() - start)
            table = (handles.encode_handles(entries, cuda=handles.cuda_handle(packed.flat))
                     if device.type == "cuda" else
                     handles.encode_handles(entries, segment=packed.name, segment_size=size))
            version[0] += 1
            reply = _post(url + "/update_weights_from_tensor", handles.tensor_body(
                [table], handles.LOAD_FORMAT, str(version[0]), False))
            if not reply.get("success"):
                raise RuntimeError(f"the engine refused the update: {reply}")

        try:
            sync()  # the first: the segment is created, the engine's pages are touched
            seconds, times = median_time(sync, args.repeats)
            got = _post(url + "/get_weights_by_name", {"name": "model.norm.weight",
                                                       "truncate_size": 1 << 30})
            want = params["model.norm.weight"].float().cpu()
            if not torch.equal(torch.tensor(got, dtype=torch.float32), want):
                raise RuntimeError("the engine does not hold the weights sent")
        finally:
            packed.close()
            proc.terminate()
            proc.wait(60)
    pack_s = statistics.median(pack_times[1:])
    results.append({"mode": "handles", "seconds": seconds, "times": times, "pack_s": pack_s})
    what = "d2d copy_" if device.type == "cuda" else "memcpy"
    print(f"  {what + ' floor (same bytes)':32s} {floor_s:8.3f} s  {total / floor_s / 1e9:6.2f} "
          f"GB/s  (runs: {', '.join(f'{t:.3f}' for t in floor_times)})", flush=True)
    print(f"  {'handles (pack + route + load)':32s} {seconds:8.3f} s  {total / seconds / 1e9:6.2f}"
          f" GB/s  x{seconds / floor_s:5.2f} of the floor; pack {pack_s:.3f} s, route and engine "
          f"load {seconds - pack_s:.3f} s  (runs: {', '.join(f'{t:.3f}' for t in times)})",
          flush=True)
    return results


def _post(url: str, body: Any) -> Any:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


# -- pause window ---------------------------------------------------------------------------------


async def pause_window(trials: int) -> list[dict]:
    from rollmesh.engine.client import EngineClient
    from rollmesh.wire.messages import Pause, Resume, WeightVersion
    from rollmesh.wire.transport import Transport
    from tests.helpers.rollout_stack import experiment, start_stack, stop_stack, write_dataset

    rows = [{"prompt": f"Tell a long story about the number {i}.", "label": str(i)}
            for i in range(64)]
    out = []
    with tempfile.TemporaryDirectory() as tmp, Transport() as t:
        tmp = Path(tmp)
        exp = experiment(write_dataset(tmp / "d.jsonl", rows), "rollout.max_new_tokens=320",
                         "rollout.max_concurrent=8", "rollout.batch_groups=4",
                         "staleness.max_staleness=4", "model.max_context=512")
        stack = await start_stack(t, tmp, exp)
        d = stack.driver
        try:
            async with EngineClient([stack.engine.url]) as engines:
                for i in range(trials):
                    await d.wait_for(lambda s: s["rollouter"]["running_groups"] > 0,
                                     what="generation running")
                    await asyncio.sleep(0.3)  # let generations get under way
                    running = stack.engine.stats()["running_requests"]
                    start = time.perf_counter()
                    paused = await d.rollouter.request(Pause(mode="abort"))
                    pause_s = time.perf_counter() - start
                    # what the synchronizer does after the broadcast: new version, resume
                    d.version += 1
                    await engines.update_weight_version(str(d.version))
                    await d.mq.request(WeightVersion(version=d.version))
                    start = time.perf_counter()
                    await d.rollouter.request(Resume(version=d.version))
                    resume_s = time.perf_counter() - start
                    out.append({"pause_s": pause_s, "resume_s": resume_s,
                                "interrupted": paused.cancel_queue, "engine_running": running})
                    print(f"  trial {i}: Pause -> Paused {pause_s * 1000:7.1f} ms with {running} "
                          f"generations running on the engine ({paused.cancel_queue} "
                          f"trajectories interrupted), Resume {resume_s * 1000:5.1f} ms",
                          flush=True)
        finally:
            await stop_stack(stack)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--buckets", default="16,64,256,1024",
                   type=lambda s: [float(x) for x in s.split(",")])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--no-load", action="store_true")
    p.add_argument("--skip-pause", action="store_true")
    p.add_argument("--skip-broadcast", action="store_true")
    p.add_argument("--skip-handles", action="store_true")
    p.add_argument("--engine-threads", type=int, default=1,
                   help="the handles section: torch threads of the engine process")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="the handles section: shared memory (cpu) or CUDA IPC (cuda)")
    p.add_argument("--pause-trials", type=int, default=5)
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write the comparison rows (benchmarks/results.py) there")
    p.add_argument("--receiver-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.receiver_rank is not None:
        args.rank = args.receiver_rank
        receiver(args)
        return 0
    results = []
    if not args.skip_broadcast:
        print("1. weight broadcast", flush=True)
        results = sender(args)
    by_hand = []
    if not args.skip_handles:
        print(f"2. by handle on one host ({args.device})", flush=True)
        by_hand = by_handle(args)
    pauses = []
    if not args.skip_pause:
        print("3. rollout pause window (tiny model, built-in engine, 8 groups x 2 generating)",
              flush=True)
        pauses = asyncio.run(pause_window(args.pause_trials))
        ps = [x["pause_s"] for x in pauses]
        print(f"  Pause -> Paused: median {statistics.median(ps) * 1000:.1f} ms, "
              f"max {max(ps) * 1000:.1f} ms", flush=True)
    print(json.dumps({"broadcast": results, "handles": by_hand, "pause": pauses}))
    write(args.json, rows(args, results, pauses, by_hand))
    return 0


def rows(args: argparse.Namespace, results: list[dict], pauses: list[dict],
         by_hand: list[dict]) -> list[dict]:
    out = []
    if by_hand:
        floor, sync = by_hand
        out.append(row(
            f"weight sync by handle ({args.device}) vs a copy of the same bytes",
            sync["seconds"], floor["seconds"], "s",
            baseline_name=("one device-to-device copy_" if args.device == "cuda"
                           else "one memcpy between preallocated host buffers"),
            higher_is_better=False, target=1.5,
            note=f"{args.layers} layers {args.dtype}, median of {args.repeats}; pack into "
                 f"{'CUDA IPC memory' if args.device == 'cuda' else 'shared memory'} "
                 f"({sync['pack_s']:.3f} s) + /update_weights_from_tensor + the engine "
                 "process's copy into its model"))
    if not results:
        return out
    floor = next(r for r in results if r["mode"] == "floor")
    flattened = [r for r in results if r["mode"] == "flattened_bucket"]
    snapshot = next((r for r in results if r["mode"] == "snapshot"), None)
    if flattened and snapshot:
        best = min(flattened, key=lambda r: r["seconds"])
        out.append(row(
            "weight sync, trainer's wait: overlapped (snapshot copy) vs blocking (broadcast)",
            snapshot["seconds"], best["seconds"], "s",
            baseline_name="the best flattened broadcast of the same bytes (a blocking sync)",
            higher_is_better=False,
            note=f"{args.layers} layers {args.dtype}, median of {args.repeats}; the snapshot is "
                 f"a copy into host memory kept between syncs; {args.receivers} receivers over "
                 "gloo for the broadcast; pause and verification (both modes) left out"))
    if flattened:
        best = min(flattened, key=lambda r: r["seconds"])
        out.append(row(
            "weight sync, flattened best bucket vs floor", best["seconds"], floor["seconds"],
            "s", baseline_name="floor: one raw broadcast of the same bytes, prepared beforehand",
            higher_is_better=False, target=1.3,
            note=f"{args.layers} layers {args.dtype}, {args.receivers} receivers over gloo on one "
                 f"host, median of {args.repeats}; best bucket {best['bucket_mb']:g} MiB "
                 f"({best['broadcasts']} broadcasts); receivers load into the model "
                 f"(steady state: the buckets land in the model's storage)"
                 + (" (--no-load)" if args.no_load else "")))
    if pauses:
        median_ms = statistics.median(p["pause_s"] for p in pauses) * 1000
        out.append(row(
            "rollout pause window", median_ms, floor["seconds"] * 1000, "ms",
            baseline_name="the floor broadcast time of the weights (what a sync costs anyway)",
            higher_is_better=False,
            note=f"median Pause -> Paused over {len(pauses)} trials (tiny model on the built-in "
                 "engine, generations running, every one aborted and queued); the baseline is "
                 "not a pause: it puts the pause beside the broadcast it precedes"))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
