"""Trainer checkpoints, format 1 (every tensor gathered to rank 0, rank 0 writes alone, in the
step) against format 2 (each rank writes its shards from a host copy in a background thread).

    python benchmarks/checkpoint.py [--shape tiny|0.5b] [--seqs 8] [--prompt 32]
        [--response 96] [--work DIR] [--out PATH]

2 trainer ranks, gloo, FSDP2 on CPU, one torch thread each; the policy at `--shape` (0.5b:
Qwen2.5-0.5B's config with random weights, `benchmarks/real_scale.py`'s checkpoint; tiny: a
small Qwen2 for a quick check), AdamW's state populated by one step on a GRPO batch of --seqs
sequences of --prompt + --response tokens. Then, on rank 0:

- shard share: the bytes of rank 0's local parameters and AdamW state (what format 2 writes);
- peak: rank 0's highest RSS during the save (/proc/self/statm sampled every 5 ms, from the
  call until the checkpoint is latest) minus its RSS just before (after glibc's malloc_trim:
  otherwise freed activations still mapped would hide the save's allocations);
- blocking: how long the step waits for the save (format 1: the whole save; format 2: the
  copy of the shards to host memory), and a step's time with no save beside one with the
  format-2 writer running in the background (started just before the step);
- resume: `checkpoint.load` of the checkpoint into the same ranks, its files dropped from the
  page cache first (read from disk, as by a restarted trainer).

Goals (format 2): rank 0's peak during the save <= 1.3x its shard share; the save adds <= 10%
of a step. `--out PATH` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
            use_sliding_window=False)
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def trim() -> None:
    """Hand the heap's free memory back to the system (glibc), so that RSS before a save is
    what is in use, not what the step's activations left mapped (which a save would reuse)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def uncache(directory: Path) -> None:
    for f in directory.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


class PeakRSS:
    """The highest RSS seen by a thread sampling /proc/self/statm every 5 ms."""

    def __init__(self) -> None:
        trim()
        self.before = rss()
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.005)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        return self.peak - self.before


def save_format_1(directory: Path, state: Any) -> Path | None:
    """The format-1 save as it was (rank 0 gathers every tensor and writes them, in the step);
    tensors and the RNGs only (the HF files and trainer_state.json are the same either way)."""
    import msgpack
    from safetensors.torch import save_file

    from rollmesh.runtime.durable_log import fsync_dir, write_atomic
    from rollmesh.training import checkpoint
    from rollmesh.training.ranks import full_tensor

    ranks = state.ranks
    params = checkpoint.full_state_dict(state.model, ranks)
    optim = {}
    for name, p in checkpoint._named_parameters(state.model):
        for key, value in sorted(state.optimizer.state.get(p, {}).items()):
            t = full_tensor(value)
            if ranks.is_main:
                optim[f"{name}.{key}"] = t.cpu().contiguous()
    rngs = ranks.gather_bytes(msgpack.packb(checkpoint.rng_state(), use_bin_type=True))
    if not ranks.is_main:
        return None
    final = checkpoint.step_dir(directory, state.step)
    tmp = directory / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    save_file(params, tmp / "model.safetensors", metadata={"format": "pt"})
    save_file(optim, tmp / "optimizer.safetensors", metadata={"format": "pt"})
    (tmp / "trainer_state.json").write_text(json.dumps({
        "format": 1, "step": state.step, "version": 0, "samples_consumed": 0,
        "world_size": ranks.world,
        "optimizer": {"param_groups": checkpoint._hyper(state.optimizer)},
        "scheduler": checkpoint._scheduler_state(state.scheduler), "data_cursor": None,
        "extra": {}, "lora": False}))
    (tmp / "rng.msgpack").write_bytes(msgpack.packb({"ranks": rngs}, use_bin_type=True))
    for f in tmp.iterdir():
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    os.rename(tmp, final)
    fsync_dir(directory)
    write_atomic(directory / checkpoint.LATEST, final.name + "\n")
    return final


