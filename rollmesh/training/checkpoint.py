"""Trainer checkpoints and policy exports: safetensors for tensors, JSON and msgpack for the rest.

A checkpoint is one directory `step_<N>` under the checkpoint directory:

    model.safetensors        the policy's full parameters (float32 master weights), HF names
    config.json, generation_config.json, tokenizer files
                             so that the checkpoint is itself a Hugging Face model directory
    optimizer.safetensors    AdamW state per parameter: `<name>.exp_avg`, `<name>.exp_avg_sq`,
                             `<name>.step`
    trainer_state.json       step, version, samples consumed, optimizer hyper-parameters,
                             scheduler state, data cursor (opaque plain data), world size
                             (and, with a critic, its optimizer hyper-parameters and scheduler)
    rng.msgpack              every rank's RNG states: torch (and CUDA), numpy, python
    critic.safetensors, critic_optimizer.safetensors
                             GAE only: the critic's parameters (decoder + `value_head`) and its
                             AdamW state, as the policy's

It is written into a temporary directory next to it and renamed into place, then the `latest`
file is replaced (also by rename): a crash leaves the previous checkpoint whole. Every tensor is
gathered to rank 0 one parameter at a time (`full_tensor`) and only rank 0 writes, so the format
does not depend on the number of ranks; on load each rank reads the full tensors and keeps its
shard. No pickle anywhere: torch.load and torch.distributed.checkpoint are not used.

`export_hf` writes the policy alone as a Hugging Face model directory in a chosen dtype, which
transformers (`AutoModelForCausalLM.from_pretrained`) and `rollmesh engine --model DIR` load.

LoRA (`model.lora.rank > 0`): a checkpoint's model.safetensors and optimizer.safetensors hold
the adapters alone (the base weights are the model path's, read again on resume; config.json
is the base model's); trainer_state.json says `"lora": true`, and a run of the other kind
refuses to resume from it. `export_hf` writes the merged model (W + scaling * B @ A, the base
model's names) and the adapters alone in peft's format in `adapter/`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollmesh.runtime.durable_log import fsync_dir, write_atomic
from rollmesh.config import LoraConfig
from rollmesh.models.lora import config_dict, has_adapters, is_adapter, write_adapter
from rollmesh.training.lora import adapter_tensors, merged_state_dict
from rollmesh.training.ranks import Ranks, full_tensor

FORMAT = 1
LATEST = "latest"


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


# -- save ------------------------------------------------------------------------------------------


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


def _optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       ranks: Ranks) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in _named_parameters(model):
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {name}.{key} is not a tensor")
            t = full_tensor(value)
            if ranks.is_main:
                out[f"{name}.{key}"] = t.cpu().contiguous()
    return out


def _hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    groups = []
    for g in optimizer.param_groups:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()
                       if k != "params" and isinstance(v, (int, float, str, bool, tuple, list,
                                                           type(None)))})
    return groups


def _write_hf_files(path: Path, model: torch.nn.Module, tokenizer: Any) -> None:
    config = model.config
    config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def _scheduler_state(scheduler: Any) -> dict[str, Any]:
    return {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}


def save(directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: Any, step: int, version: int, ranks: Ranks = Ranks(),
         tokenizer: Any = None, samples_consumed: int = 0,
         data_cursor: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
         critic: torch.nn.Module | None = None,
         critic_optimizer: torch.optim.Optimizer | None = None, critic_scheduler: Any = None,
         keep: int = 0) -> Path | None:
    """Write checkpoint `step` under `directory` (every rank calls; rank 0 writes and returns
    its path, the others return None). A `critic` comes with its optimizer and scheduler.
    `keep` > 0: once this one is `latest`, only the `keep` latest checkpoints stay (`prune`)."""
    if critic is not None and (critic_optimizer is None or critic_scheduler is None):
        raise ValueError("a critic is saved with its optimizer and scheduler")
    params = full_state_dict(model, ranks)
    optim = _optimizer_tensors(model, optimizer, ranks)
    if critic is not None:
        critic_params = full_state_dict(critic, ranks)
        critic_optim = _optimizer_tensors(critic, critic_optimizer, ranks)
    rngs = ranks.gather_bytes(msgpack.packb(rng_state(), use_bin_type=True))
    if not ranks.is_main:
        return None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = step_dir(directory, step)
    tmp = directory / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(params, tmp / "model.safetensors", metadata={"format": "pt"})
        save_file(optim, tmp / "optimizer.safetensors", metadata={"format": "pt"})
        _write_hf_files(tmp, model, tokenizer)
        state = {
            "format": FORMAT, "step": step, "version": version,
            "samples_consumed": samples_consumed, "world_size": ranks.world,
            "optimizer": {"param_groups": _hyper(optimizer)},
            "scheduler": _scheduler_state(scheduler),
            "data_cursor": data_cursor, "extra": extra or {},
            "lora": has_adapters(model),
        }
        if critic is not None:
            save_file(critic_params, tmp / "critic.safetensors", metadata={"format": "pt"})
            save_file(critic_optim, tmp / "critic_optimizer.safetensors",
                      metadata={"format": "pt"})
            state["critic"] = {"optimizer": {"param_groups": _hyper(critic_optimizer)},
                               "scheduler": _scheduler_state(critic_scheduler)}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        (tmp / "rng.msgpack").write_bytes(msgpack.packb({"ranks": rngs}, use_bin_type=True))
        for f in tmp.iterdir():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # a re-save of the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(directory)
        write_atomic(directory / LATEST, final.name + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep:
        prune(directory, keep)
    return final


def prune(directory: str | Path, keep: int) -> list[Path]:
    """Remove all but the `keep` latest `step_<N>` checkpoints (never the one `latest` names),
    and what a killed save left behind (`.tmp-*`); returns what was removed."""
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
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{file}: {len(groups)} optimizer param groups, the optimizer has "
                         f"{len(optimizer.param_groups)}")
    for saved, group in zip(groups, optimizer.param_groups):
        # the implementation is the optimizer's own (a checkpoint of the unfused one loads
        # into the fused one and back): the saved flags are not applied
        group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()
                      if k not in ("fused", "foreach", "capturable")})
    fused = any(g.get("fused") for g in optimizer.param_groups)
    with safe_open(file, framework="pt") as f:
        entries: dict[str, list[str]] = {}
        for full_key in f.keys():
            entries.setdefault(full_key.rsplit(".", 1)[0], []).append(full_key)
        for name, p in _named_parameters(model):
            st = {}
            for full_key in entries.get(name, []):
                key, t = full_key.rsplit(".", 1)[1], f.get_tensor(full_key)
                # `step` is a plain scalar tensor even for sharded parameters, on the
                # parameter's device for the fused kernel (as torch's own load puts it)
                if key == "step":
                    st[key] = t.to(p.device, torch.float32) if fused else t
                else:
                    st[key] = _like(t, p)
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
    """Restore a checkpoint into `model`, `optimizer`, `scheduler`, the `critic` with its
    optimizer and scheduler when given (the checkpoint must hold one), and this rank's RNGs;
    returns trainer_state.json (step, version, samples_consumed, data_cursor, ...)."""
    path = Path(path)
    state = json.loads((path / "trainer_state.json").read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, expected {FORMAT}")
    if critic is not None and "critic" not in state:
        raise ValueError(f"{path}: the checkpoint holds no critic (it was saved by a run without "
                         "algorithm.advantage = 'gae'); a GAE run cannot resume from it")
    if bool(state.get("lora")) != has_adapters(model):
        raise ValueError(
            f"{path}: a checkpoint of a {'LoRA' if state.get('lora') else 'full-weight'} run "
            f"cannot resume a {'LoRA' if has_adapters(model) else 'full-weight'} one "
            "(model.lora.rank differs)")
    _load_parameters(path / "model.safetensors", model)
    if optimizer is not None:
        _load_optimizer(path / "optimizer.safetensors", model, optimizer,
                        state["optimizer"]["param_groups"])
    if scheduler is not None:
        _load_scheduler(scheduler, state["scheduler"])
    if critic is not None:
        _load_parameters(path / "critic.safetensors", critic)
        if critic_optimizer is not None:
            _load_optimizer(path / "critic_optimizer.safetensors", critic, critic_optimizer,
                            state["critic"]["optimizer"]["param_groups"])
        if critic_scheduler is not None:
            _load_scheduler(critic_scheduler, state["critic"]["scheduler"])
    rngs = msgpack.unpackb((path / "rng.msgpack").read_bytes(), raw=False)["ranks"]
    set_rng_state(msgpack.unpackb(rngs[ranks.rank if ranks.rank < len(rngs) else 0], raw=False))
    return state


# -- export ----------------------------------------------------------------------------------------


def export_hf(path: str | Path, *, model: torch.nn.Module, tokenizer: Any,
              dtype: torch.dtype = torch.float32, ranks: Ranks = Ranks(),
              lora: LoraConfig | None = None) -> Path | None:
    """The policy as a Hugging Face model directory (every rank calls; rank 0 writes). Under
    LoRA (`lora` given, the model holding adapters): the merged model, and the adapters alone
    in peft's format in its `adapter/` folder."""
    adapters = has_adapters(model)
    if adapters and lora is None:
        raise ValueError("export_hf: the model holds LoRA adapters; pass its `lora` config")
    if adapters:
        tensors = merged_state_dict(model, ranks.is_main, dtype)
        adapter = dict(adapter_tensors(model))
    else:
        tensors = full_state_dict(model, ranks, dtype)
    if not ranks.is_main:
        return None
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
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
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
