"""Weight buckets: the trainer's parameters on their way to the engines, in bounded pieces.

A bucket is a run of consecutive parameters (model order) whose bytes fit in `bucket_mb` (a
larger parameter is a bucket by itself). Each bucket is one `/update_weights_from_distributed`
call announcing its names, dtypes and shapes, and travels in one of two forms, always in the
order of the announced names:

- "tensor": one broadcast per tensor. This is the contract (docs/sglang-contract.md) that both
  SGLang and the built-in engine (`rollmesh.weights.receive_weights`) implement.
- "flattened_bucket": one broadcast of a uint8 buffer holding the bucket's tensors back to back,
  each tensor's raw bytes at its offset, no padding: the layout of SGLang's
  FlattenedTensorBucket, which SGLang receives when the body says
  `"load_format": "flattened_bucket"`. The receiver allocates the same buffer and views the
  tensors out of it (`receive_bucket`). The built-in engine does not read `load_format` yet.

Sender memory: "tensor" holds one gathered tensor at a time; "flattened_bucket" one bucket
buffer (reusable across buckets and syncs) plus the tensor being copied into it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rollmesh.weights import dtype_from_name, dtype_name

LOAD_FORMATS = ("tensor", "flattened_bucket")


@dataclass(frozen=True)
class WeightSpec:
    """One tensor as announced to the engines."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_buckets(specs: Sequence[WeightSpec], bucket_bytes: int) -> list[list[WeightSpec]]:
    """Consecutive specs grouped so that each group's bytes fit `bucket_bytes` (at least one)."""
    buckets: list[list[WeightSpec]] = []
    current: list[WeightSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def announce(bucket: Sequence[WeightSpec]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) for the HTTP body."""
    return ([s.name for s in bucket], [dtype_name(s.dtype) for s in bucket],
            [list(s.shape) for s in bucket])


def _flat(nbytes: int, buffer: torch.Tensor | None, device: torch.device | str) -> torch.Tensor:
    """A uint8 buffer of `nbytes`: a view of `buffer` when it is large enough (reused across
    buckets and syncs, so its pages are not faulted in again each time), else a new one."""
    if buffer is not None and buffer.numel() >= nbytes:
        return buffer[:nbytes]
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def send_bucket(group: dist.ProcessGroup, bucket: Sequence[WeightSpec],
                tensors: Iterable[torch.Tensor], load_format: str = "tensor",
                device: torch.device | str = "cpu", buffer: torch.Tensor | None = None) -> int:
    """Rank 0: broadcast the bucket's tensors (given in bucket order, any dtype: each is cast
    to its spec's dtype). Returns the bytes sent. `tensors` may be a generator that gathers
    each tensor just in time; it is consumed one tensor at a time. `buffer`: a uint8 tensor
    to build flattened buckets in."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")
    flat = None
    if load_format == "flattened_bucket":
        flat = _flat(sum(s.nbytes for s in bucket), buffer, device)
    offset = 0
    for spec, tensor in zip(bucket, tensors, strict=True):
        t = tensor.detach().to(device=device, dtype=spec.dtype).contiguous()
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"{spec.name}: shape {tuple(t.shape)}, announced {spec.shape}")
        if flat is None:
            dist.broadcast(t, src=0, group=group)
        else:
            flat[offset:offset + spec.nbytes].copy_(t.reshape(-1).view(torch.uint8))
        offset += spec.nbytes
        del t
    if flat is not None:
        dist.broadcast(flat, src=0, group=group)
    return offset


def receive_bucket(group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[str],
                   shapes: Sequence[Sequence[int]], load_format: str = "tensor",
                   device: torch.device | str = "cpu", buffer: torch.Tensor | None = None,
                   ) -> list[tuple[str, torch.Tensor]]:
    """Engine side: the tensors of one announced bucket (flattened: views into one buffer,
    `buffer` when given and large enough; load them before the next bucket reuses it)."""
    specs = [WeightSpec(n, dtype_from_name(d), tuple(s)) for n, d, s in zip(names, dtypes, shapes,
                                                                              strict=True)]
    if load_format == "tensor":
        out = []
        for spec in specs:
            t = torch.empty(spec.shape, dtype=spec.dtype, device=device)
            dist.broadcast(t, src=0, group=group)
            out.append((spec.name, t))
        return out
    if load_format != "flattened_bucket":
        raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")
    flat = _flat(sum(s.nbytes for s in specs), buffer, device)
    dist.broadcast(flat, src=0, group=group)
    out, offset = [], 0
    for spec in specs:
        view = flat[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape)
        out.append((spec.name, view))
        offset += spec.nbytes
    return out


def update_body(bucket: Sequence[WeightSpec], *, weight_version: str, load_format: str,
                flush_cache: bool, group_name: str = "weight_update_group") -> dict[str, Any]:
    """The JSON body of `/update_weights_from_distributed` for one bucket."""
    names, dtypes, shapes = announce(bucket)
    body: dict[str, Any] = {
        "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
        "flush_cache": flush_cache, "abort_all_requests": False, "weight_version": weight_version,
    }
    if load_format != "tensor":
        body["load_format"] = load_format
    return body

