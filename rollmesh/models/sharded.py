"""Trainer models loaded shard by shard: each rank reads only its own rows of the checkpoint.

`rollmesh.models.loading.load_model` builds the whole model in the process that calls it. A
trainer of K FSDP2 ranks that did so would hold K whole float32 copies in host memory at once
(8 ranks of a 7B model: ~224 GB) before `fully_shard` drops all but 1/K of each. Here instead:

1. the model is built from its config with its *parameters* on the meta device (no memory);
   its buffers (rotary `inv_freq`) are computed for real by the modules' own `__init__` and kept
   aside, since `to_empty` would leave them uninitialised;
2. the caller shards it while still on meta (`fully_shard` per decoder layer, then the root);
3. `to_empty` allocates only each rank's local shards, the buffers go back, and each
   parameter's shard is read from the safetensors files with `get_slice`: rank r of K reads
   rows [r*c, min((r+1)*c, n)) of a parameter with n rows, c = ceil(n / K), the split FSDP2's
   Shard(0) uses (torch.chunk's: the last ranks' shards may be short or empty; FSDP2 pads
   them internally). Rows are cast to the parameter's dtype (float32 master weights: an exact
   widening of a bfloat16 or float16 checkpoint), so the weights are bit for bit those of
   `AutoModelForCausalLM.from_pretrained(path, dtype=...)`.

A rank's peak is its shards plus one parameter's rows (and the pages of the files it read,
mapped: shared, reclaimable page cache). Tied weights (tied embeddings) stay tied: the meta
model ties them before sharding, so a tied pair is one parameter, read once from the key the
checkpoint holds (`to_empty` gives each module a tensor of its own; they are tied again).
Persistent buffers the checkpoint holds are read from it. Every parameter's key and shape is
checked against the checkpoint before anything is allocated; a checkpoint whose names need transformers' own conversions
(renamed or fused keys), or that has no safetensors files, raises `UnsupportedCheckpoint`
naming what is missing, and the caller may load it the whole-model way instead.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from rollmesh.models.loading import attention_implementation

# (parameter name, first row, end row) -> those rows of the parameter's full value
RowReader = Callable[[str, int, int], Tensor]


class UnsupportedCheckpoint(ValueError):
    """A checkpoint directory this loader cannot read shard by shard (the message says why)."""


class CheckpointFiles:
    """The safetensors files of a local Hugging Face directory, read a tensor's rows at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {key: self.path / name for key, name in weight_map.items()}
        elif single.is_file():
            with safe_open(single, framework="pt") as f:
                self._file_of = {key: single for key in f.keys()}
        else:
            raise UnsupportedCheckpoint(
                f"{self.path}: no model.safetensors or model.safetensors.index.json")
        self._open: dict[Path, Any] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def _handle(self, key: str) -> Any:
        file = self._file_of[key]
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")  # mmap: reads only what is sliced
        return self._open[file]

    def shape(self, key: str) -> list[int]:
        return list(self._handle(key).get_slice(key).get_shape())

    def rows(self, key: str, start: int, stop: int) -> Tensor:
        """Rows [start, stop) of tensor `key` (a 0-d tensor: the whole of it)."""
        part = self._handle(key).get_slice(key)
        if not part.get_shape():
            return self._handle(key).get_tensor(key)
        return part[start:stop]

    def close(self) -> None:
        self._open.clear()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and their buffers for real.

    The parameter is moved as it is registered, before the module's own init runs on it (which
    then costs nothing); its transient `torch.empty` is never touched, so never resident. The
    patch is process-wide while it lasts: no other thread may build modules meanwhile."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = vars(param)  # e.g. transformers' flags on the parameter
            moved = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(kwargs)
            module._parameters[name] = moved

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def empty_causal_lm(path: str | Path, dtype: torch.dtype, *, trust_remote_code: bool = False,
                    attn_implementation: str | None = None) -> Any:
    """The causal LM of checkpoint directory `path`: config and generation config as
    `from_pretrained` reads them, parameters on meta in `dtype`, buffers computed, eval mode.
    `attn_implementation` None: the kernel the engine's `load_model` picks for the
    architecture (`rollmesh.models.loading.attention_implementation`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UnsupportedCheckpoint(f"{path}: no config.json")
    config = AutoConfig.from_pretrained(path, local_files_only=True,
                                        trust_remote_code=trust_remote_code)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    attn = attn_implementation or attention_implementation(config)
    if attn is not None:
        kwargs["attn_implementation"] = attn
    # fork_rng: building must not move the caller's RNG stream (from_pretrained does not)
    with torch.random.fork_rng(devices=[]), parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.config._name_or_path = str(path)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    meta = [name for name, buf in model.named_buffers() if buf.is_meta]
    if meta:
        raise UnsupportedCheckpoint(f"{path}: buffers {meta[:3]} were built on meta, not computed")
    return model.eval()


def checkpoint_keys(model: torch.nn.Module, files: CheckpointFiles,
                    names: dict[int, str] | None = None) -> dict[str, str]:
    """Parameter name -> checkpoint key for every (deduplicated: tied = one) parameter of
    `model`, each checked to exist with the parameter's shape. `names`: id(parameter) -> key,
    for a model that holds another's parameters under other names (the critic's decoder)."""
    aliases: dict[int, list[str]] = {}  # a tied parameter may be stored under any of its names
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    keys: dict[str, str] = {}
    for name, param in model.named_parameters():
        if names is not None:
            if id(param) not in names:
                continue  # filled by the caller (a new head)
            candidates = [names[id(param)]]
        else:
            candidates = aliases[id(param)]
        key = next((k for k in candidates if k in files), None)
        if key is None:
            raise UnsupportedCheckpoint(f"{files.path}: no tensor {candidates[0]!r} in the "
                                        "safetensors files (renamed or converted weights?)")
        if files.shape(key) != list(param.shape):
            raise UnsupportedCheckpoint(f"{files.path}: {key!r} has shape {files.shape(key)}, "
                                        f"the model's parameter {list(param.shape)}")
        keys[name] = key
    return keys


def local_rows(param: Tensor) -> tuple[Tensor, int, int]:
    """(the rank's local tensor, first row, end row) of a parameter: its Shard(0) part under
    FSDP2, else all of it."""
    if not hasattr(param, "device_mesh"):
        n = param.shape[0] if param.dim() else 0
        return param.data, 0, n
    from torch.distributed.tensor import Shard

    placements = tuple(param.placements)
    if placements != (Shard(0),):
        raise ValueError(f"parameter sharded as {placements}: expected FSDP2's (Shard(0),)")
    mesh = param.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    n = param.shape[0]
    chunk = math.ceil(n / world)
    start = min(rank * chunk, n)
    stop = min(start + chunk, n)
    local = param.to_local()
    if local.shape[0] != stop - start:
        raise RuntimeError(f"rank {rank}/{world}: local shard of {n} rows has {local.shape[0]} "
                           f"rows, expected rows [{start}, {stop})")
    return local, start, stop


def _buffers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, Tensor]]:
    return [(module, name, buf) for module in model.modules()
            for name, buf in module._buffers.items() if buf is not None]


def _persistent_buffers(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    return [(f"{prefix}.{name}" if prefix else name, buf)
            for prefix, module in model.named_modules()
            for name, buf in module._buffers.items()
            if buf is not None and name not in module._non_persistent_buffers_set]


def materialize(model: torch.nn.Module, device: torch.device, read: RowReader) -> None:
    """Allocate a (sharded) meta model's parameters on `device` and fill each from `read`;
    the buffers it was built with are put back."""
    buffers = _buffers(model)
    tied = _tied_groups(model)
    model.to_empty(device=device)
    _retie(model, tied)
    for module, name, buf in buffers:
        module._buffers[name] = buf.to(device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            local, start, stop = local_rows(param)
            local.copy_(read(name, start, stop).to(local.dtype))
    if _tied_groups(model) != tied:
        raise RuntimeError(f"tied parameters {tied} came apart: {_tied_groups(model)}")


def _retie(model: torch.nn.Module, tied: list[list[str]]) -> None:
    """`to_empty` gives each module its own new tensor, untying what was tied: every name of a
    tied group gets the first name's parameter again (the one FSDP2 tracks: it sees the first)."""
    for first, *others in tied:
        param = model.get_parameter(first)
        for name in others:
            prefix, _, attr = name.rpartition(".")
            model.get_submodule(prefix)._parameters[attr] = param


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter shared by several modules (tied embeddings)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return sorted(names for names in by_id.values() if len(names) > 1)


def load_causal_lm(path: str | Path, device: torch.device, dtype: torch.dtype,
                   shard: Callable[[torch.nn.Module], torch.nn.Module], *,
                   prepare: Callable[[torch.nn.Module], None] = lambda m: None,
                   wrap: Callable[[Any], tuple[torch.nn.Module, dict[str, Tensor]]] | None = None,
                   trust_remote_code: bool = False) -> Any:
    """The causal LM at `path`, `prepare`d (before sharding: train mode, checkpointing),
    `shard`ed, then filled on `device` in `dtype`, each rank with its own rows.

    `wrap(lm)` (optional) builds another model around the meta LM's parts (the critic around its
    decoder) and returns it with the full values of its parameters that the checkpoint lacks
    (a new head); parameters taken from the LM are read from the LM's keys."""
    files = CheckpointFiles(path)
    try:
        model = empty_causal_lm(path, dtype, trust_remote_code=trust_remote_code)
        keys = checkpoint_keys(model, files)
        extra: dict[str, Tensor] = {}
        if wrap is not None:
            by_id = {id(p): keys[name] for name, p in model.named_parameters()}
            with parameters_on_meta():
                model, extra = wrap(model)
            keys = checkpoint_keys(model, files, names=by_id)
            unfilled = [n for n, _ in model.named_parameters() if n not in keys and n not in extra]
            if unfilled:
                raise ValueError(f"parameters {unfilled[:3]}: neither in {path} nor given")
        prepare(model)
        model = shard(model)

        def read(name: str, start: int, stop: int) -> Tensor:
            return extra[name][start:stop] if name in extra else files.rows(keys[name], start, stop)

        materialize(model, device, read)
        with torch.no_grad():
            for name, buf in _persistent_buffers(model):
                if name in files:  # as from_pretrained (which ignores a stored inv_freq)
                    buf.copy_(files.rows(name, 0, len(buf) if buf.dim() else 0))
    finally:
        files.close()
    return model
