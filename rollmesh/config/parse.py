"""The typed TOML parser: one generic validator that walks a dataclass's type hints, and the
`ConfigError` every config mistake becomes (`<file or --set override>: <key path>: <problem>`).

The schemas (rollmesh.config.experiment, rollmesh.config.cluster) declare their fields with
`_field` (help and bounds) and check what types cannot say in a `validate()` hook that raises
`_Invalid` with a key path relative to its dataclass; `parse_config` adds the file and the prefix.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, field
from typing import Any, Literal, NoReturn, Union, get_args, get_origin, get_type_hints

class ConfigError(ValueError):
    """A config value is wrong: `str(err)` is `<file or --set override>: <key path>: <problem>`."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        self.source, self.key, self.problem = source, key, problem
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")


class _Invalid(Exception):
    """Raised by a `validate()` hook with a key path relative to its dataclass; the parser adds
    the file and the path prefix."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(key, problem)
        self.key, self.problem = key, problem


def _field(help: str, default: Any = MISSING, *, factory: Any = MISSING,
           choices: Callable[[], Iterable[str]] | None = None, **bounds: float) -> Any:
    """A config field: `help` is mandatory (it becomes the README's reference); `bounds` are any
    of ge/gt/le/lt, applied to the value (to each item for a list); `choices` (a str field whose
    allowed values a registry holds) returns those values, for the reference: the field's own
    `validate` checks them."""
    assert help and set(bounds) <= {"ge", "gt", "le", "lt"}, bounds
    meta = {"help": help, **bounds, **({"choices": choices} if choices else {})}
    return field(default=default, default_factory=factory, metadata=meta)


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`did you mean 'x'? ` for a near miss (a typo), else nothing."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.8)
    return f"did you mean {close[0]!r}? " if close else ""


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}es" if noun.endswith("s") else f"{n} {noun}s"


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_str(key)


def _join(path: str, key: str) -> str:
    return f"{path}.{_key(key)}" if path else _key(key)


def _show(value: Any) -> str:
    """A value as the user wrote it (TOML-like), shortened: for `got ...`."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, float):
        text = _toml_float(value)
    elif isinstance(value, list):
        text = "[" + ", ".join(_show(v) for v in value) + "]"
    elif isinstance(value, dict):
        return "a table"
    else:
        text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _num(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


def _bounds(meta: Mapping[str, Any]) -> str:
    lo = ("[", meta["ge"]) if "ge" in meta else ("(", meta["gt"]) if "gt" in meta else None
    hi = ("]", meta["le"]) if "le" in meta else (")", meta["lt"]) if "lt" in meta else None
    if lo and hi:
        return f" in {lo[0]}{_num(lo[1])}, {_num(hi[1])}{hi[0]}"
    if lo:
        return f" {'>=' if lo[0] == '[' else '>'} {_num(lo[1])}"
    if hi:
        return f" {'<=' if hi[0] == ']' else '<'} {_num(hi[1])}"
    return ""


def _optional_of(tp: Any) -> Any | None:
    """X for `X | None` (`X | Y` for `X | Y | None`), else None."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == len(get_args(tp)):
            return None  # a plain `X | Y`: not optional
        return args[0] if len(args) == 1 else Union[tuple(args)]
    return None


def _union_of(tp: Any) -> tuple[Any, ...]:
    """The members of a plain `X | Y` (scalars and lists only: told apart by the value's
    shape), else ()."""
    if get_origin(tp) not in (Union, types.UnionType):
        return ()
    members = get_args(tp)
    assert all(m in (str, int, float, bool) or get_origin(m) is list for m in members), (
        f"only unions of scalars and lists are supported, not {tp}")
    return members


def _shape_fits(tp: Any, value: Any) -> bool:
    if get_origin(tp) is list:
        return isinstance(value, list)
    if tp is bool or isinstance(value, bool):
        return tp is bool and isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float))
    return isinstance(value, tp)


def _describe(tp: Any, meta: Mapping[str, Any] = types.MappingProxyType({})) -> str:
    """What a value of type `tp` must be, as in `expected <this>`."""
    inner = _optional_of(tp)
    if inner is not None:
        return _describe(inner, meta)  # TOML has no null: None is written by leaving the key out
    members = _union_of(tp)
    if members:
        return " or ".join(_describe(m, meta) for m in members)
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return "a table"
    if origin is list:
        (item,) = get_args(tp)
        if dataclasses.is_dataclass(item):
            return "a table or a list of tables"
        return f"a list of {_describe(item, meta)}"
    if origin is dict:
        value = get_args(tp)[1]
        return (
            "a table of tables"
            if dataclasses.is_dataclass(value)
            else f"a table of {_describe(value, meta)}"
        )
    if origin is Literal:
        return "one of " + ", ".join(repr(c) for c in get_args(tp))
    if tp is str and meta.get("choices"):
        return "one of " + ", ".join(repr(c) for c in meta["choices"]())
    return tp.__name__ + (_bounds(meta) if tp in (int, float) else "")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


class _Context:
    """Where values came from: the file, or (for key paths below an override) a `--set`."""

    def __init__(
        self,
        source: str,
        origins: Mapping[str, str] | None = None,
        raw: Mapping[str, str] | None = None,
    ) -> None:
        self.source = source
        self.origins = dict(origins or {})  # key path -> "--set ..." that set (or created) it
        self.raw = dict(raw or {})  # key path -> an override's value text, before TOML parsing

    def source_of(self, path: str) -> str:
        best = ""
        for key in self.origins:
            if (path == key or path.startswith((key + ".", key + "["))) and len(key) > len(best):
                best = key
        return self.origins[best] if best else self.source

    def fail(self, path: str, problem: str) -> NoReturn:
        raise ConfigError(self.source_of(path), path, problem)


def _convert(tp: Any, meta: Mapping[str, Any], value: Any, path: str, ctx: _Context) -> Any:
    inner = _optional_of(tp)
    if inner is not None:
        return None if value is None else _convert(inner, meta, value, path, ctx)
    members = _union_of(tp)
    if members:
        if str in members and path in ctx.raw and not isinstance(value, (str, list, dict)):
            value = ctx.raw[path]  # `--set roles.trainer.cpus=1`: the text as typed
        fits = [m for m in members if _shape_fits(m, value)]
        if not fits:
            ctx.fail(path, f"expected {_describe(tp, meta)}, got {_show(value)}")
        return _convert(fits[0], meta, value, path, ctx)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            ctx.fail(path, f"expected a table, got {_show(value)}")
        return _parse_dataclass(tp, value, path, ctx)
    origin = get_origin(tp)
    if origin is list:
        (item,) = get_args(tp)
        if dataclasses.is_dataclass(item) and isinstance(value, dict):
            return [_parse_dataclass(item, value, path, ctx)]  # [t] stands for a one-item [[t]]
        if not isinstance(value, list):
            ctx.fail(path, f"expected {_describe(tp, meta)}, got {_show(value)}")
        return [_convert(item, meta, v, f"{path}[{i}]", ctx) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            ctx.fail(path, f"expected {_describe(tp, meta)}, got {_show(value)}")
        value_tp = get_args(tp)[1]
        return {k: _convert(value_tp, meta, v, _join(path, k), ctx) for k, v in value.items()}
    if origin is Literal:
        if not any(type(value) is type(c) and value == c for c in get_args(tp)):
            ctx.fail(path, f"expected {_describe(tp)}, got {_show(value)}")
        return value
    if tp is str and path in ctx.raw and not isinstance(value, (str, list, dict)):
        # `--set name=2024-01-01` parses as a TOML date; a str field wants the text as typed.
        value = ctx.raw[path]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),  # TOML keeps true and 1 apart
        float: isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not math.isnan(value),
        str: isinstance(value, str),
    }[tp]
    if ok and tp in (int, float):
        ok = _in_bounds(value, meta)
    if not ok:
        ctx.fail(path, f"expected {_describe(tp, meta)}, got {_show(value)}")
    return float(value) if tp is float else value


def _in_bounds(v: float, meta: Mapping[str, Any]) -> bool:
    return (
        ("ge" not in meta or v >= meta["ge"])
        and ("gt" not in meta or v > meta["gt"])
        and ("le" not in meta or v <= meta["le"])
        and ("lt" not in meta or v < meta["lt"])
    )


def _parse_dataclass(cls: type, data: Mapping[str, Any], path: str, ctx: _Context) -> Any:
    hints = _hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    for key in data:
        if key not in names:
            ctx.fail(_join(path, key), f"unknown key ({_did_you_mean(key, names)}expected one of: "
                     f"{', '.join(names)})")
    values = {}
    for f in fields:
        key = _join(path, f.name)
        if f.name in data:
            values[f.name] = _convert(hints[f.name], f.metadata, data[f.name], key, ctx)
        elif dataclasses.is_dataclass(hints[f.name]):
            # A missing section is an empty one: its defaults, or its own missing-value errors.
            values[f.name] = _parse_dataclass(hints[f.name], {}, key, ctx)
        elif f.default is MISSING and f.default_factory is MISSING:
            ctx.fail(
                key, f"missing required value (expected {_describe(hints[f.name], f.metadata)})"
            )
    obj = cls(**values)
    if hasattr(obj, "validate"):
        try:
            obj.validate()
        except _Invalid as e:
            ctx.fail(f"{path}.{e.key}" if path else e.key, e.problem)  # e.key is a path already
    return obj


def parse_config(cls: type, data: Mapping[str, Any], source: str) -> Any:
    """Validate a plain dict (from a TOML file, or a spec received over the wire) into `cls`.

    `None` is accepted for `X | None` fields. Raises ConfigError naming `source`."""
    return _parse(cls, data, _Context(source))


def _parse(cls: type, data: Any, ctx: _Context) -> Any:
    if not isinstance(data, dict):
        ctx.fail("", f"expected a table, got {_show(data)}")
    return _parse_dataclass(cls, data, "", ctx)


# TOML text for keys and values: `_key` and `_show` quote as a file would (rollmesh.config.write
# writes whole documents with them).


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in "\b\t\n\f\r":
            out.append({"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(x)  # shortest round-trip form; '1e-06' is valid TOML
