"""The wire protocol: how a record becomes ZeroMQ frames and back, strictly.

The records every role exchanges are declared in `rollmesh.wire.messages` (with `record`).

A message is a list of ZeroMQ frames:

    [type name (ascii), msgpack body, buffer 0, buffer 1, ...]

The body is a msgpack map of the record's fields. Numeric arrays (token ids, log-probs,
versions, masks) never go inside it: each array is replaced by a small msgpack extension
(frame index, dtype name, shape) and its raw little-endian bytes travel as one extra frame, so
both ends touch the bytes once (zero-copy on decode: the array is a read-only view of the
received frame). Dtypes numpy lacks (bfloat16, float8) are carried by name through ml_dtypes.

A `Framed` record (a Group) nested in another travels as its own frames, appended to the
message: [type, body, *buffers] exactly as `encode` makes them for it alone, referenced from the
body by a second extension (first frame, frame count). A broker keeps a group as the frames it
came in and sends them on, to its log or to a consumer, without decoding and encoding it again:
a record decoded from frames remembers them (`frames_of`), and `encode` sends those.

Decoding is strict and never trusts a declared size: an unknown type, a missing or extra field,
a wrong type, a frame count or array size that does not match the header each raise
`ProtocolError` with the reason. Nothing here can make a process run code (no pickle).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Callable, Literal, Sequence, Union

import ml_dtypes
import msgpack
import numpy as np

PROTOCOL_VERSION = 2  # 2: Scored carries only what the reward worker adds, PutGroupsReply.dropped_stale, no PutGroup/GetBatch

_ARRAY_EXT = 1
_RECORD_EXT = 2  # a Framed record nested as its own frames: [first frame, frame count]
MAX_NESTING = 2  # framed records within framed records, at most
MAX_FRAMES = 4096  # buffers in one message: far above any record, small enough to stay cheap
MAX_NDIM = 32
MAX_BODY_BYTES = 16 << 20  # the msgpack body holds no bulk data; arrays travel as frames

# Every dtype that may cross the wire, by name; decoded arrays get exactly these dtypes.
WIRE_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<") if np.dtype(name).itemsize > 1 else np.dtype(name)
    for name in (
        "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "float32", "float64",
    )
}
WIRE_DTYPES.update(
    bfloat16=np.dtype(ml_dtypes.bfloat16),
    float8_e4m3fn=np.dtype(ml_dtypes.float8_e4m3fn),
    float8_e5m2=np.dtype(ml_dtypes.float8_e5m2),
)


class ProtocolError(ValueError):
    """A message that does not match the protocol. Carries the reason; never fatal to a role."""


Frame = Union[bytes, memoryview, Any]  # anything with the buffer protocol (zmq.Frame included)


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------

RECORDS: dict[str, type] = {}


class Framed:
    """Base of the records that travel nested as their own frames (see the module doc).

    A Framed record decoded from frames keeps them (the `_frames` slot, not a field: not on the
    wire, not compared) and `encode` sends exactly those again: a decoded record is read, not
    changed (make a new one with dataclasses.replace, which keeps nothing)."""

    __slots__ = ("_frames",)


def record(cls: type) -> type:
    """Declare a wire record: a dataclass whose field types are checked on decode."""
    cls = dataclasses.dataclass(slots=True)(cls)
    name = cls.__name__
    if name in RECORDS:
        raise TypeError(f"duplicate wire record {name}")
    RECORDS[name] = cls
    cls._wire_name = name.encode()  # type: ignore[attr-defined]
    return cls


# --------------------------------------------------------------------------------------------
# Schemas: a checker per field, compiled once from the type hints
# --------------------------------------------------------------------------------------------

Checker = Callable[[Any, str], Any]


def _fail(path: str, expected: str, got: Any) -> ProtocolError:
    kind = type(got).__name__
    if isinstance(got, np.ndarray):
        kind = f"array of {got.dtype.name}"
    return ProtocolError(f"{path}: expected {expected}, got {kind}")


def _check_int(v: Any, path: str) -> int:
    if type(v) is not int:
        raise _fail(path, "int", v)
    return v


def _check_float(v: Any, path: str) -> float:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise _fail(path, "float", v)


def _check_str(v: Any, path: str) -> str:
    if type(v) is not str:
        raise _fail(path, "str", v)
    return v


def _check_bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise _fail(path, "bool", v)
    return v


def _check_bytes(v: Any, path: str) -> bytes:
    if type(v) is not bytes:
        raise _fail(path, "bytes", v)
    return v


def _check_array(v: Any, path: str) -> np.ndarray:
    if not isinstance(v, np.ndarray):
        raise _fail(path, "array", v)
    return v


def _check_plain(v: Any, path: str) -> Any:
    """Plain msgpack data (`Any` fields): no arrays, string map keys."""
    if v is None or type(v) in (bool, int, float, str, bytes):
        return v
    if type(v) is list:
        return [_check_plain(x, f"{path}[{i}]") for i, x in enumerate(v)]
    if type(v) is dict:
        for k, x in v.items():
            if type(k) is not str:
                raise ProtocolError(f"{path}: map keys must be str, got {type(k).__name__}")
            _check_plain(x, f"{path}.{k}")
        return v
    raise _fail(path, "plain data", v)


_SCALARS: dict[Any, Checker] = {
    int: _check_int, float: _check_float, str: _check_str, bool: _check_bool,
    bytes: _check_bytes, np.ndarray: _check_array, Any: _check_plain,
}


def _checker(tp: Any) -> Checker:
    if tp in _SCALARS:
        return _SCALARS[tp]
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        inner = _checker(options[0]) if len(options) == 1 else None
        if inner is None:
            raise TypeError(f"unsupported union {tp}")

        def check_optional(v: Any, path: str) -> Any:
            return None if v is None else inner(v, path)

        return check_optional
    if origin is list:
        item = _checker(args[0])

        def check_list(v: Any, path: str) -> list:
            if type(v) is not list:
                raise _fail(path, "list", v)
            return [item(x, f"{path}[{i}]") for i, x in enumerate(v)]

        return check_list
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"map keys must be str in {tp}")
        value = _checker(args[1])

        def check_dict(v: Any, path: str) -> dict:
            if type(v) is not dict:
                raise _fail(path, "map", v)
            out = {}
            for k, x in v.items():
                if type(k) is not str:
                    raise ProtocolError(f"{path}: map keys must be str, got {type(k).__name__}")
                out[k] = value(x, f"{path}.{k}")
            return out

        return check_dict
    if origin is Literal:
        choices = args

        def check_literal(v: Any, path: str) -> Any:
            if v not in choices or type(v) not in {type(c) for c in choices}:
                raise ProtocolError(f"{path}: expected one of {list(choices)}, got {v!r}")
            return v

        return check_literal
    if isinstance(tp, type) and tp.__name__ in RECORDS and RECORDS[tp.__name__] is tp:
        if issubclass(tp, Framed):
            def check_framed(v: Any, path: str) -> Any:
                if type(v) is tp:  # decoded from its own frames (strictly), by ext_hook
                    return v
                return _build(tp, v, path)  # a map in the body: checked as any record

            return check_framed
        return lambda v, path: _build(tp, v, path)
    raise TypeError(f"unsupported wire field type {tp!r}")


@dataclasses.dataclass(frozen=True)
class _Schema:
    fields: tuple[tuple[str, Checker], ...]
    required: frozenset[str]
    names: frozenset[str]
    # (name, exact type, checker): a value of exactly that type passes without the checker's
    # call (the decode fast path); anything else goes through the checker, errors and all.
    fast: tuple[tuple[str, Any, Checker], ...] = ()


_FAST_TYPES = (int, float, str, bool, bytes, np.ndarray)


def _fast_type(tp: Any) -> Any:
    """The one type a field's values have in the common case, or None (always check)."""
    if tp in _FAST_TYPES:
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(options) == 1 and options[0] in _FAST_TYPES:
            return options[0]
    return None