def _rank(rank: int, rendezvous: str, model: str, work: str, args: dict) -> dict[str, Any]:
    import torch

    from benchmarks.train_step import experiment, make_batch
    from rollmesh.training import checkpoint
    from rollmesh.training.ranks import close_ranks, init_ranks
    from rollmesh.training.state import build_state
    from rollmesh.training.step import prepare, update_policy

    torch.set_num_threads(1)
    ranks = init_ranks(rendezvous, rank, 2, "gloo", timeout_s=1800)
    out: dict[str, Any] = {}
    try:
        length = args["prompt"] + args["response"]
        exp = experiment(Path(model), "cpu", 4, length, args["response"], ["trainer.ranks=2"])
        state = build_state(exp, ranks)
        batch = make_batch([(args["prompt"], args["response"])] * args["seqs"], 4,
                           state.model.config.vocab_size)

        def step() -> float:
            ranks.sum_(torch.zeros(1))  # start together
            t = time.perf_counter()
            update_policy(state, prepare(state, batch))
            state.step += 1
            return time.perf_counter() - t

        out["first_step_s"] = step()  # AdamW's state exists from here
        out["step_s"] = step()
        entries = checkpoint._entries("model", state.model, state.optimizer, ranks.is_main)
        out["shard_bytes"] = sum(t.numel() * t.element_size() for _, t, _, _ in entries)
        out["params"] = sum(p.numel() for p in state.model.parameters())
        root = Path(work)

        # format 1
        ranks.sum_(torch.zeros(1))
        peak = PeakRSS()
        t = time.perf_counter()
        old = save_format_1(root / "f1", state)
        out["f1_blocking_s"] = time.perf_counter() - t
        ranks.sum_(torch.zeros(1))  # the other ranks wait for rank 0 at the next collective
        out["f1_blocking_all_s"] = time.perf_counter() - t
        out["f1_peak_bytes"] = peak.stop()
        old = ranks.share(str(old) if ranks.is_main else None)

        # format 2: the save alone, then a step with the writer in the background
        ranks.sum_(torch.zeros(1))
        peak = PeakRSS()
        t = time.perf_counter()
        pending = checkpoint.start_save(root / "f2", model=state.model,
                                        optimizer=state.optimizer, scheduler=state.scheduler,
                                        step=state.step, version=0, ranks=ranks)
        out["f2_blocking_s"] = time.perf_counter() - t
        new = pending.wait(ranks)
        out["f2_total_s"] = time.perf_counter() - t
        out["f2_peak_bytes"] = peak.stop()
        out["f2_write_s"] = pending.write_s
        assert new, pending.error
        ranks.sum_(torch.zeros(1))
        pending = checkpoint.start_save(root / "f2bg", model=state.model,
                                        optimizer=state.optimizer, scheduler=state.scheduler,
                                        step=state.step, version=0, ranks=ranks)
        out["step_with_bg_save_s"] = step() + pending.copy_s
        out["bg_copy_s"] = pending.copy_s
        polled = pending.poll(ranks)
        out["bg_save_done_after_step"] = polled is not None and polled is not False
        assert pending.wait(ranks), pending.error
        out["step_after_s"] = step()

        for name, path in (("f1", old), ("f2", str(new))):
            uncache(Path(path))  # a resume reads from disk (the files were fsynced)
            ranks.sum_(torch.zeros(1))
            t = time.perf_counter()
            checkpoint.load(path, model=state.model, optimizer=state.optimizer,
                            scheduler=state.scheduler, ranks=ranks)
            out[f"{name}_load_s"] = time.perf_counter() - t
        out["f2_bytes_on_disk"] = sum(f.stat().st_size for f in Path(new).glob("rank_*"))
        out["f1_bytes_on_disk"] = sum(f.stat().st_size for f in Path(old).glob("*.safetensors"))
    finally:
        close_ranks(ranks)
    return out


def table(r: dict[str, Any]) -> str:
    gib = 2 ** 30
    plain = min(r["step_s"], r["step_after_s"])
    rows = [
        ("parameters", f"{r['params'] / 1e6:.0f} M", ""),
        ("rank 0 shard share (params+AdamW)", f"{r['shard_bytes'] / gib:.2f} GiB", ""),
        ("step without a save (s)", f"{plain:.2f}", f"{plain:.2f}"),
        ("rank 0 peak RSS - before, during save", f"{r['f1_peak_bytes'] / gib:.2f} GiB",
         f"{r['f2_peak_bytes'] / gib:.2f} GiB"),
        ("  / shard share (goal <= 1.3)", f"{r['f1_peak_bytes'] / r['shard_bytes']:.2f}",
         f"{r['f2_peak_bytes'] / r['shard_bytes']:.2f}"),
        ("step waits for the save (s)", f"{r['f1_blocking_all_s']:.2f}",
         f"{r['f2_blocking_s']:.2f}"),
        ("  / step (goal <= 0.10)", f"{r['f1_blocking_all_s'] / plain:.3f}",
         f"{r['f2_blocking_s'] / plain:.3f}"),
        ("save until latest (s)", f"{r['f1_blocking_all_s']:.2f}", f"{r['f2_total_s']:.2f}"),
        ("step with the writer in background (s)", "", f"{r['step_with_bg_save_s']:.2f}"),
        ("  / step without", "", f"{r['step_with_bg_save_s'] / plain:.3f}"),
        ("resume: load (s)", f"{r['f1_load_s']:.2f}", f"{r['f2_load_s']:.2f}"),
        ("bytes on disk", f"{r['f1_bytes_on_disk'] / gib:.2f} GiB",
         f"{r['f2_bytes_on_disk'] / gib:.2f} GiB (rank files)"),
    ]
    w = max(len(a) for a, _, _ in rows)
    lines = [f"{'':{w}}  {'format 1':>14}  {'format 2':>14}"]
    lines += [f"{a:{w}}  {b:>14}  {c:>14}" for a, b, c in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["tiny", "0.5b"], default="tiny")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=96)
    parser.add_argument("--work", type=Path, default=None,
                        help="where the model and the checkpoints go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()

    from benchmarks.real_scale import QWEN25_05B, write_checkpoint
    from rollmesh.wire.transport import free_port

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.work))
    try:
        model = write_checkpoint(work / "model", dict(QWEN25_05B if args.shape == "0.5b"
                                                      else TINY))
        rendezvous = f"tcp://127.0.0.1:{free_port()}"
        opts = {"seqs": args.seqs, "prompt": args.prompt, "response": args.response}
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            results = pool.starmap(_rank, [(r, rendezvous, str(model), str(work), opts)
                                           for r in range(2)], chunksize=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = {"shape": args.shape, **opts, **results[0],
         "rank1_shard_bytes": results[1]["shard_bytes"]}
    print(f"checkpoint benchmark: shape {args.shape}, 2 ranks gloo FSDP2 on CPU, "
          f"{args.seqs} x ({args.prompt} + {args.response}) tokens per step")
    print(table(r))
    if args.out:
        args.out.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
