"""Trainer checkpoints and policy exports: safetensors for tensors, JSON and msgpack for the rest.

A checkpoint (format 2) is one directory `step_<N>` under the checkpoint directory, one part per
rank, each rank writing only the shards it holds:

    rank_<r>.safetensors     rank r's local shards, under their HF names with a prefix:
                             `model.<name>` (float32 master weights), `optimizer.<name>.<key>`
                             (AdamW's exp_avg, exp_avg_sq; the plain `step` scalars in rank 0's
                             file alone), and with a critic `critic.<name>`,
                             `critic_optimizer.<name>.<key>`. An empty shard is not stored.
    index.json               for every tensor its full shape, dtype and the pieces that tile it
                             (rank file, global offset per dim, local shape); per rank file its
                             size and sha256 (`checkpoint_io.Index`; `verify` checks the hashes)
    rng_<r>.msgpack          rank r's RNG states: torch (and CUDA), numpy, python
    trainer_state.json       "format": 2, step, version, samples consumed, world size, optimizer
                             hyper-parameters, scheduler state, data cursor (opaque plain data)
                             (and, with a critic, its optimizer hyper-parameters and scheduler)
    config.json, generation_config.json, tokenizer files   (Hugging Face's, as the model's)

Saving is asynchronous (`start_save` -> `PendingSave`): the step waits only while each rank
copies its shards to host memory (a clone on CPU, as training changes them in place; on CUDA
pinned host buffers kept for the next save, one non-blocking copy and a synchronize). A thread
per rank then writes its part into the checkpoint's temporary directory `.tmp-step_<N>-<nonce>`
(rank 0 makes it and shares the nonce: every rank writes into the same directory, so the
checkpoint directory must be on a filesystem every rank sees), streaming (no whole-file buffer),
hashing as it writes, fsyncs it and checks it (size; the header lists what was written). Every
rank then calls `PendingSave.poll` after each training step: one collective (the sum of the
ranks' done flags) that says whether every part is written; not yet: the step goes on and polls
again after the next one. `wait` joins this rank's writer, then does the same. Once every rank
is done, the ranks gather their results on rank 0: every part written and checked -> rank 0
writes index.json and trainer_state.json, renames the directory to `step_<N>`, fsyncs the
checkpoint directory, replaces `latest` (by rename: `write_atomic`) and prunes (`keep`); a write
that failed on any rank -> the checkpoint is abandoned: its temporary directory goes, `latest`
is unchanged, each failing rank's reason is logged (`checkpoint_failed`) and `poll`/`wait`
return False on every rank (the trainer goes on; its next save tries again). `latest` never
names a checkpoint with a part missing. A new save must wait for the previous one first.
`save` is `start_save` + `wait`, raising `CheckpointError` on failure.

On load each rank reads only the region it holds of every tensor: the overlapping parts of the
pieces (`safe_open(...).get_slice`), so a checkpoint loads into any number of ranks (2 -> 1,
1 -> 2). A checkpoint of format 1 (rank 0 alone wrote the whole tensors: model.safetensors,
optimizer.safetensors, critic.safetensors, critic_optimizer.safetensors, rng.msgpack with every
rank's states) still loads; `load` dispatches on trainer_state.json's "format". No pickle
anywhere: torch.load and torch.distributed.checkpoint are not used.

`export_hf` writes the policy alone as a Hugging Face model directory in a chosen dtype, which
transformers (`AutoModelForCausalLM.from_pretrained`) and `rollmesh engine --model DIR` load. It
streams: the header comes from the parameters' global shapes, then each parameter is gathered
(`full_tensor`, every rank) and written by rank 0 at once, which holds one whole tensor at a time.

LoRA (`model.lora.rank > 0`): a checkpoint holds the adapters alone and their optimizer state
(the base weights are the model path's, read again on resume; config.json is the base
model's); trainer_state.json says `"lora": true`, and a run of the other kind refuses to resume
from it. `export_hf` writes the merged model (W + scaling * B @ A, the base model's names; built
whole on rank 0, not streamed) and the adapters alone in peft's format in `adapter/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
from safetensors import safe_open

from rollmesh.runtime.durable_log import fsync_dir, write_atomic
from rollmesh.runtime.log import get_logger
from rollmesh.config import LoraConfig
from rollmesh.models.lora import config_dict, has_adapters, is_adapter, write_adapter
from rollmesh.training import checkpoint_io
from rollmesh.training.checkpoint_io import INDEX, Index, Reader, rank_file
from rollmesh.training.lora import adapter_tensors, merged_state_dict
from rollmesh.training.ranks import Ranks, full_tensor

FORMAT = 2
WRITER_NICE = 10  # the writer threads' nice value: the step's compute comes first
LATEST = "latest"
log = get_logger("rollmesh.training.checkpoint")


class CheckpointError(OSError):
    """A save that was abandoned: some rank's part could not be written or checked."""