_SCHEMAS: dict[type, _Schema] = {}


def _schema(cls: type) -> _Schema:
    schema = _SCHEMAS.get(cls)
    if schema is None:
        hints = typing.get_type_hints(cls)
        fields = dataclasses.fields(cls)
        schema = _Schema(
            fields=tuple((f.name, _checker(hints[f.name])) for f in fields),
            required=frozenset(
                f.name for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            ),
            names=frozenset(f.name for f in fields),
            fast=tuple((f.name, _fast_type(hints[f.name]), _checker(hints[f.name]))
                       for f in fields),
        )
        _SCHEMAS[cls] = schema
    return schema


def _build(cls: type, body: Any, path: str) -> Any:
    if type(body) is not dict:
        raise _fail(path, f"a map for {cls.__name__}", body)
    schema = _SCHEMAS.get(cls) or _schema(cls)
    if body.keys() == schema.names:  # every field present (what encode sends): no set algebra
        kwargs = {}
        for name, fast, check in schema.fast:
            v = body[name]
            kwargs[name] = v if type(v) is fast else check(v, f"{path}.{name}")
        return cls(**kwargs)
    extra = body.keys() - schema.names
    if extra:
        raise ProtocolError(f"{path}: unknown field(s) {sorted(map(str, extra))} for {cls.__name__}")
    missing = schema.required - body.keys()
    if missing:
        raise ProtocolError(f"{path}: missing field(s) {sorted(missing)} for {cls.__name__}")
    kwargs = {}
    for name, check in schema.fields:
        if name in body:
            kwargs[name] = check(body[name], f"{path}.{name}")
    return cls(**kwargs)


