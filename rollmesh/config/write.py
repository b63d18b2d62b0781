"""Writing configs out: plain dicts for the wire and logs (`to_dict`), TOML for the resolved
config a run starts with (`to_toml`), and the configuration reference generated from the
fields' help (`field_reference`, `reference_markdown`: the README's, `rollmesh config --reference`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import MISSING
from typing import Any, get_args, get_origin

from rollmesh.config.cluster import ClusterConfig
from rollmesh.config.experiment import ExperimentConfig
from rollmesh.config.parse import _describe, _hints, _join, _key, _optional_of, _toml_float, _toml_str

def to_dict(cfg: Any) -> Any:
    """Plain dicts, lists and scalars (None kept, derived fields left out), e.g. for the wire:
    `parse_config` reads it back."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def to_toml(cfg: Any) -> str:
    """The config as a TOML document that `tomllib` reads back to the same config (None omitted)."""
    lines: list[str] = []
    _write_table(to_dict(cfg), [], lines)
    return "\n".join(lines).strip() + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return _toml_float(v)
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # inline only when empty (`env = {}`); others get a [header]
        return (
            "{"
            + ", ".join(f"{_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None)
            + "}"
        )
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _is_subtable(v: Any) -> bool:
    """Written under a [header] of its own (empty tables are written inline, `x = {}`)."""
    return (isinstance(v, dict) and bool(v)) or _is_table_array(v)


def _write_table(table: dict[str, Any], path: list[str], lines: list[str]) -> None:
    # Plain keys first: after a [header], every key belongs to that table.
    for k, v in table.items():
        if v is not None and not _is_subtable(v):
            lines.append(f"{_key(k)} = {_toml_value(v)}")
    for k, v in table.items():
        sub = path + [_key(k)]
        if isinstance(v, dict) and v:
            plain = any(x is not None and not _is_subtable(x) for x in v.values())
            # A table holding only tables needs no header of its own ([hosts] before [hosts.a]).
            if plain or not any(_is_subtable(x) for x in v.values()):
                lines.extend(["", f"[{'.'.join(sub)}]"])
            _write_table(v, sub, lines)
        elif _is_table_array(v):
            for item in v:
                lines.extend(["", f"[[{'.'.join(sub)}]]"])
                _write_table(item, sub, lines)


def field_reference(cls: type, prefix: str = "") -> list[dict[str, Any]]:
    """One row per field of `cls`, recursing into sections, `<name>` tables and placements:
    key, expected, default (MISSING if required), help. The README's reference comes from it."""
    rows = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, tp = _join(prefix, f.name), hints[f.name]
        if f.default is not MISSING:
            default: Any = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = MISSING
        if dataclasses.is_dataclass(tp) or dataclasses.is_dataclass(_optional_of(tp)):
            rows.extend(field_reference(_optional_of(tp) or tp, key))
            continue
        rows.append(
            {
                "key": key,
                "expected": _describe(tp, f.metadata),
                "default": default,
                "help": f.metadata["help"],
            }
        )
        inner = get_args(tp)[-1] if get_origin(tp) in (list, dict) else None
        if dataclasses.is_dataclass(inner):
            rows.extend(field_reference(inner, f"{key}.<name>" if get_origin(tp) is dict else key))
    return rows


def reference_markdown() -> str:
    """The configuration reference (README), generated from the dataclasses' `help`."""

    def show(v: Any) -> str:
        if v is MISSING:
            return "required"
        return f"`{json.dumps(v) if not isinstance(v, str) else repr(v)}`"

    out = []
    for title, cls in (("Experiment file (`configs/*.toml`)", ExperimentConfig),
                       ("Cluster file (`launch/*.toml`)", ClusterConfig)):
        out += [f"#### {title}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for row in field_reference(cls):
            meaning = row["help"].replace("|", "\\|")
            out.append(f"| `{row['key']}` | {row['expected']} | {show(row['default'])} | {meaning} |")
        out.append("")
    return "\n".join(out)
