"""The bytes of checkpoint format 2: a streaming safetensors writer, the index of a sharded
checkpoint (built, and checked as untrusted input), and reads of one region of a tensor.

`write_safetensors` writes the safetensors layout itself (8-byte little-endian header length,
the JSON header, then each tensor's raw bytes in order), one tensor at a time from an iterator,
hashing while it writes: no whole-file buffer in memory (safetensors' `save_file` builds one).

`index.json` (see `rollmesh.training.checkpoint`) says, for every tensor, its full shape and dtype
and the pieces that tile it: `{"file": "rank_<r>.safetensors", "offset": [...], "shape": [...]}`,
each piece a box at a global offset, stored under the tensor's own name in that file. `Index`
refuses (ValueError naming the file and what is wrong) anything but plain rank file names in
the directory, dtypes of `DTYPES`, and pieces that tile the tensor exactly. `read_region` reads
the part of a tensor a rank holds from just the overlapping parts of the pieces (`get_slice`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

INDEX = "index.json"
SYNC_EVERY = 256 << 20  # bytes written between flushes to disk (`write_safetensors`)
RANK_FILE = re.compile(r"rank_(0|[1-9][0-9]{0,5})\.safetensors")
# safetensors' dtype names <-> torch (the allow-list of an index)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def rank_file(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise TypeError(f"no safetensors dtype for {dtype}")
    return DTYPE_NAMES[dtype]


# -- write -----------------------------------------------------------------------------------------


def write_safetensors(path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      tensors: Iterable[torch.Tensor], *, fsync: bool = True,
                      metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write `tensors` (CPU, one per spec, in order: name, dtype, shape) to `path` as
    safetensors, streaming; returns (bytes written, sha256 hex of the file). `fsync`: on disk
    when it returns, flushed every `SYNC_EVERY` bytes on the way and dropped from the page
    cache."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    at = 0
    for name, dtype, shape in specs:
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape),
                        "data_offsets": [at, at + size]}
        at += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    digest = hashlib.sha256()
    written = synced = 0
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            digest.update(chunk)
            written += len(chunk)
        it: Iterator[torch.Tensor] = iter(tensors)
        for name, dtype, shape in specs:
            t = next(it, None)
            if t is None:
                raise ValueError(f"{path}: no tensor for {name}")
            if t.dtype != dtype or tuple(t.shape) != tuple(shape) or t.device.type != "cpu":
                raise ValueError(f"{path}: {name} is {t.dtype} {tuple(t.shape)} on {t.device}, "
                                 f"the header says {dtype} {tuple(shape)} on cpu")
            if t.numel():
                data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                f.write(data)
                digest.update(data)
                written += len(data)
                if fsync and written - synced >= SYNC_EVERY:
                    synced = _drop_written(f, written)
            del t
        if next(it, None) is not None:
            raise ValueError(f"{path}: more tensors than specs")
        f.flush()
        if fsync:
            os.fsync(f.fileno())
            _drop_written(f, written)
    return written, digest.hexdigest()


def _drop_written(f: Any, written: int) -> int:
    """Flush what is written to disk and drop it from the page cache: a checkpoint's many GB of
    dirty pages would otherwise squeeze the trainer's memory and stall it in reclaim."""
    f.flush()
    os.fdatasync(f.fileno())
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, written, os.POSIX_FADV_DONTNEED)
    return written


def check_written(path: Path, size: int, names: Iterable[str]) -> None:
    """What `write_safetensors` wrote is there: its size, and a header listing `names`."""
    on_disk = path.stat().st_size
    if on_disk != size:
        raise OSError(f"{path}: {on_disk} bytes on disk, {size} written")
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
    if keys != set(names):
        raise OSError(f"{path}: the header lists {len(keys)} tensors, {len(set(names))} written")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# -- the index -------------------------------------------------------------------------------------


def _ints(value: Any, what: str, n: int | None = None) -> tuple[int, ...]:
    if (not isinstance(value, list) or (n is not None and len(value) != n)
            or not all(type(v) is int and v >= 0 for v in value)):
        raise ValueError(f"{what}: expected a list of {'' if n is None else n} "
                         f"non-negative integers, got {value!r}"[:300])
    return tuple(value)


def _overlap(a: tuple[tuple[int, ...], tuple[int, ...]],
             b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(*a, *b))