def check_schemas() -> None:
    """Compile every record's schema; raises TypeError for an unsupported field type."""
    for cls in RECORDS.values():
        _schema(cls)


# --------------------------------------------------------------------------------------------
# Encode
# --------------------------------------------------------------------------------------------


def _as_numpy(obj: Any) -> np.ndarray | None:
    """numpy arrays as they are; torch tensors (any dtype, bf16 included) as numpy views."""
    if isinstance(obj, np.ndarray):
        return obj
    if type(obj).__module__ == "torch" and type(obj).__name__ in ("Tensor", "Parameter"):
        import torch

        t = obj.detach().cpu().contiguous()
        special = {torch.bfloat16: ml_dtypes.bfloat16, torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
                   torch.float8_e5m2: ml_dtypes.float8_e5m2}
        if t.dtype in special:
            bits = torch.int16 if t.dtype == torch.bfloat16 else torch.uint8
            return t.view(bits).numpy().view(special[t.dtype])
        return t.numpy()
    return None


# The wire dtypes as numpy has them in memory -> their wire names. A dict lookup: numpy's
# `dtype.name` costs microseconds, and encode asks it for every array.
_DTYPE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
# msgpack.ExtType without its constructor's argument checks (ours are an int and bytes)
_ext = functools.partial(tuple.__new__, msgpack.ExtType)


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _received_frame(arr: np.ndarray) -> Any:
    """The received ZeroMQ frame that `arr` views whole, or None.

    A record decoded by a broker (the MessageQueue) and sent on holds views of the frames it
    came in; sending those frames themselves costs ZeroMQ a reference count where sending the
    arrays costs a copy. `arr` is C-contiguous here, so a view of as many bytes as the frame
    holds is the frame, byte for byte.
    """
    base = arr.base
    while type(base) is np.ndarray:
        base = base.base
    if type(base) is memoryview and base.nbytes == arr.nbytes:
        frame = base.obj
        if type(frame).__module__.startswith("zmq") and hasattr(frame, "buffer"):
            return frame
    return None


def frames_of(rec: Any) -> list[Frame] | None:
    """The frames a Framed record was decoded from (what `encode` sends for it), or None."""
    return getattr(rec, "_frames", None)


def keep_frames(rec: Framed) -> list[Frame]:
    """The record's frames, encoded now if it has none, and kept with it from now on: the
    record is then what those frames say, whatever happens to its fields later."""
    frames = getattr(rec, "_frames", None)
    if frames is None:
        frames = rec._frames = encode(rec)
    return frames


