"""Weight sync between the trainer and the engines: the code both sides of the broadcast share.

The group is built as SGLang, verl and slime build it (see docs/sglang-api.md): a
rendezvous on `tcp://addr:port`, a `PrefixStore(group_name, store)`, and torch's internal
`_new_process_group_helper`, because a process can own only one default WORLD group and the
trainer's WORLD belongs to training. Rank 0 is the trainer; it broadcasts every tensor in the
order of `names`, and each engine receives them in the same order into freshly allocated
tensors of the announced dtype and shape.

Trainer side:  `init_weight_update_group(..., rank=0)`, `update_request(...)` for the HTTP
body, `broadcast_from_trainer(group, named_tensors)`.
Engine side:   `init_weight_update_group(..., rank=rank_offset)`, `receive_weights(...)`,
`load_weights(model, named_tensors)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    PrefixStore,
    _new_process_group_helper,
)

from rollmesh.ranks import tcp_store

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


class WeightUpdateError(ValueError):
    """A weight update whose names, dtypes or shapes do not fit the model."""


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16."""
    if not isinstance(name, str):
        raise WeightUpdateError(f"dtype {name!r}: expected a string such as 'bfloat16'")
    key = name.removeprefix("torch.")
    found = _DTYPES.get(key, getattr(torch, key, None) if key.isidentifier() else None)
    if not isinstance(found, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r} (expected one of {sorted(_DTYPES)})")
    return found


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "nccl",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join the weight-update group; blocks until all `world_size` ranks have joined.

    Rank 0 hosts the TCPStore, listening on `master_address` only. Call it once per group name per process (destroy first to rejoin).
    """
    timeout = timedelta(seconds=timeout_s)
    # rank 0 (the trainer) listens on master_address only, not on every interface: the store
    # is unauthenticated (README, Security). The engines connect as plain TCPStore clients,
    # as SGLang's own rendezvous does.
    store = tcp_store(master_address, master_port, rank, world_size, timeout)
    store.set_timeout(timeout)
    prefix_store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        backend,
        prefix_store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    # What init_process_group does after the same helper call: the identity rank map. Without it
    # torch 2.13 cannot resolve `broadcast(src=0, group=...)` nor destroy the group.
    dist.distributed_c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def update_request(
    named_tensors: Sequence[tuple[str, torch.Tensor]],
    weight_version: str,
    group_name: str = "weight_update_group",
    **extra: Any,
) -> dict[str, Any]:
    """The JSON body of `/update_weights_from_distributed` announcing `named_tensors`."""
    return {
        "names": [n for n, _ in named_tensors],
        "dtypes": [dtype_name(t.dtype) for _, t in named_tensors],
        "shapes": [list(t.shape) for _, t in named_tensors],
        "group_name": group_name,
        "weight_version": str(weight_version),
        "flush_cache": True,
        "abort_all_requests": False,
        **extra,
    }


def broadcast_from_trainer(
    group: dist.ProcessGroup,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str | None = None,
) -> int:
    """Rank 0: broadcast each tensor in order (the order of the announced `names`).

    `device` is where the collective runs: cpu for gloo, the rank's GPU for nccl (default: the
    tensor's own device). Returns the number of bytes sent.
    """
    sent = 0
    for _, tensor in named_tensors:
        t = tensor.detach()
        if device is not None:
            t = t.to(device)
        t = t.contiguous()
        dist.broadcast(t, src=0, group=group)
        sent += t.numel() * t.element_size()
    return sent


def receive_weights(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    device: torch.device | str = "cpu",
) -> Iterable[tuple[str, torch.Tensor]]:
    """Engine ranks: yield (name, tensor) received by broadcast(src=0), one at a time.

    A generator so that the caller can load each tensor before the next one arrives (one
    tensor's worth of extra memory). Always consume it to the end: the trainer sends them all.
    """
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightUpdateError(
            "names, dtypes and shapes differ in length "
            f"({len(names)}, {len(dtypes)}, {len(shapes)})"
        )
    torch_dtypes = [dtype_from_name(d) for d in dtypes]
    for name, dtype, shape in zip(names, torch_dtypes, shapes):
        t = torch.empty(tuple(shape), dtype=dtype, device=device)
        dist.broadcast(t, src=0, group=group)
        yield name, t


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every loadable tensor of `model` by name, tied aliases included (lm_head.weight...)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


def check_update(
    model: torch.nn.Module,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[str] | None = None,
) -> None:
    """Raise WeightUpdateError unless every name is a model tensor of the announced shape (and,
    given `dtypes`, of a dtype that loads into it: a floating-point weight takes only
    floating-point values; a cast between float widths is fine)."""
    targets = model_tensors(model)
    if len(names) != len(shapes) or (dtypes is not None and len(dtypes) != len(names)):
        raise WeightUpdateError(
            "names, dtypes and shapes differ in length "
            f"({len(names)}, {len(dtypes) if dtypes is not None else '-'}, {len(shapes)})"
        )
    for i, (name, shape) in enumerate(zip(names, shapes)):
        if name not in targets:
            raise WeightUpdateError(f"unknown weight {name!r}")
        if tuple(targets[name].shape) != tuple(shape):
            raise WeightUpdateError(
                f"weight {name!r}: shape {list(shape)} does not match the model's "
                f"{list(targets[name].shape)}"
            )
        if dtypes is not None:
            dtype = dtype_from_name(dtypes[i])
            if dtype.is_floating_point != targets[name].dtype.is_floating_point:
                raise WeightUpdateError(
                    f"weight {name!r}: dtype {dtype_name(dtype)} cannot load into the model's "
                    f"{dtype_name(targets[name].dtype)}"
                )


@torch.no_grad()
def load_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each tensor into the model tensor of that name (cast to its dtype and device).

    Returns how many tensors were loaded. Check with `check_update` first where the tensors can
    still be refused without leaving the model half-updated.
    """
    targets = model_tensors(model)
    count = 0
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            raise WeightUpdateError(f"unknown weight {name!r}")
        if target.shape != tensor.shape:
            raise WeightUpdateError(
                f"weight {name!r}: shape {list(tensor.shape)} does not match the model's "
                f"{list(target.shape)}"
            )
        target.copy_(tensor)
        count += 1
    return count
