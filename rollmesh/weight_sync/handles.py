"""Zero-copy weight sync on one host: weights passed by handle, not pushed through a socket.

Both ends of `/update_weights_from_tensor` (SGLang's route; docs/architecture.md "Weight sync
by handle"):

- Trainer (`HandleSender`): packs every parameter, cast to the engines' dtype, into one flat
  buffer kept from sync to sync (`Packed`): on CPU a POSIX shared-memory segment named
  `rollmesh_w_<pid>_<n>` (unlinked on `close` and at exit), on a GPU one CUDA tensor shared by
  CUDA IPC (kept alive until the engines answered, which they do after their copy).
- The body: SGLang's `serialized_named_tensors` (one base64 string per TP rank of the engine).
  For the built-in engine each string is base64(msgpack) of rollmesh's own handle form
  (`load_format = "rollmesh_handles"`, `encode_handles`); for SGLang it is the pickled
  `MultiprocessingSerializer` bytes SGLang 0.5.23 reads (`sglang_payload`: torch's own CUDA
  reduction with the device index replaced by the device UUID, as SGLang's
  `monkey_patch_torch_reductions` writes it). rollmesh writes that pickle, never reads one.
- Engine (`decode_handles`, `load_from_handles`): checks the hostile table (segment name under
  the rollmesh prefix, offsets and sizes inside the segment, names/dtypes/shapes against the
  model), maps the segment (or opens the CUDA IPC handle) and copies each tensor into its
  parameter: one memcpy per tensor, no socket.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import contextlib
import copyreg
import io
import math
import mmap
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import msgpack
import torch

from rollmesh.runtime.log import get_logger
from rollmesh.weight_sync.buckets import WeightSpec
from rollmesh.weight_sync.tensors import (
    WeightUpdateError,
    check_update,
    dtype_from_name,
    dtype_name,
    model_tensors,
)

LOAD_FORMAT = "rollmesh_handles"  # the built-in engine's load_format on /update_weights_from_tensor
SEGMENT_PREFIX = "rollmesh_w_"
_SEGMENT_NAME = re.compile(r"rollmesh_w_[0-9]{1,10}_[0-9]{1,10}")
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (shm_open names)
log = get_logger("rollmesh.weight_sync.handles")
ALIGN = 64  # every tensor starts at a multiple of this: a view of any dtype is aligned
_MAX_PAYLOAD = 64 * 2**20  # a handle table larger than this is not a weight table
# The index of the device in the arguments of torch's rebuild_cuda_tensor, which SGLang's
# monkey_patch_torch_reductions replaces by the device's UUID (srt/utils/patch_torch.py).
_DEVICE_ARG = 6


@dataclass(frozen=True)
class Entry:
    """One tensor of the table: where its bytes lie in the flat buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout(specs: Sequence[WeightSpec]) -> tuple[list[Entry], int]:
    """Each spec's place in the flat buffer (aligned, model order) and the buffer's size."""
    entries, at = [], 0
    for s in specs:
        entries.append(Entry(s.name, dtype_name(s.dtype), tuple(s.shape), at, s.nbytes))
        at += -(-s.nbytes // ALIGN) * ALIGN
    return entries, at


def _quiet_resource_tracker() -> None:
    """multiprocessing's resource tracker unlinks the segment if this process dies without
    closing it (kill -9): wanted. It also warns about that on the stderr it inherits, which is
    the role's JSON log; started here with stderr on /dev/null, it cleans up silently."""
    from multiprocessing import resource_tracker

    if getattr(resource_tracker._resource_tracker, "_fd", None) is not None:
        return  # running already
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            resource_tracker.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def sweep_dead_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink the segments (`rollmesh_w_<pid>_<n>`, this user's) whose creator is dead: a
    trainer killed with kill -9 cannot unlink its own, and each holds a whole model's bytes of
    host memory until someone does. A segment of a live process (this one, another run's) is
    left alone; an engine that still maps a swept one keeps its pages until it unmaps them.
    Returns the names unlinked."""
    swept = []
    try:
        names = os.listdir(directory)
    except OSError:
        return swept
    for name in names:
        if not _SEGMENT_NAME.fullmatch(name):
            continue
        pid = int(name[len(SEGMENT_PREFIX):].split("_", 1)[0])
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != os.getuid() or _alive(pid):
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        swept.append(name)
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class Packed:
    """The trainer's flat buffer, kept from sync to sync: a shared-memory segment (CPU) or one
    CUDA tensor (GPU), regrown when the model's bytes do not fit it."""

    _count = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.shm: SharedMemory | None = None
        self.flat: torch.Tensor | None = None
        atexit.register(self.close)

    @property
    def name(self) -> str:
        assert self.shm is not None
        return self.shm.name

    def ensure(self, nbytes: int) -> torch.Tensor:
        nbytes = max(nbytes, 1)
        if self.flat is not None and self.flat.numel() >= nbytes:
            return self.flat
        self.close()
        if self.device.type == "cuda":
            self.flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return self.flat
        _quiet_resource_tracker()
        if not Packed._count:  # this process's first segment: what dead trainers left goes
            swept = sweep_dead_segments()
            if swept:
                log.warning("dead_segments_unlinked", segments=swept)
        while self.shm is None:
            Packed._count += 1
            name = f"{SEGMENT_PREFIX}{os.getpid()}_{Packed._count}"
            try:
                self.shm = SharedMemory(name=name, create=True, size=nbytes)  # mode 0600
            except FileExistsError:  # left by a dead process that had this pid: not ours
                continue
        self.flat = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=nbytes)
        return self.flat

    def fill(self, entries: Sequence[Entry], tensors: Iterable[torch.Tensor]) -> None:
        """Each tensor copied (cast) to its place; the gather yields them in entry order."""
        assert self.flat is not None
        for e, t in zip(entries, tensors, strict=True):
            view_of(self.flat, e).copy_(t)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the engine reads it next

    def close(self) -> None:
        """Drop the buffer; the segment is unlinked (an engine still mapping it keeps its pages
        until it unmaps)."""
        self.flat = None  # the buffer export goes before the segment closes
        if self.shm is not None:
            shm, self.shm = self.shm, None
            try:
                shm.close()
            except BufferError:  # a view still alive (a failed sync's frame): unmapped with it
                pass
            try:
                shm.unlink()
            except FileNotFoundError:
                pass


def view_of(flat: torch.Tensor, e: Entry) -> torch.Tensor:
    dtype = dtype_from_name(e.dtype)
    return flat[e.offset:e.offset + e.nbytes].view(dtype).view(e.shape)


def tensor_body(serialized: list[str], load_format: str | None, weight_version: str,
                flush_cache: bool) -> dict[str, Any]:
    """The body of SGLang's /update_weights_from_tensor (io_struct.py
    UpdateWeightsFromTensorReqInput): one serialized entry per TP rank of the engine."""
    return {"serialized_named_tensors": serialized, "load_format": load_format,
            "flush_cache": flush_cache, "abort_all_requests": False,
            "weight_version": weight_version}


# -- the built-in engine's form (msgpack, plain values only) ------------------------------------

def encode_handles(entries: Sequence[Entry], *, segment: str | None = None,
                   segment_size: int = 0, cuda: dict[str, Any] | None = None) -> str:
    """base64(msgpack) of the table and its buffer's handle: a segment name (CPU), or the CUDA
    IPC fields of `cuda_handle` (GPU)."""
    body: dict[str, Any] = {"tensors": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes]
                                        for e in entries]}
    if cuda is not None:
        body.update(kind="cuda", cuda=cuda)
    else:
        body.update(kind="shm", segment=segment, size=segment_size)
    return base64.b64encode(msgpack.packb(body, use_bin_type=True)).decode("ascii")