# -- paths -----------------------------------------------------------------------------------------


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def latest(directory: str | Path) -> Path | None:
    """The newest complete checkpoint under `directory`, or None."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return None
    path = Path(directory) / pointer.read_text().strip()
    return path if (path / "trainer_state.json").is_file() else None


# -- RNG -------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's RNG states as plain data."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "numpy": {"name": np_name, "keys": np.asarray(np_keys, np.uint32).tobytes(),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    n = state["numpy"]
    np.random.set_state((n["name"], np.frombuffer(n["keys"], np.uint32).copy(), n["pos"],
                         n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(s), dtype=torch.uint8) for s in state["cuda"]])


# -- what a checkpoint holds -----------------------------------------------------------------------


def _named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """What a checkpoint holds of `model`: every parameter, or under LoRA the adapters alone
    (the base weights are the model path's, read again on resume)."""
    if has_adapters(model):
        return [(n, p) for n, p in model.named_parameters() if is_adapter(n)]
    return list(model.named_parameters())


def full_state_dict(model: torch.nn.Module, ranks: Ranks, dtype: torch.dtype | None = None,
                    ) -> dict[str, torch.Tensor]:
    """Every parameter whole, on rank 0 (empty elsewhere); a collective on every rank."""
    out = {}
    for name, p in _named_parameters(model):
        t = full_tensor(p)
        if ranks.is_main:
            out[name] = (t if dtype is None else t.to(dtype)).cpu().contiguous()
    return out


def local_shard(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(this rank's local tensor, its global offset, the global shape): a DTensor's shard
    (FSDP2: Shard(0), the last one possibly shorter or empty), or a plain tensor whole."""
    t = t.detach()
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return t, (0,) * t.dim(), tuple(t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(f"local shard {tuple(local.shape)}, expected {tuple(shape)}")
    return local, tuple(int(o) for o in offset), tuple(t.shape)


def _entries(prefix: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             main: bool) -> list[tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
    """(name, local tensor, global offset, global shape) of everything this rank stores of
    `model` and its `optimizer`; a plain tensor beside sharded ones (AdamW's `step`) is the
    same on every rank: rank 0 stores it."""
    out = []
    for name, p in _named_parameters(model):
        local, offset, shape = local_shard(p)
        sharded = hasattr(p, "device_mesh")
        if sharded or main:
            out.append((f"{prefix}.{name}", local, offset, shape))
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {name}.{key} is not a tensor")
            local, offset, shape = local_shard(value)
            if hasattr(value, "device_mesh") or main:
                out.append((f"{prefix}_optimizer.{name}.{key}" if prefix != "model"
                            else f"optimizer.{name}.{key}", local, offset, shape))
    return out


def _hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = []
    for g in optimizer.param_groups:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                       if k != "params" and isinstance(v, (int, float, str, bool, tuple, list,
                                                           type(None)))})
    return groups


def _write_hf_files(path: Path, model: torch.nn.Module, tokenizer: Any) -> None:
    config = getattr(model, "config", None)  # a plain torch module has none
    if config is not None:
        config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def _scheduler_state(scheduler: Any) -> dict[str, Any]:
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


# -- save ------------------------------------------------------------------------------------------


class _HostBuffers:
    """Pinned host memory for the device -> host copies of one save, kept for the next (CUDA)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.busy = False

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self.buffers[name] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        return buf


HOST_BUFFERS = _HostBuffers()


def _to_host(entries: list, device_type: str) -> tuple[list, bool]:
    """The entries with their tensors copied to host memory (CPU: a clone); the step waits
    for this alone. Returns (entries, whether the pinned buffers are in use)."""
    if device_type != "cuda":
        return [(n, t.clone(memory_format=torch.contiguous_format), o, s)
                for n, t, o, s in entries], False
    if HOST_BUFFERS.busy:
        raise RuntimeError("a checkpoint is still being written from the host buffers: "
                           "wait for the pending save before starting another")
    HOST_BUFFERS.busy = True
    try:
        out = []
        for n, t, o, s in entries:
            if t.device.type == "cuda":
                buf = HOST_BUFFERS.get(n, t)
                buf.copy_(t, non_blocking=True)
                out.append((n, buf, o, s))
            else:
                out.append((n, t.clone(memory_format=torch.contiguous_format), o, s))
        torch.cuda.synchronize()
    except BaseException:
        HOST_BUFFERS.busy = False
        raise
    return out, True


@dataclass
class PendingSave:
    """One checkpoint being written (`start_save`); every rank polls or waits for it together."""

    directory: Path
    final: Path
    tmp: Path
    rank: int
    world: int
    pieces: dict[str, dict[str, Any]]  # this rank's: name -> {shape, dtype, offset, local}
    step: int = 0
    version: int = 0
    state: dict[str, Any] | None = None  # trainer_state.json (rank 0)
    keep: int = 0
    copy_s: float = 0.0
    write_s: float = 0.0
    error: str | None = None
    size: int = 0
    sha256: str = ""
    result: Path | bool | None = None  # Path: latest; False: abandoned; None: not settled
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def _write(self, entries: list, rng: bytes, hf: Any, pinned: bool) -> None:
        """This rank's part (the writer thread, at a lower CPU priority than the training)."""
        started = time.monotonic()
        try:
            with contextlib.suppress(AttributeError, OSError):  # Linux: per thread
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
            path = self.tmp / rank_file(self.rank)
            specs = [(n, t.dtype, tuple(t.shape)) for n, t, _, _ in entries]
            tensors = (t for _, t, _, _ in entries)
            self.size, self.sha256 = checkpoint_io.write_safetensors(path, specs, tensors)
            entries.clear()  # the host copies go as soon as they are written
            checkpoint_io.check_written(path, self.size, [n for n, _, _ in specs])
            rng_path = self.tmp / f"rng_{self.rank}.msgpack"
            with open(rng_path, "wb") as f:
                f.write(rng)
                f.flush()
                os.fsync(f.fileno())
            if hf is not None:
                _write_hf_files(self.tmp, *hf)
                for f in self.tmp.iterdir():
                    if f.is_file() and not f.name.startswith(("rank_", "rng_")):
                        with open(f, "rb+") as fh:
                            os.fsync(fh.fileno())
        except BaseException as e:  # noqa: BLE001 - reported to every rank by `poll`/`wait`
            self.error = f"{type(e).__name__}: {e}"[:1000]
        finally:
            entries.clear()
            if pinned:
                HOST_BUFFERS.busy = False
            self.write_s = time.monotonic() - started
            self.done.set()

    def poll(self, ranks: Ranks) -> Path | bool | None:
        """A collective: None while some rank's part is still being written; once all are,
        the checkpoint's path (it is `latest`) or False (abandoned), on every rank."""
        if self.result is not None:
            return self.result
        flag = ranks.sum_(torch.tensor([int(self.done.is_set())], dtype=torch.int64))
        if int(flag) < self.world:
            return None
        return self._settle(ranks)

    def wait(self, ranks: Ranks) -> Path | bool:
        """A collective: this rank's writer done, then as `poll` once all are."""
        if self.result is not None:
            return self.result
        if self.thread is not None:
            self.thread.join()
        self.done.wait()
        return self._settle(ranks)

    def _settle(self, ranks: Ranks) -> Path | bool:
        mine = msgpack.packb({"error": self.error, "size": self.size, "sha256": self.sha256,
                              "pieces": self.pieces}, use_bin_type=True)
        parts = ranks.gather_bytes(mine)
        decision: dict[str, Any] | None = None
        if ranks.is_main:
            assert parts is not None
            decision = self._commit([msgpack.unpackb(p, raw=False) for p in parts])
        decision = ranks.share(decision)
        if decision.get("error"):
            self.error = decision["error"]  # every failing rank's reason
            self.result = False
        else:
            self.result = self.final
        return self.result

    def _commit(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """Rank 0: every part written -> index, trainer state, rename, `latest`, prune."""
        failed = [(r, p["error"]) for r, p in enumerate(parts) if p["error"]]
        try:
            if failed:
                raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in failed))
            tensors: dict[str, dict[str, Any]] = {}
            for r, part in enumerate(parts):
                for name, piece in part["pieces"].items():
                    entry = tensors.setdefault(name, {"shape": piece["shape"],
                                                      "dtype": piece["dtype"], "pieces": []})
                    if piece["shape"] != entry["shape"] or piece["dtype"] != entry["dtype"]:
                        raise CheckpointError(f"rank {r}: {name} is {piece['dtype']} "
                                              f"{piece['shape']}, rank 0's {entry['dtype']} "
                                              f"{entry['shape']}")
                    entry["pieces"].append({"file": rank_file(r), "offset": piece["offset"],
                                            "shape": piece["local"]})
            files = {rank_file(r): (p["size"], p["sha256"]) for r, p in enumerate(parts)}
            data = checkpoint_io.index_data(tensors, files, self.world)
            Index(data, str(self.tmp / INDEX))  # what is written is what a load accepts
            assert self.state is not None
            for name, text in ((INDEX, json.dumps(data)),
                               ("trainer_state.json", json.dumps(self.state, indent=1))):
                write_atomic(self.tmp / name, text, fsync=True)
            if self.final.exists():  # a re-save of the same step (e.g. after a resume)
                shutil.rmtree(self.final)
            os.rename(self.tmp, self.final)
            fsync_dir(self.directory)
            write_atomic(self.directory / LATEST, self.final.name + "\n")
        except BaseException as e:  # noqa: BLE001 - abandoned; the trainer goes on
            for r, reason in failed or [(0, f"{type(e).__name__}: {e}")]:
                log.error("checkpoint_failed", step_dir=self.final.name, rank=r,
                          reason=reason[:500])
            shutil.rmtree(self.tmp, ignore_errors=True)
            return {"error": str(e)[:2000] or type(e).__name__}
        if self.keep:
            prune(self.directory, self.keep)
        return {"error": None}


def start_save(directory: str | Path, *, model: torch.nn.Module,
               optimizer: torch.optim.Optimizer, scheduler: Any, step: int, version: int,
               ranks: Ranks = Ranks(), tokenizer: Any = None, samples_consumed: int = 0,
               data_cursor: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
               critic: torch.nn.Module | None = None,
               critic_optimizer: torch.optim.Optimizer | None = None,
               critic_scheduler: Any = None, keep: int = 0) -> PendingSave:
    """Begin checkpoint `step` under `directory` (every rank calls, together): returns once
    this rank's shards are in host memory; a thread writes them (see the module docstring).
    The previous `PendingSave` must be settled (`poll` returned non-None, or `wait`)."""
    if critic is not None and (critic_optimizer is None or critic_scheduler is None):
        raise ValueError("a critic is saved with its optimizer and scheduler")
    directory = Path(directory)
    final = step_dir(directory, step)
    started = time.monotonic()
    entries = _entries("model", model, optimizer, ranks.is_main)
    if critic is not None:
        entries += _entries("critic", critic, critic_optimizer, ranks.is_main)
    entries = [e for e in entries if e[1].numel()]  # an empty shard is not stored
    on_cuda = any(t.device.type == "cuda" for _, t, _, _ in entries)
    entries, pinned = _to_host(entries, "cuda" if on_cuda else "cpu")
    copy_s = time.monotonic() - started
    pieces = {n: {"shape": list(s), "dtype": checkpoint_io.dtype_name(t.dtype),
                  "offset": list(o), "local": list(t.shape)} for n, t, o, s in entries}
    rng = msgpack.packb(rng_state(), use_bin_type=True)
    state = None
    message: dict[str, Any] | None = None
    if ranks.is_main:
        state = {
            "format": FORMAT, "step": step, "version": version,
            "samples_consumed": samples_consumed, "world_size": ranks.world,
            "optimizer": {"param_groups": _hyper(optimizer)},
            "scheduler": _scheduler_state(scheduler),
            "data_cursor": data_cursor, "extra": extra or {},
            "lora": has_adapters(model),
        }
        if critic is not None:
            state["critic"] = {"optimizer": {"param_groups": _hyper(critic_optimizer)},
                               "scheduler": _scheduler_state(critic_scheduler)}
        nonce = uuid.uuid4().hex[:8]
        message = {"nonce": nonce, "error": None}
        try:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f".tmp-{final.name}-{nonce}").mkdir()
        except OSError as e:
            message["error"] = f"{type(e).__name__}: {e}"
    message = ranks.share(message)
    pending = PendingSave(directory, final, directory / f".tmp-{final.name}-{message['nonce']}",
                          ranks.rank, ranks.world, pieces, step=step, version=version,
                          state=state, keep=keep, copy_s=copy_s)
    if message["error"]:
        pending.error = message["error"]
        if pinned:
            HOST_BUFFERS.busy = False
        pending.done.set()
        return pending
    hf = (model, tokenizer) if ranks.is_main else None
    pending.thread = threading.Thread(target=pending._write, args=(entries, rng, hf, pinned),
                                      name=f"checkpoint-{step}-rank{ranks.rank}", daemon=True)
    pending.thread.start()
    return pending


def save(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: Any, step: int, version: int, ranks: Ranks = Ranks(),
         tokenizer: Any = None, samples_consumed: int = 0,
         data_cursor: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
         critic: torch.nn.Module | None = None,
         critic_optimizer: torch.optim.Optimizer | None = None, critic_scheduler: Any = None,
         keep: int = 0) -> Path | None:
    """Write checkpoint `step` under `directory` and wait for it (`start_save` + `wait`; every
    rank calls; rank 0 returns its path, the others None). A `critic` comes with its optimizer
    and scheduler. `keep` > 0: once this one is `latest`, only the `keep` latest checkpoints
    stay (`prune`). A save abandoned raises `CheckpointError` on every rank (`latest` as it
    was)."""
    pending = start_save(directory, model=model, optimizer=optimizer, scheduler=scheduler,
                         step=step, version=version, ranks=ranks, tokenizer=tokenizer,
                         samples_consumed=samples_consumed, data_cursor=data_cursor,
                         extra=extra, critic=critic, critic_optimizer=critic_optimizer,
                         critic_scheduler=critic_scheduler, keep=keep)
    if pending.wait(ranks) is False:
        raise CheckpointError(f"checkpoint {pending.final} abandoned: {pending.error}")
    return pending.final if ranks.is_main else None


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Remove all but the `keep` latest `step_<N>` checkpoints (never the one `latest` names),
    and what a killed save left behind (`.tmp-*`); returns what was removed. (Called when a
    save becomes latest: no other save is in flight then.)"""
    directory = Path(directory)
    current = latest(directory)
    steps = sorted((p for p in directory.glob("step_*") if p.is_dir()
                    and p.name.removeprefix("step_").isdigit()),
                   key=lambda p: int(p.name.removeprefix("step_")))
    doomed = [p for p in steps[:-keep] if current is None or p.resolve() != current.resolve()]
    doomed += [p for p in directory.glob(".tmp-step_*") if p.is_dir()]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def verify(path: str | Path) -> None:
    """Check a format-2 checkpoint's rank files against index.json (size and sha256: reads
    every byte); raises ValueError naming what differs."""
    path = Path(path)
    index = Index.read(path)
    for name, (size, sha) in index.files.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            raise ValueError(f"{file}: missing or not {size} bytes")
        if checkpoint_io.sha256_file(file) != sha:
            raise ValueError(f"{file}: sha256 differs from {path / INDEX}")


def read_tensors(path: str | Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """A format-2 checkpoint's tensors under `prefix` ("model", "optimizer", "critic",
    "critic_optimizer"), whole, by their names without it (for tools and tests)."""
    path = Path(path)
    reader = Reader(path, Index.read(path))
    out = {}
    for name, (shape, _, _) in reader.index.tensors.items():
        if name.startswith(prefix + "."):
            out[name.removeprefix(prefix + ".")] = reader.read_region(name, (0,) * len(shape),
                                                                      shape)
    return out


# -- load ------------------------------------------------------------------------------------------


def _like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`full` shaped as `target` is: the same DTensor sharding, or a plain tensor, on its device."""
    full = full.to(device=target.device, dtype=target.dtype)
    mesh = getattr(target, "device_mesh", None)
    if mesh is None:
        return full
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank holds the full tensor already, each keeps its shard.
    return distribute_tensor(full, mesh, target.placements, src_data_rank=None)


