"""Weight buckets: the trainer's parameters on their way to the engines, in bounded pieces.

Both ends of the broadcast: rank 0's sender (`BucketSender`, `Snapshot`) and the engines'
receivers (`receive_weights`, `receive_bucket`, `receive_bucket_into`).

A bucket is a run of consecutive parameters (model order) whose bytes fit in `bucket_mb` (a
larger parameter is a bucket by itself). Each bucket is one `/update_weights_from_distributed`
call announcing its names, dtypes and shapes, and travels in one of two forms, always in the
order of the announced names:

- "tensor": one broadcast per tensor. This is the contract (docs/sglang-api.md) that both
  SGLang and the built-in engine (`receive_weights`) implement.
- "flattened_bucket": one broadcast of a uint8 buffer holding the bucket's tensors back to back,
  each tensor's raw bytes at its offset, no padding: the layout of SGLang's
  FlattenedTensorBucket, which SGLang receives when the body says
  `"load_format": "flattened_bucket"`. The built-in engine receives it with
  `receive_bucket_into`: the buffer becomes the model's storage for those tensors, so that the
  next sync receives straight into the model (no copy); `receive_bucket` views the tensors out
  of a buffer.

Sender (`BucketSender`): "tensor" holds one gathered tensor at a time; "flattened_bucket" packs
bucket i+1 while bucket i is on the wire (`async_op=True`), in two reusable bucket buffers, so
rank 0's extra memory is at most two buckets (a one-tensor bucket is sent as that tensor).

Snapshot (`Snapshot`, `sync.overlap`): one version's weights frozen in a buffer of their own,
in the flattened layout (every tensor in its announced dtype, back to back, announcement
order), so that the trainer can go on changing its parameters while the snapshot is sent. A
flattened bucket is then sent straight from the snapshot's bytes (`BucketSender.pack_from`):
no packing copy, unless the snapshot lies in host memory and the broadcast runs on a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rollmesh.weight_sync.tensors import WeightUpdateError, dtype_from_name, dtype_name

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


def _specs(names: Sequence[str], dtypes: Sequence[str],
           shapes: Sequence[Sequence[int]]) -> list[WeightSpec]:
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightUpdateError("names, dtypes and shapes differ in length "
                                f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    return [WeightSpec(n, dtype_from_name(d), tuple(int(x) for x in s))
            for n, d, s in zip(names, dtypes, shapes)]


def _view(flat: torch.Tensor, offset: int, spec: WeightSpec) -> tuple[torch.Tensor, bool]:
    """The spec's tensor at `offset` of the uint8 `flat`: a view, or (at an offset its dtype
    cannot be viewed at) a copy. The flag says whether it is a view."""
    raw = flat[offset:offset + spec.nbytes]
    try:
        return raw.view(spec.dtype).view(spec.shape), True
    except RuntimeError:  # storage offset not a multiple of the element size
        return raw.clone().view(spec.dtype).view(spec.shape), False


class BucketSender:
    """Rank 0's side of a sync, pipelined: `pack` builds bucket i+1 while bucket i's broadcast
    (started by `start`, `async_op=True`) is on the wire; `wait` waits for all of them.

    "flattened_bucket": a bucket of several tensors is copied into one of `slots` reusable
    buffers of `capacity` bytes (allocated on first use); a bucket of one tensor is broadcast
    as that tensor, no copy. At most `slots` broadcasts are in flight, so rank 0's extra memory
    is at most `slots` buffers (plus, for a one-tensor bucket, that tensor when the model's own
    cannot be sent as it is: a gathered shard or another dtype). "tensor": one blocking
    broadcast per tensor in `start`, one tensor in memory at a time (the contract's form)."""

    def __init__(self, group: dist.ProcessGroup, load_format: str = "flattened_bucket",
                 device: torch.device | str = "cpu", capacity: int = 0, slots: int = 2,
                 buffers: Sequence[torch.Tensor] = ()):
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")
        self.group, self.load_format, self.device = group, load_format, device
        self.capacity = capacity
        self.buffers: list[torch.Tensor | None] = list(buffers) + [None] * (slots - len(buffers))
        self.inflight: list[tuple[Any, int | None, Any]] = []  # (work, slot, what it sends)
        self.next_slot = 0

    def _retire(self, upto: int) -> None:
        """Wait for the oldest `upto` broadcasts in flight."""
        while upto > 0 and self.inflight:
            work, _, _ = self.inflight.pop(0)
            work.wait()
            upto -= 1

    def _slot(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next bucket buffer (`nbytes` of it), once its previous bucket is off the wire."""
        slot = self.next_slot
        self.next_slot = (slot + 1) % len(self.buffers)
        # the slot's previous bucket must be off the wire before it is overwritten
        for i, (_, used, _) in enumerate(self.inflight):
            if used == slot:
                self._retire(i + 1)
                break
        if self.buffers[slot] is None and nbytes <= self.capacity:
            self.buffers[slot] = torch.empty(self.capacity, dtype=torch.uint8,
                                             device=self.device)
        return slot, _flat(nbytes, self.buffers[slot], self.device)

    def pack(self, bucket: Sequence[WeightSpec], tensors: Iterable[torch.Tensor]) -> Any:
        """The bucket ready to send (consumes `tensors`, one tensor at a time, bucket order)."""
        if self.load_format == "tensor":
            return ("tensor", bucket, tensors)
        if len(bucket) == 1:
            (spec,) = bucket
            t = self._cast(spec, next(iter(tensors)))
            return ("one", bucket, t)
        slot, flat = self._slot(sum(s.nbytes for s in bucket))
        offset = 0
        for spec, tensor in zip(bucket, tensors, strict=True):
            t = self._cast(spec, tensor)
            flat[offset:offset + spec.nbytes].copy_(t.reshape(-1).view(torch.uint8))
            offset += spec.nbytes
            del t
        return ("flat", bucket, flat, slot)

    def pack_from(self, snapshot: Snapshot, first: int, bucket: Sequence[WeightSpec]) -> Any:
        """The bucket of `snapshot` that starts at its tensor `first`, ready to send. Flattened,
        a bucket of several tensors is the snapshot's own bytes when the snapshot lies where the
        broadcast runs (no copy), else it is copied into a bucket buffer (pinned host memory to
        the GPU, on the current stream); otherwise as `pack` (views of the snapshot)."""
        if list(snapshot.specs[first:first + len(bucket)]) != list(bucket):
            raise ValueError(f"bucket at tensor {first} does not match the snapshot's tensors")
        if self.load_format == "tensor" or len(bucket) == 1:
            return self.pack(bucket, (snapshot.tensor(first + k) for k in range(len(bucket))))
        region = snapshot.region(first, len(bucket))
        if same_device(region.device, torch.device(self.device)):
            return ("flat", bucket, region, None)
        slot, flat = self._slot(region.numel())
        flat.copy_(region, non_blocking=True)
        return ("flat", bucket, flat, slot)

    def _cast(self, spec: WeightSpec, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.detach().to(device=self.device, dtype=spec.dtype).contiguous()
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"{spec.name}: shape {tuple(t.shape)}, announced {spec.shape}")
        return t

    def start(self, packed: Any) -> int:
        """Broadcast a packed bucket (asynchronously unless "tensor"); returns its bytes."""
        kind, bucket = packed[0], packed[1]
        if kind == "tensor":
            self.wait()
            sent = 0
            for spec, tensor in zip(bucket, packed[2], strict=True):
                t = self._cast(spec, tensor)
                dist.broadcast(t, src=0, group=self.group)
                sent += spec.nbytes
                del t
            return sent
        payload, slot = (packed[2], None) if kind == "one" else (packed[2], packed[3])
        self._retire(len(self.inflight) - len(self.buffers) + 1)
        self.inflight.append((dist.broadcast(payload, src=0, group=self.group, async_op=True),
                              slot, payload))
        return sum(s.nbytes for s in bucket)

    def wait(self) -> None:
        """Until every broadcast started is done (raises the first failure)."""
        try:
            self._retire(len(self.inflight))
        finally:
            self.inflight.clear()


def same_device(a: torch.device, b: torch.device) -> bool:
    """`a` and `b` are the same device ("cuda" is the current GPU)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current)


class Snapshot:
    """One version's weights, frozen while the trainer goes on (`sync.overlap`): every tensor of
    `specs` in its spec's dtype, back to back in one uint8 buffer in announcement order (the
    flattened buckets' layout, no padding), so that any run of consecutive tensors (a bucket)
    is one contiguous region of it.

    `device`: where the buffer lies (cpu, pinned with `pin_memory` so that a GPU copies into it
    asynchronously, or a GPU). Rank 0 keeps it from sync to sync (`fits`): it holds the model
    once, in the engines' dtype."""

    def __init__(self, specs: Sequence[WeightSpec], device: torch.device | str = "cpu",
                 pin_memory: bool = False):
        self.specs = list(specs)
        self.device = torch.device(device)
        self.offsets: list[int] = []
        offset = 0
        for spec in self.specs:
            self.offsets.append(offset)
            offset += spec.nbytes
        self.nbytes = offset
        self.flat = torch.empty(offset, dtype=torch.uint8, device=self.device,
                                pin_memory=pin_memory)

    def fits(self, specs: Sequence[WeightSpec], device: torch.device | str) -> bool:
        return self.specs == list(specs) and same_device(self.device, torch.device(device))

    @torch.no_grad()
    def put(self, index: int, tensor: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy `tensor` (any dtype and device: cast to its spec's dtype where it lies, then
        copied) into the place of the spec `index`, on the current stream."""
        spec = self.specs[index]
        t = tensor.detach()
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"{spec.name}: shape {tuple(t.shape)}, announced {spec.shape}")
        if t.dtype != spec.dtype:
            t = t.to(spec.dtype)
        start = self.offsets[index]
        self.flat[start:start + spec.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8),
                                                   non_blocking=non_blocking)

    def fill(self, tensors: Iterable[torch.Tensor]) -> None:
        """Every tensor, in spec order (a plain copy: the CPU's path)."""
        count = 0
        for count, tensor in enumerate(tensors, 1):
            if count > len(self.specs):
                raise ValueError(f"more tensors than the snapshot's {len(self.specs)}")
            self.put(count - 1, tensor)
        if count != len(self.specs):
            raise ValueError(f"{count} tensors for a snapshot of {len(self.specs)}")

    def region(self, first: int, count: int) -> torch.Tensor:
        """The bytes of tensors first .. first + count - 1 (uint8, a view)."""
        start = self.offsets[first]
        end = self.offsets[first + count - 1] + self.specs[first + count - 1].nbytes
        return self.flat[start:end]

    def tensor(self, index: int) -> torch.Tensor:
        """The tensor `index` in its dtype and shape: a view (a copy where its offset is not a
        multiple of its element size)."""
        return _view(self.flat, self.offsets[index], self.specs[index])[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by name (tests, checks)."""
        return {s.name: self.tensor(i) for i, s in enumerate(self.specs)}


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




def receive_bucket(group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[str],
                   shapes: Sequence[Sequence[int]], load_format: str = "tensor",
                   device: torch.device | str = "cpu", buffer: torch.Tensor | None = None,
                   ) -> list[tuple[str, torch.Tensor]]:
    """Engine side: the tensors of one announced bucket (flattened: views into one buffer,
    `buffer` when given and large enough; load them before the next bucket reuses it)."""
    specs = _specs(names, dtypes, shapes)
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
        out.append((spec.name, _view(flat, offset, spec)[0]))
        offset += spec.nbytes
    return out


def _region(targets: Sequence[torch.Tensor], specs: Sequence[WeightSpec],
            device: torch.device) -> torch.Tensor | None:
    """A uint8 tensor over the bytes that `targets` occupy when they lie back to back in one
    storage exactly as the flattened bucket `specs` (what `receive_bucket_into` leaves after
    rebinding): receiving into it loads them with no copy. None otherwise."""
    first = targets[0]
    storage = first.untyped_storage()
    base = first.data_ptr()
    offset = 0
    for t, spec in zip(targets, specs):
        if (t.dtype != spec.dtype or t.device != device or not t.is_contiguous()
                or tuple(t.shape) != spec.shape or t.untyped_storage().data_ptr()
                != storage.data_ptr() or t.data_ptr() != base + offset):
            return None
        offset += spec.nbytes
    start = base - storage.data_ptr()
    if start + offset > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (offset,))


@torch.no_grad()
def receive_bucket_into(group: dist.ProcessGroup, targets: Mapping[str, torch.Tensor],
                        names: Sequence[str], dtypes: Sequence[str],
                        shapes: Sequence[Sequence[int]], load_format: str = "flattened_bucket",
                        device: torch.device | str = "cpu",
                        scratch: torch.Tensor | None = None) -> int:
    """Engine side: receive one announced bucket straight into the model's tensors `targets`
    (by name; check the announcement against them first). Returns the tensors loaded.

    Flattened, the received buffer becomes the model's storage: each target whose dtype, device
    and shape match is rebound (`.data`) to its view of the buffer, the others are copied
    (cast) into. After that the bucket's targets lie back to back as on the wire, and the next
    sync of the same bucket is received into them directly: no copy, no extra memory.
    `scratch`: a uint8 buffer to receive in when no target can be rebound (reused). A broadcast
    that fails midway leaves that bucket's tensors partly written."""
    device = torch.device(device)
    specs = _specs(names, dtypes, shapes)
    dest = [targets[s.name] for s in specs]
    if load_format == "tensor":
        for spec, target in zip(specs, dest):
            direct = (target.dtype == spec.dtype and target.device == device
                      and target.is_contiguous() and tuple(target.shape) == spec.shape)
            t = target if direct else torch.empty(spec.shape, dtype=spec.dtype, device=device)
            dist.broadcast(t, src=0, group=group)
            if not direct:
                target.copy_(t)
        return len(specs)
    if load_format != "flattened_bucket":
        raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")
    if not specs:
        return 0
    region = _region(dest, specs, device)
    if region is not None:
        dist.broadcast(region, src=0, group=group)
        return len(specs)
    total = sum(s.nbytes for s in specs)
    rebind = [t.dtype == s.dtype and t.device == device and tuple(t.shape) == s.shape
              for t, s in zip(dest, specs)]
    flat = (torch.empty(total, dtype=torch.uint8, device=device) if any(rebind)
            else _flat(total, scratch, device))
    dist.broadcast(flat, src=0, group=group)
    offset = 0
    for spec, target, rb in zip(specs, dest, rebind):
        view, is_view = _view(flat, offset, spec)
        if rb and is_view:
            target.data = view
        else:
            target.copy_(view)
        offset += spec.nbytes
    return len(specs)


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