def encode(rec: Any) -> list[Frame]:
    """Record -> frames. Arrays are referenced, not copied, where they are contiguous; a Framed
    record decoded from frames is those frames again."""
    cls = type(rec)
    name = getattr(cls, "_wire_name", None)
    if name is None or RECORDS.get(cls.__name__) is not cls:
        raise ProtocolError(f"not a wire record: {cls.__name__}")
    kept = getattr(rec, "_frames", None) if isinstance(rec, Framed) else None
    if kept is not None:
        return list(kept)
    buffers: list[Any] = []
    meta_packer = msgpack.Packer(use_bin_type=True)  # one per call: encode may run in threads

    def default(obj: Any) -> Any:
        kind = type(obj)
        if kind is np.ndarray:
            arr = obj
        elif getattr(kind, "_wire_name", None) is not None and RECORDS.get(kind.__name__) is kind:
            if isinstance(obj, Framed):  # its own frames, appended: [type, body, *buffers]
                frames = encode(obj)
                first = len(buffers)
                buffers.extend(frames)
                return _ext((_RECORD_EXT, meta_packer.pack([first, len(frames)])))
            return {f: getattr(obj, f) for f in _field_names(kind)}  # a nested record
        else:
            arr = _as_numpy(obj)
        if arr is not None:
            dtype_name = _DTYPE_NAMES.get(arr.dtype)
            if dtype_name is None:  # not a wire dtype as stored: big-endian, or refused
                dtype_name = arr.dtype.name
                if dtype_name not in WIRE_DTYPES:
                    raise ProtocolError(f"dtype {dtype_name} cannot travel on the wire")
                if arr.dtype.byteorder == ">":
                    arr = arr.astype(arr.dtype.newbyteorder("<"))
            shape = list(arr.shape)  # before ascontiguousarray, which makes 0-d arrays 1-d
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)
            frame = _received_frame(arr) if arr.base is not None else None
            buffers.append(arr.reshape(-1).view(np.uint8) if frame is None else frame)
            return _ext((_ARRAY_EXT, meta_packer.pack([len(buffers) - 1, dtype_name, shape])))
        if dataclasses.is_dataclass(obj) and type(obj).__name__ in RECORDS:
            return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        if isinstance(obj, tuple):
            return list(obj)
        if isinstance(obj, np.generic):
            return obj.item()
        raise ProtocolError(f"cannot encode {type(obj).__name__}")

    body = msgpack.packb(
        {f: getattr(rec, f) for f in _field_names(cls)}, default=default, use_bin_type=True,
    )
    return [name, body, *buffers]


# --------------------------------------------------------------------------------------------
# Decode
# --------------------------------------------------------------------------------------------


def _buffer(frame: Frame) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    view = buf if type(buf) is memoryview else memoryview(buf if buf is not None else frame)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view  # already bytes, as a received frame is: no second view
    return view.cast("B")


# Array headers already checked -> (frame index, dtype, shape (None: 1-d), bytes expected).
# The same few headers come in every message of a stream (the same fields, dtypes, lengths):
# each is parsed and checked once, then found by its bytes. Bounded: cleared when full.
_ARRAY_HEADERS: dict[bytes, tuple[int, np.dtype, tuple[int, ...] | None, int]] = {}
_ARRAY_HEADERS_MAX = 4096


def _array_header(data: bytes) -> tuple[int, np.dtype, tuple[int, ...] | None, int]:
    """An array extension's header, checked (ProtocolError naming what is wrong)."""
    meta = msgpack.unpackb(data, use_list=True)
    if not (type(meta) is list and len(meta) == 3):
        raise ProtocolError("array header must be [frame, dtype, shape]")
    index, dtype_name, shape = meta
    if type(index) is not int or index < 0:
        raise ProtocolError(f"array refers to frame {index!r}")
    dtype = WIRE_DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise ProtocolError(f"array dtype {dtype_name!r} is not allowed on the wire")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise ProtocolError(f"bad array shape {shape!r}")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise ProtocolError(f"bad array shape {shape!r}")
        count *= d
    out = (index, dtype, None if len(shape) == 1 else tuple(shape), count * dtype.itemsize)
    if len(_ARRAY_HEADERS) >= _ARRAY_HEADERS_MAX:
        _ARRAY_HEADERS.clear()
    _ARRAY_HEADERS[bytes(data)] = out
    return out


def decode(frames: Sequence[Frame], expect: type | tuple[type, ...] | None = None) -> Any:
    """Frames -> record, or ProtocolError naming what is wrong. Never allocates by a header."""
    try:
        return _decode(frames, expect, 0)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack's own errors, malformed buffers: all are protocol errors
        raise ProtocolError(f"malformed message: {type(e).__name__}: {e}") from None