def cuda_handle(flat: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC fields of `flat`'s storage (torch's `_share_cuda_`), and its device's
    UUID so that the engine finds the same GPU whatever its device numbering."""
    (device, handle, size, offset, ref_handle, ref_offset, event_handle,
     event_sync) = flat.untyped_storage()._share_cuda_()
    return {"device_uuid": str(torch.cuda.get_device_properties(device).uuid),
            "handle": bytes(handle), "size": int(size), "offset": int(offset),
            "ref_counter_handle": bytes(ref_handle), "ref_counter_offset": int(ref_offset),
            "event_handle": bytes(event_handle) if event_handle is not None else b"",
            "event_sync_required": bool(event_sync), "storage_offset": flat.storage_offset()}


def decode_handles(payload: Any) -> dict[str, Any]:
    """One `serialized_named_tensors` entry in rollmesh's form, checked field by field; a
    WeightUpdateError names what is wrong. Nothing but msgpack is read."""
    if not isinstance(payload, str) or len(payload) > _MAX_PAYLOAD:
        raise WeightUpdateError("serialized_named_tensors: expected base64 strings")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise WeightUpdateError(f"serialized_named_tensors: not base64: {e}") from None
    if raw[:1] == b"\x80":  # protocol 2+ pickles start with PROTO
        raise WeightUpdateError(
            f"serialized_named_tensors holds a pickle: the built-in engine reads no pickle "
            f"(send load_format {LOAD_FORMAT!r})")
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad bytes
        raise WeightUpdateError(f"serialized_named_tensors: not msgpack: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("tensors"), list):
        raise WeightUpdateError("handle table: expected a map with a `tensors` list")
    entries = []
    for row in body["tensors"]:
        if not (isinstance(row, list) and len(row) == 5):
            raise WeightUpdateError(f"handle table row {row!r}: expected "
                                    "[name, dtype, shape, offset, nbytes]")
        name, dtype, shape, offset, nbytes = row
        if not isinstance(name, str) or not isinstance(shape, list) or not all(
                _is_int(x) and x >= 0 for x in [*shape, offset, nbytes]):
            raise WeightUpdateError(f"handle table row {row!r}: bad name, shape, offset or size")
        want = math.prod(shape) * torch.empty((), dtype=dtype_from_name(dtype)).element_size()
        if nbytes != want:
            raise WeightUpdateError(f"weight {name!r}: {nbytes} bytes for shape {shape} of "
                                    f"{dtype} (expected {want})")
        if offset % ALIGN:
            raise WeightUpdateError(f"weight {name!r}: offset {offset} not a multiple of {ALIGN}")
        entries.append(Entry(name, dtype, tuple(shape), offset, nbytes))
    kind = body.get("kind")
    if kind == "shm":
        segment = body.get("segment")
        if not isinstance(segment, str) or not _SEGMENT_NAME.fullmatch(segment):
            raise WeightUpdateError(
                f"segment {segment!r}: not a rollmesh segment name "
                f"({SEGMENT_PREFIX}<pid>_<n>, no path)")
        return {"kind": kind, "segment": segment, "entries": entries}
    if kind == "cuda":
        cuda = body.get("cuda")
        fields = {"device_uuid": str, "handle": bytes, "size": int, "offset": int,
                  "ref_counter_handle": bytes, "ref_counter_offset": int, "event_handle": bytes,
                  "event_sync_required": bool, "storage_offset": int}
        if not isinstance(cuda, dict) or any(not isinstance(cuda.get(k), t)
                                             for k, t in fields.items()):
            raise WeightUpdateError(f"cuda handle: expected the fields {sorted(fields)}")
        return {"kind": kind, "cuda": cuda, "entries": entries}
    raise WeightUpdateError(f"handle table kind {kind!r}: expected 'shm' or 'cuda'")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_bounds(entries: Sequence[Entry], size: int, what: str) -> None:
    for e in entries:
        if e.offset + e.nbytes > size:
            raise WeightUpdateError(f"weight {e.name!r}: bytes {e.offset}..{e.offset + e.nbytes} "
                                    f"lie past the end of the {what} ({size} bytes)")


@torch.no_grad()
def load_from_handles(model: torch.nn.Module, table: dict[str, Any]) -> int:
    """Check everything, then copy each tensor of `table` (`decode_handles`) into the model.
    Raises WeightUpdateError, model untouched, for any table that does not fit it."""
    entries: list[Entry] = table["entries"]
    check_update(model, [e.name for e in entries], [e.shape for e in entries],
                 [e.dtype for e in entries])
    if table["kind"] == "shm":
        with _mapped(table["segment"], entries) as flat:
            return _copy_in(model, flat, entries)
    flat = _open_cuda(table["cuda"])
    _check_bounds(entries, flat.numel(), "CUDA buffer")
    n = _copy_in(model, flat, entries)
    torch.cuda.current_stream(flat.device).synchronize()  # done reading before the sender reuses it
    return n


def _copy_in(model: torch.nn.Module, flat: torch.Tensor, entries: Sequence[Entry]) -> int:
    targets = model_tensors(model)
    for e in entries:
        targets[e.name].copy_(view_of(flat, e))
    return len(entries)


# The engine's mapping of the trainer's segment, kept from sync to sync (its page tables stay
# filled: a sync reads at memory speed), replaced when the trainer's segment changes.
_MAPPED: dict[str, tuple[tuple[int, int], torch.Tensor]] = {}


@contextlib.contextmanager
def _mapped(segment: str, entries: Sequence[Entry]) -> Iterator[torch.Tensor]:
    """The segment mapped read-only (the trainer's bytes are never written), bounds-checked
    against its real size."""
    path = os.path.join(SHM_DIR, segment)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise WeightUpdateError(f"segment {segment!r}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        _check_bounds(entries, st.st_size, f"segment {segment!r}")
        key = (st.st_ino, st.st_size)
        cached = _MAPPED.get(segment)
        if cached is None or cached[0] != key:
            _MAPPED.clear()  # the trainer's old segment: its pages go with the last view
            if not st.st_size:
                yield torch.empty(0, dtype=torch.uint8)
                return
            with warnings.catch_warnings():  # read-only on purpose: only ever read
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ),
                                        dtype=torch.uint8)
            cached = _MAPPED[segment] = (key, flat)
    finally:
        os.close(fd)
    yield cached[1]


def _open_cuda(c: dict[str, Any]) -> torch.Tensor:
    """The sender's flat CUDA buffer, opened from its IPC fields as torch's
    rebuild_cuda_tensor opens a storage (`UntypedStorage._new_shared_cuda`)."""
    if not torch.cuda.is_available():
        raise WeightUpdateError("a CUDA handle sent to an engine without CUDA")
    devices = [i for i in range(torch.cuda.device_count())
               if str(torch.cuda.get_device_properties(i).uuid) == c["device_uuid"]]
    if not devices:
        raise WeightUpdateError(f"cuda handle: no local GPU has UUID {c['device_uuid']!r}")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        devices[0], c["handle"], c["size"], c["offset"], c["ref_counter_handle"],
        c["ref_counter_offset"], c["event_handle"], c["event_sync_required"])
    if not 0 <= c["storage_offset"] <= storage.nbytes():
        raise WeightUpdateError(f"cuda handle: storage_offset {c['storage_offset']} outside "
                                f"the shared storage ({storage.nbytes()} bytes)")
    # as torch._utils._rebuild_tensor views a storage: an empty tensor set_ onto it
    flat = torch.empty((0,), dtype=torch.uint8, device=f"cuda:{devices[0]}")
    return flat.set_(storage, c["storage_offset"], (storage.nbytes() - c["storage_offset"],),
                     (1,))


# -- SGLang's form (written, never read) ---------------------------------------------------------

def sglang_payload(named: Sequence[tuple[str, torch.Tensor]], tp_size: int = 1) -> list[str]:
    """SGLang 0.5.23's `serialized_named_tensors` for `load_format` None: per TP rank, base64
    of `MultiprocessingSerializer.serialize([(name, tensor), ...])`, i.e. a ForkingPickler dump
    whose CUDA tensors reduce with torch's `reduce_tensor`, the device index replaced by the
    device's UUID (`monkey_patch_torch_reductions`). Each tensor is a view of the one shared
    buffer, so an engine opens one IPC handle."""
    table = copyreg.dispatch_table.copy()
    table.update(ForkingPickler._extra_reducers)
    table[torch.Tensor] = table[torch.nn.Parameter] = _reduce_by_uuid
    payload = []
    # one dump per rank: each reduction takes its own IPC reference, which the rank that
    # opens it releases (SGLang's deserialize_own_rank reads only its own entry)
    for _ in range(tp_size):
        buf = io.BytesIO()
        pickler = ForkingPickler(buf)
        pickler.dispatch_table = table
        pickler.dump([(name, t) for name, t in named])
        payload.append(base64.b64encode(buf.getvalue()).decode("ascii"))
    return payload


def _reduce_by_uuid(t: torch.Tensor) -> tuple[Any, tuple]:
    from torch.multiprocessing.reductions import reduce_tensor

    if not t.is_cuda:
        raise ValueError("SGLang's update_weights_from_tensor payload needs CUDA tensors")
    fn, args = reduce_tensor(t)
    uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
    return fn, (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1:])


# -- the trainer's choice ------------------------------------------------------------------------

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}


def on_host(url: str, address: str) -> bool:
    """Whether the engine at `url` runs on this host: a loopback URL, or one naming the
    trainer's own `weight_sync_address` (the address the launcher gives rank 0)."""
    from urllib.parse import urlsplit

    host = urlsplit(url if "//" in url else f"http://{url}").hostname or ""
    return host in _LOOPBACK or host.startswith("127.") or host == address


def choose_transport(setting: str, engines: Sequence[str], address: str, engine_kind: str,
                     device: torch.device) -> str:
    """`sync.transport` resolved: "broadcast" or "handles". An explicit "handles" that cannot
    work here is a ValueError naming why; "auto" falls back to broadcast."""
    if setting == "broadcast":
        return "broadcast"
    remote = [u for u in engines if not on_host(u, address)]
    why = (f"engines {remote} are not on the trainer's host ({address})" if remote
           else "SGLang engines take handles only from a GPU trainer (CUDA IPC)"
           if engine_kind == "sglang" and device.type != "cuda" else None)
    if setting == "auto":
        return "broadcast" if why else "handles"
    if setting != "handles":
        raise ValueError(f"sync.transport {setting!r}: expected auto, broadcast or handles")
    if why:
        raise ValueError(f"sync.transport = \"handles\": {why}; use broadcast or auto")
    return "handles"