def _apply_hyper(where: Path, optimizer: torch.optim.Optimizer,
                 groups: list[dict[str, Any]]) -> bool:
    """The saved hyper-parameters into `optimizer`; returns whether it is the fused one."""
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{where}: {len(groups)} optimizer param groups, the optimizer has "
                         f"{len(optimizer.param_groups)}")
    for saved, group in zip(groups, optimizer.param_groups):
        # the implementation is the optimizer's own (a checkpoint of the unfused one loads
        # into the fused one and back): the saved flags are not applied
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()
                      if k not in ("fused", "foreach", "capturable")})
    return any(g.get("fused") for g in optimizer.param_groups)


def _step_scalar(t: torch.Tensor, p: torch.Tensor, fused: bool) -> torch.Tensor:
    # `step` is a plain scalar tensor even for sharded parameters, on the parameter's device
    # for the fused kernel (as torch's own load puts it)
    return t.to(p.device, torch.float32) if fused else t


# format 1: whole tensors in one file each, every rank reads them whole

def _load_parameters(file: Path, model: torch.nn.Module) -> None:
    named = _named_parameters(model)
    with safe_open(file, framework="pt") as f:
        missing = [n for n, _ in named if n not in f.keys()]
        if missing:
            raise ValueError(f"{file}: lacks {missing[:5]}")
        for name, p in named:
            p.copy_(_like(f.get_tensor(name), p))


