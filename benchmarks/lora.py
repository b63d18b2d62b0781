"""LoRA beside full weights: bytes and seconds per sync, trainer step time and peak memory.

    python benchmarks/lora.py [--shape 0.5b|small] [--rank 16] [--device cpu|cuda]
        [--steps 3] [--seqs 8] [--prompt 64] [--response 192] [--repeats 3]
        [--checkpointing] [--skip-train] [--skip-sync] [--json PATH]

Both on Qwen2.5-0.5B's shape by default (random weights, `benchmarks/real_scale.py`'s
checkpoint; `--shape small` for a quick look), LoRA at `--rank` on every attention and MLP
projection (`model.lora`'s default targets, alpha = 2 * rank).

1. Sync (the real paths, into a real built-in engine process on this host, one torch thread
   each side): the full weights in the engines' dtype by the weight-update group's broadcast
   (gloo, flattened buckets of 512 MiB) and by handle (`sync.transport = "handles"`: shared
   memory), against LoRA's sync (`WeightSender.send_adapter`: the adapters gathered, written
   in peft's format, /unload_lora_adapter + /load_lora_adapter + /update_weight_version into an
   engine started with `--enable-lora`, which merges them into its weights). The clock runs
   from the call to the engines' last reply; median of --repeats after one warm-up each.
   Goals (issue 32): LoRA's bytes <= 3% of the full sync's, its seconds <= 0.1x.
2. Trainer step (each variant in its own process, the same batch: --seqs sequences of
   --prompt + --response tokens, GRPO groups of 4; `trainer.update_policy`, one optimizer step
   per trainer step): median seconds over --steps after a first step, and the peak memory of
   the process (CPU: VmHWM, the whole process's high-water mark, model loading included;
   CUDA: max_memory_allocated). Goal: LoRA's peak <= 0.6x full fine-tuning's. The activations
   are the same in both variants (LoRA saves the gradients and AdamW's state of the frozen
   weights), so the ratio depends on the batch; `--checkpointing` keeps them small in both.

`--json PATH` writes the rows of benchmarks/results.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
             use_sliding_window=False)


def checkpoint(shape: str, root: Path) -> Path:
    from benchmarks.real_scale import QWEN25_05B, write_checkpoint

    return write_checkpoint(root / f"lora-bench-{shape}",
                            dict(QWEN25_05B) if shape == "0.5b" else dict(SMALL))


def experiment(path: Path, device: str, rank: int, max_len: int,
               checkpointing: bool = False) -> Any:
    from benchmarks.train_step import experiment as base

    overrides = ["trainer.lr=1e-4", "trainer.micro_batch_tokens=4096"]
    if checkpointing:
        overrides.append("trainer.gradient_checkpointing=true")
    if rank:
        overrides.append(f"model.lora.rank={rank}")
    return base(path, device, 4, max_len, 256, overrides)


# -- 2. the trainer step (a child process per variant) ---------------------------------------------


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def train_child(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.train_step import make_batch
    from rollmesh.training.state import build_state
    from rollmesh.training.step import prepare, update_policy

    torch.manual_seed(0)
    path = checkpoint(args.shape, Path(args.root))
    exp = experiment(path, args.device, args.rank, args.prompt + args.response,
                     args.checkpointing)
    state = build_state(exp, device=torch.device(args.device))
    vocab = state.model.config.vocab_size
    batch = make_batch([(args.prompt, args.response)] * args.seqs, 4, vocab)
    trainable = sum(p.numel() for p in state.model.parameters() if p.requires_grad)
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        update_policy(state, prepare(state, batch))
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"variant": "lora" if args.rank else "full", "rank": args.rank,
            "step_s": statistics.median(times[1:]), "times": times,
            "peak_bytes": peak_bytes(args.device), "trainable": trainable}


def train(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for rank in (0, args.rank):
        cmd = [sys.executable, __file__, "--child", "--shape", args.shape, "--rank", str(rank),
               "--device", args.device, "--steps", str(args.steps), "--seqs", str(args.seqs),
               "--prompt", str(args.prompt), "--response", str(args.response),
               "--root", args.root] + ["--checkpointing"] * args.checkpointing
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        out.append(row)
        print(f"  step {row['variant']:5s} (trainable {row['trainable'] / 1e6:8.2f} M): "
              f"{row['step_s']:7.2f} s  peak {row['peak_bytes'] / 2**30:6.2f} GiB  "
              f"(steps: {', '.join(f'{t:.2f}' for t in row['times'])})", flush=True)
    full, lora = out
    print(f"  LoRA/full: step time x{lora['step_s'] / full['step_s']:.2f}, peak memory "
          f"x{lora['peak_bytes'] / full['peak_bytes']:.2f} (goal <= 0.6)", flush=True)
    return out


# -- 1. the sync -----------------------------------------------------------------------------------


async def _time(fn: Any, repeats: int) -> tuple[float, list[float], int]:
    sent = await fn()  # warm-up: segment or group built, pages touched
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sent = await fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, sent


async def _time_then_stop(fn: Any, repeats: int, sender: Any,
                          proc: subprocess.Popen) -> tuple[float, list[float], int]:
    """`_time(fn)`, then the sender closed and the engine process stopped, whatever failed."""
    try:
        return await _time(fn, repeats)
    finally:
        await sender.close()
        proc.terminate()
        proc.wait(60)


async def sync(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.engine_proc import start_engine
    from rollmesh.config import SyncConfig
    from rollmesh.engine.lora_init import write_identity
    from rollmesh.models.loading import load_model
    from rollmesh.models.lora import inject
    from rollmesh.training.weight_sender import WeightSender, weight_specs
    from rollmesh.weight_sync.tensors import dtype_from_name
    from rollmesh.wire.transport import Transport

    torch.set_num_threads(1)
    root = Path(args.root)
    path = checkpoint(args.shape, root)
    exp = experiment(path, args.device, args.rank, args.prompt + args.response)
    dtype_name = exp.model.dtype
    dtype = dtype_from_name(dtype_name)
    device = torch.device(args.device)
    model, _ = load_model(str(path), device, torch.float32)
    rows = []
    common = ["--model", str(path), "--dtype", dtype_name, "--device", args.device,
              "--weight-version", "0", "--threads", "1"]
    with tempfile.TemporaryDirectory() as tmp, Transport() as t:
        for transport in ("broadcast", "handles"):
            proc, url = start_engine(*common, python=sys.executable, timeout_s=900)
            cfg = SyncConfig(transport=transport, load_format="flattened_bucket",
                             backend="gloo")
            sender = WeightSender(t, {"engines": [url], "synchronizer": "tcp://127.0.0.1:1"},
                                  cfg, device)
            await sender.open()
            version = [0]

            async def full() -> int:
                version[0] += 1
                return await sender._send(
                    weight_specs(model, dtype), version[0],
                    tensors=(p.detach() for _, p in model.named_parameters()))
            seconds, times, sent = await _time_then_stop(full, args.repeats, sender, proc)
            rows.append({"mode": f"full_{transport}", "seconds": seconds, "times": times,
                         "bytes": sent})
            print(f"  sync full ({transport:9s}) {sent / 1e6:10.1f} MB  {seconds:8.3f} s  "
                  f"(runs: {', '.join(f'{x:.3f}' for x in times)})", flush=True)

        lora_cfg = exp.model.lora
        initial = Path(tmp) / "initial"
        write_identity(str(initial), str(path), lora_cfg)
        proc, url = start_engine(*common, "--enable-lora", "--lora-paths",
                                 f"policy={initial}", "--max-lora-rank", str(args.rank),
                                 python=sys.executable, timeout_s=900)
        inject(model, lora_cfg)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_" in name:  # a trained adapter: B not zero
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
        sender = WeightSender(t, {"engines": [url], "synchronizer": "tcp://127.0.0.1:1",
                                  "lora_dir": str(Path(tmp) / "lora")}, SyncConfig(), device)
        await sender.open()
        version = [0]

        async def adapter() -> int:
            version[0] += 1
            return await sender.send_adapter(model, dtype, version[0], lora_cfg,
                                             str(path))
        seconds, times, sent = await _time_then_stop(adapter, args.repeats, sender, proc)
    rows.append({"mode": "lora", "rank": args.rank, "seconds": seconds, "times": times,
                 "bytes": sent})
    print(f"  sync LoRA r{args.rank:<3d}         {sent / 1e6:10.1f} MB  {seconds:8.3f} s  "
          f"(runs: {', '.join(f'{x:.3f}' for x in times)})", flush=True)
    best = min((r for r in rows if r["mode"].startswith("full")), key=lambda r: r["seconds"])
    print(f"  LoRA/full: bytes x{sent / best['bytes']:.4f} (goal <= 0.03), seconds "
          f"x{seconds / best['seconds']:.3f} of the faster full sync ({best['mode']}; "
          "goal <= 0.1)", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("0.5b", "small"), default="0.5b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--checkpointing", action="store_true",
                   help="trainer.gradient_checkpointing = true in both variants (the GPU "
                        "default at micro_batch_tokens >= 8192)")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-sync", action="store_true")
    p.add_argument("--json")
    p.add_argument("--root", default=str(Path(tempfile.gettempdir()) / "rollmesh-bench"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(train_child(args)))
        return 0
    print(f"LoRA r{args.rank} beside full weights, shape {args.shape}, {args.device}", flush=True)
    results: dict[str, Any] = {}
    if not args.skip_sync:
        results["sync"] = asyncio.run(sync(args))
    if not args.skip_train:
        results["train"] = train(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows(args, results), indent=1))
    return 0


def rows(args: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """benchmarks/results.py's rows: the figure and its baseline from the same run."""
    out = []
    sync_rows = results.get("sync") or []
    full = [r for r in sync_rows if r["mode"].startswith("full")]
    lora = [r for r in sync_rows if r["mode"] == "lora"]
    if full and lora:
        best = min(full, key=lambda r: r["seconds"])
        out.append({"bench": "lora", "what": f"sync bytes, LoRA r{args.rank} / full",
                    "value": lora[0]["bytes"] / best["bytes"], "goal": "<= 0.03",
                    "device": args.device, "shape": args.shape})
        out.append({"bench": "lora", "what": f"sync seconds, LoRA r{args.rank} / full "
                                             f"({best['mode']})",
                    "value": lora[0]["seconds"] / best["seconds"], "goal": "<= 0.1",
                    "device": args.device, "shape": args.shape})
    train_rows = results.get("train") or []
    if len(train_rows) == 2:
        f, lo = train_rows
        out.append({"bench": "lora", "what": "trainer peak memory, LoRA / full",
                    "value": lo["peak_bytes"] / f["peak_bytes"], "goal": "<= 0.6",
                    "device": args.device, "shape": args.shape})
        out.append({"bench": "lora", "what": "trainer step seconds, LoRA / full",
                    "value": lo["step_s"] / f["step_s"], "goal": None,
                    "device": args.device, "shape": args.shape})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
