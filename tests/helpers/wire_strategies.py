"""Hypothesis strategies for every wire record, derived from its type hints, and a deep compare."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

import numpy as np
from hypothesis import strategies as st

from rollmesh.wire.protocol import RECORDS, WIRE_DTYPES

_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=12) | st.binary(max_size=12),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@st.composite
def arrays(draw: Any) -> np.ndarray:
    dtype = WIRE_DTYPES[draw(st.sampled_from(sorted(WIRE_DTYPES)))]
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    raw = draw(st.binary(min_size=int(np.prod(shape)) * dtype.itemsize,
                         max_size=int(np.prod(shape)) * dtype.itemsize))
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def strategy(tp: Any) -> st.SearchStrategy:
    simple = {
        int: st.integers(-(2**63), 2**64 - 1), float: st.floats(allow_nan=False),
        str: st.text(max_size=16), bool: st.booleans(), bytes: st.binary(max_size=16),
        np.ndarray: arrays(), Any: _plain,
    }
    if tp in simple:
        return simple[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return st.one_of(*(st.none() if a is type(None) else strategy(a) for a in args))
    if origin is list:
        return st.lists(strategy(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), strategy(args[1]), max_size=3)
    if origin is Literal:
        return st.sampled_from(args)
    if tp in RECORDS.values():
        return record_strategy(tp)
    raise TypeError(tp)


def record_strategy(cls: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: strategy(hints[f.name]) for f in dataclasses.fields(cls)})


any_record = st.sampled_from(sorted(RECORDS)).flatmap(lambda n: record_strategy(RECORDS[n]))


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equality that compares arrays by dtype, shape and bytes, recursively."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert a.tobytes() == b.tobytes(), path
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), path
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)