def _load_optimizer(file: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    groups: list[dict[str, Any]]) -> None:
    fused = _apply_hyper(file, optimizer, groups)
    with safe_open(file, framework="pt") as f:
        entries: dict[str, list[str]] = {}
        for full_key in f.keys():
            entries.setdefault(full_key.rsplit(".", 1)[0], []).append(full_key)
        for name, p in _named_parameters(model):
            st = {}
            for full_key in entries.get(name, []):
                key, t = full_key.rsplit(".", 1)[1], f.get_tensor(full_key)
                st[key] = _step_scalar(t, p, fused) if key == "step" else _like(t, p)
            if st:
                optimizer.state[p] = st


# format 2: each rank reads the region it holds

def _read_like(reader: Reader, name: str, target: torch.Tensor) -> torch.Tensor:
    """This rank's region of tensor `name`, as `target` holds it (its shard of a DTensor),
    as a plain tensor on the target's device and dtype."""
    _, offset, shape = local_shard(target)
    if reader.shape(name) != shape:
        raise ValueError(f"{reader.directory}: {name} is {reader.shape(name)}, the model's "
                         f"{shape}")
    local = target.to_local() if hasattr(target, "device_mesh") else target
    region = reader.read_region(name, offset, tuple(local.shape))
    return region.to(device=target.device, dtype=target.dtype)