def _decode(frames: Sequence[Frame], expect: type | tuple[type, ...] | None,
            depth: int) -> Any:
    if len(frames) < 2:
        raise ProtocolError(f"expected at least 2 frames (type, body), got {len(frames)}")
    if len(frames) - 2 > MAX_FRAMES:
        raise ProtocolError(f"too many frames: {len(frames)} (at most {MAX_FRAMES + 2})")
    type_bytes = bytes(_buffer(frames[0])[:64])
    try:
        type_name = type_bytes.decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError(f"message type is not ascii: {type_bytes[:32]!r}") from None
    cls = RECORDS.get(type_name)
    if cls is None:
        raise ProtocolError(f"unknown message type {type_name[:40]!r}")
    if expect is not None and not issubclass(cls, expect):
        names = [c.__name__ for c in (expect if isinstance(expect, tuple) else (expect,))]
        raise ProtocolError(f"unexpected message {type_name}, expected {' or '.join(names)}")
    body = _buffer(frames[1])
    if body.nbytes > MAX_BODY_BYTES:
        raise ProtocolError(f"body of {body.nbytes} bytes exceeds {MAX_BODY_BYTES}")

    buffers = frames[2:]
    n_buffers = len(buffers)
    used = [False] * n_buffers

    def nested(data: bytes) -> Any:
        meta = msgpack.unpackb(data, use_list=True)
        if not (type(meta) is list and len(meta) == 2
                and type(meta[0]) is int and type(meta[1]) is int):
            raise ProtocolError("nested record header must be [first frame, frame count]")
        first, count = meta
        if not (0 <= first and 2 <= count and first + count <= n_buffers):
            raise ProtocolError(f"nested record in frames {first}..{first + count - 1}, "
                                f"message has {n_buffers}")
        if depth >= MAX_NESTING:
            raise ProtocolError(f"records nested deeper than {MAX_NESTING}")
        for i in range(first, first + count):
            if used[i]:
                raise ProtocolError(f"frame {i} referenced twice")
            used[i] = True
        sub = list(buffers[first:first + count])
        try:
            rec = _decode(sub, Framed, depth + 1)
        except ProtocolError as e:
            raise ProtocolError(f"nested record in frames {first}..{first + count - 1}: "
                                f"{e}") from None
        rec._frames = sub
        return rec

    def ext_hook(code: int, data: bytes) -> Any:
        if code == _RECORD_EXT:
            return nested(data)
        if code != _ARRAY_EXT:
            raise ProtocolError(f"unknown msgpack extension {code}")
        index, dtype, shape, expected = _ARRAY_HEADERS.get(data) or _array_header(data)
        if index >= n_buffers:
            raise ProtocolError(f"array refers to frame {index!r}, message has {n_buffers}")
        if used[index]:
            raise ProtocolError(f"array frame {index} referenced twice")
        used[index] = True
        buf = _buffer(buffers[index])
        if expected != buf.nbytes:
            raise ProtocolError(
                f"array frame {index} has {buf.nbytes} bytes, header says "
                f"{list(shape) if shape is not None else [expected // dtype.itemsize]} "
                f"{_DTYPE_NAMES.get(dtype, dtype.name)} = {expected}"
            )
        arr = np.frombuffer(buf, dtype=dtype)
        return arr if shape is None else arr.reshape(shape)

    obj = msgpack.unpackb(
        body, ext_hook=ext_hook, raw=False, strict_map_key=True, use_list=True,
    )
    if not all(used):
        raise ProtocolError(f"{used.count(False)} array frame(s) not referenced by the body")
    rec = _build(cls, obj, cls.__name__)
    if depth == 0 and isinstance(rec, Framed):
        rec._frames = list(frames)  # sent on as received (see Framed)
    return rec


def to_torch(arr: np.ndarray) -> Any:
    """A decoded array as a torch tensor (bf16/float8 included).

    Shares memory with a writable array; a read-only one (a view of a received frame) is
    copied first, since torch tensors assume they may be written.
    """
    import torch

    if not arr.flags.writeable:
        arr = arr.copy()

    special = {"bfloat16": (np.int16, torch.bfloat16), "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
               "float8_e5m2": (np.uint8, torch.float8_e5m2)}
    if arr.dtype.name in special:
        bits, tdtype = special[arr.dtype.name]
        return torch.from_numpy(arr.view(bits)).view(tdtype)
    return torch.from_numpy(arr)


check_schemas()