class Index:
    """A checked index.json: `tensors[name] = (shape, dtype, [(file, offset, shape)])`,
    `files[file] = (size, sha256)`."""

    def __init__(self, data: Any, where: str = INDEX):
        def bad(what: str) -> ValueError:
            return ValueError(f"{where}: {what}")

        if not isinstance(data, dict) or data.get("format") != 2:
            raise bad("not a format-2 checkpoint index")
        files, tensors = data.get("files"), data.get("tensors")
        if not isinstance(files, dict) or not isinstance(tensors, dict):
            raise bad("'files' and 'tensors' must be objects")
        self.files: dict[str, tuple[int, str]] = {}
        for name, entry in files.items():
            if not isinstance(name, str) or not RANK_FILE.fullmatch(name):
                raise bad(f"file name {name!r} is not rank_<r>.safetensors")
            if (not isinstance(entry, dict) or type(entry.get("size")) is not int
                    or entry["size"] < 8 or not isinstance(entry.get("sha256"), str)
                    or not re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
                raise bad(f"file {name}: expected a size and a sha256")
            self.files[name] = (entry["size"], entry["sha256"])
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype,
                                      list[tuple[str, tuple[int, ...], tuple[int, ...]]]]] = {}
        for name, entry in tensors.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("pieces"), list):
                raise bad(f"tensor {name!r}: expected shape, dtype and pieces")
            shape = _ints(entry.get("shape"), f"{where}: tensor {name!r} shape")
            if entry.get("dtype") not in DTYPES:
                raise bad(f"tensor {name!r}: dtype {entry.get('dtype')!r} is not one of "
                          f"{sorted(DTYPES)}")
            pieces = []
            for p in entry["pieces"]:
                if not isinstance(p, dict) or p.get("file") not in self.files:
                    raise bad(f"tensor {name!r}: a piece names no listed file: {p!r}"[:300])
                off = _ints(p.get("offset"), f"{where}: tensor {name!r} offset", len(shape))
                sub = _ints(p.get("shape"), f"{where}: tensor {name!r} piece shape", len(shape))
                if any(o + s > d for o, s, d in zip(off, sub, shape)):
                    raise bad(f"tensor {name!r}: piece {off} + {sub} out of bounds {shape}")
                if math.prod(sub) == 0:
                    raise bad(f"tensor {name!r}: an empty piece")
                pieces.append((p["file"], off, sub))
            _check_tiling(name, shape, pieces, bad)
            self.tensors[name] = (shape, DTYPES[entry["dtype"]], pieces)

    @classmethod
    def read(cls, directory: Path) -> Index:
        path = directory / INDEX
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        return cls(data, str(path))


def _check_tiling(name: str, shape: tuple[int, ...], pieces: list, bad: Any) -> None:
    """The pieces cover the tensor exactly: their volumes add up to it and none overlap."""
    total = sum(math.prod(s) for _, _, s in pieces)
    if total != math.prod(shape):
        raise bad(f"tensor {name!r}: the pieces hold {total} elements, the shape {shape} "
                  f"{math.prod(shape)} (a gap or an overlap)")
    boxes = [(o, s) for _, o, s in pieces]
    if shape and all(o[1:] == (0,) * (len(shape) - 1) and s[1:] == shape[1:] for o, s in boxes):
        boxes.sort()  # row blocks (FSDP2's Shard(0)): each starts where the one before ends
        for (o, s), (o2, _) in zip(boxes, boxes[1:]):
            if o[0] + s[0] != o2[0]:
                raise bad(f"tensor {name!r}: rows {o[0]}..{o[0] + s[0]} then {o2[0]} "
                          "(a gap or an overlap)")
        return
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if _overlap(a, b):
                raise bad(f"tensor {name!r}: pieces at {a[0]} and {b[0]} overlap")


def index_data(pieces: dict[str, dict[str, Any]], files: dict[str, tuple[int, str]],
               world: int) -> dict[str, Any]:
    """index.json's content from every rank's pieces (`tensor -> {shape, dtype, pieces}`)."""
    return {"format": 2, "world_size": world,
            "files": {f: {"size": size, "sha256": sha} for f, (size, sha) in sorted(files.items())},
            "tensors": pieces}


# -- read ------------------------------------------------------------------------------------------


class Reader:
    """Reads regions of a format-2 checkpoint's tensors, opening each rank file once."""

    def __init__(self, directory: Path, index: Index):
        self.directory, self.index = directory, index
        self._open: dict[str, tuple[Any, set[str]]] = {}

    def _file(self, name: str) -> tuple[Any, set[str]]:
        if name not in self._open:
            f = safe_open(self.directory / name, framework="pt")
            self._open[name] = (f, set(f.keys()))
        return self._open[name]

    def close(self) -> None:
        self._open.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.index.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.index.tensors[name][0]

    def read_region(self, name: str, offset: tuple[int, ...], shape: tuple[int, ...],
                    ) -> torch.Tensor:
        """The box of tensor `name` at global `offset` of `shape`, from the parts of the
        pieces that overlap it (only those bytes are read)."""
        full, dtype, pieces = self.index.tensors[name]
        if len(offset) != len(full) or any(o + s > d for o, s, d in zip(offset, shape, full)):
            raise ValueError(f"{self.directory}: {name} is {full}, asked for {shape} at {offset}")
        out = torch.empty(shape, dtype=dtype)
        if out.numel() == 0:
            return out
        for file, p_off, p_shape in pieces:
            lo = [max(a, b) for a, b in zip(offset, p_off)]
            hi = [min(a + s, b + t) for a, s, b, t in zip(offset, shape, p_off, p_shape)]
            if any(h <= the_lo for h, the_lo in zip(hi, lo)):
                continue
            f, keys = self._file(file)
            if name not in keys:
                raise ValueError(f"{self.directory / file}: lacks {name}")
            sl = f.get_slice(name)
            if tuple(sl.get_shape()) != p_shape or sl.get_dtype() != dtype_name(dtype):
                raise ValueError(f"{self.directory / file}: {name} is {sl.get_dtype()} "
                                 f"{sl.get_shape()}, the index says {dtype_name(dtype)} "
                                 f"{list(p_shape)}")
            src = (sl[tuple(slice(a - b, h - b) for a, h, b in zip(lo, hi, p_off))]
                   if full else f.get_tensor(name))
            out[tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, offset))] = src
        return out