def _load_parameters_v2(reader: Reader, prefix: str, model: torch.nn.Module) -> None:
    named = _named_parameters(model)
    missing = [n for n, _ in named if f"{prefix}.{n}" not in reader]
    if missing:
        raise ValueError(f"{reader.directory}: lacks {prefix} tensors {missing[:5]}")
    for name, p in named:
        local = p.to_local() if hasattr(p, "device_mesh") else p
        local.copy_(_read_like(reader, f"{prefix}.{name}", p))


def _load_optimizer_v2(reader: Reader, prefix: str, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    fused = _apply_hyper(reader.directory, optimizer, groups)
    entries: dict[str, list[str]] = {}
    for full_key in reader.index.tensors:
        if full_key.startswith(prefix + "."):
            entries.setdefault(full_key[len(prefix) + 1:].rsplit(".", 1)[0], []).append(full_key)
    for name, p in _named_parameters(model):
        st = {}
        for full_key in entries.get(name, []):
            key = full_key.rsplit(".", 1)[1]
            if key == "step":  # a plain scalar, the same on every rank: read whole
                st[key] = _step_scalar(reader.read_region(full_key, (), ()), p, fused)
                continue
            region = _read_like(reader, full_key, p)
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import DTensor

                region = DTensor.from_local(region, p.device_mesh, p.placements,
                                            run_check=False, shape=p.shape, stride=p.stride())
            st[key] = region
        if st:
            optimizer.state[p] = st


def _load_scheduler(scheduler: Any, saved: dict[str, Any]) -> None:
    scheduler.load_state_dict({**saved, "lr_lambdas": [None] * len(
        getattr(scheduler, "lr_lambdas", [None]))})


@torch.no_grad()
def load(path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
         scheduler: Any, ranks: Ranks = Ranks(), critic: torch.nn.Module | None = None,
         critic_optimizer: torch.optim.Optimizer | None = None, critic_scheduler: Any = None,
         ) -> dict[str, Any]:
    """Restore a checkpoint (format 2, or 1) into `model`, `optimizer`, `scheduler`, the
    `critic` with its optimizer and scheduler when given (the checkpoint must hold one), and
    this rank's RNGs; returns trainer_state.json (step, version, samples_consumed, ...)."""
    path = Path(path)
    state = json.loads((path / "trainer_state.json").read_text())
    fmt = state.get("format")
    if fmt not in (1, FORMAT):
        raise ValueError(f"{path}: checkpoint format {fmt!r}, expected 1 or {FORMAT}")
    if critic is not None and "critic" not in state:
        raise ValueError(f"{path}: the checkpoint holds no critic (it was saved by a run without "
                         "algorithm.advantage = 'gae'); a GAE run cannot resume from it")
    if bool(state.get("lora")) != has_adapters(model):
        raise ValueError(
            f"{path}: a checkpoint of a {'LoRA' if state.get('lora') else 'full-weight'} run "
            f"cannot resume a {'LoRA' if has_adapters(model) else 'full-weight'} one "
            "(model.lora.rank differs)")
    parts = [("model", model, optimizer, state["optimizer"]["param_groups"])]
    if critic is not None:
        parts.append(("critic", critic, critic_optimizer,
                      state["critic"]["optimizer"]["param_groups"]))
    if fmt == 1:
        for prefix, m, opt, groups in parts:
            _load_parameters(path / f"{prefix}.safetensors", m)
            if opt is not None:
                _load_optimizer(path / f"{prefix}_optimizer.safetensors"
                                if prefix != "model" else path / "optimizer.safetensors",
                                m, opt, groups)
        rngs = msgpack.unpackb((path / "rng.msgpack").read_bytes(), raw=False)["ranks"]
        rng = rngs[ranks.rank if ranks.rank < len(rngs) else 0]
    else:
        reader = Reader(path, Index.read(path))
        try:
            for prefix, m, opt, groups in parts:
                _load_parameters_v2(reader, prefix, m)
                if opt is not None:
                    _load_optimizer_v2(reader, "optimizer" if prefix == "model"
                                       else f"{prefix}_optimizer", m, opt, groups)
        finally:
            reader.close()
        rng_path = path / f"rng_{ranks.rank}.msgpack"
        rng = (rng_path if rng_path.is_file() else path / "rng_0.msgpack").read_bytes()
    if scheduler is not None:
        _load_scheduler(scheduler, state["scheduler"])
    if critic is not None and critic_scheduler is not None:
        _load_scheduler(critic_scheduler, state["critic"]["scheduler"])
    set_rng_state(msgpack.unpackb(rng, raw=False))
    return state


# -- export ----------------------------------------------------------------------------------------


def _stream_full(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype, main: bool):
    """Each tensor whole (a collective per tensor, every rank), converted on rank 0."""
    for _, p in named:
        t = full_tensor(p)
        yield t.to(dtype).cpu().contiguous() if main else None
        del t


def export_hf(path: str | Path, *, model: torch.nn.Module, tokenizer: Any,
              dtype: torch.dtype = torch.float32, ranks: Ranks = Ranks(),
              lora: LoraConfig | None = None) -> Path | None:
    """The policy as a Hugging Face model directory (every rank calls; rank 0 writes, one
    gathered parameter at a time). Under LoRA (`lora` given, the model holding adapters): the
    merged model (built whole on rank 0), and the adapters alone in peft's format in its
    `adapter/` folder."""
    adapters = has_adapters(model)
    if adapters and lora is None:
        raise ValueError("export_hf: the model holds LoRA adapters; pass its `lora` config")
    if adapters:
        merged = merged_state_dict(model, ranks.is_main, dtype)
        named = list(merged.items())
        tensors: Any = (t for _, t in named)
        adapter = dict(adapter_tensors(model))
    else:
        named = _named_parameters(model)
        tensors = _stream_full(named, dtype, ranks.is_main)
    if not ranks.is_main:
        for _ in tensors:  # the gathers, in step with rank 0
            pass
        return None
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir(parents=True)
        specs = [(n, dtype, tuple(p.shape)) for n, p in named]
        checkpoint_io.write_safetensors(tmp / "model.safetensors", specs, tensors, fsync=False)
        _write_hf_files(tmp, model, tokenizer)
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if adapters:
            assert lora is not None
            write_adapter(tmp / "adapter", adapter,
                          config_dict(lora, getattr(model.config, "_name_or_path", None)))
        if path.exists():
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException:
        for _ in tensors:  # the other ranks' gathers still run: stay in step, then fail
            pass
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
