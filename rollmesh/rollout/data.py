"""Prompt data: dataset rows, the resumable cursor over them, and prompt rendering.

This module owns what the rollouter reads: a file (JSONL, Parquet, GSM8K's JSONL, verl's Parquet
schema) or a Hugging Face `datasets` directory becomes a `Dataset` of `PromptRow`s, validated row
by row (a bad row is an error naming the file, the line and the problem, unless `skip_bad_rows`
counts and logs it); a `PromptCursor` walks the rows in a deterministic per-epoch order and
resumes exactly from its `state()`; a `PromptSource` hands out `PromptGroup`s (a row, the group
size and a stable group id). `render_prompt` turns a row into prompt token ids for the agent
loops.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rollmesh.runtime.log import get_logger

if TYPE_CHECKING:
    from rollmesh.config import DataConfig

__all__ = [
    "Dataset",
    "DatasetError",
    "PromptCursor",
    "PromptGroup",
    "PromptRow",
    "PromptSource",
    "gsm8k_final_answer",
    "load_dataset",
    "render_prompt",
    "with_system_prompt",
]

log = get_logger("rollmesh.rollout.data")

Messages = list[dict[str, Any]]
_RESERVED = ("agent_loop", "tools")  # row fields with a meaning of their own, not metadata
_MAX_LOGGED_BAD_ROWS = 20


class DatasetError(ValueError):
    """A dataset problem: `str(err)` is `<file>: line <n>: <problem>` (`row <n>` for Parquet)."""

    def __init__(self, path: str, where: str, problem: str) -> None:
        self.path, self.where, self.problem = path, where, problem
        super().__init__(f"{path}: {where}: {problem}" if where else f"{path}: {problem}")


@dataclass
class PromptRow:
    """One prompt. `index` is the row's 0-based position in its file (blank lines not counted,
    skipped bad rows counted), so it identifies the row whatever was skipped."""

    index: int
    prompt: str | Messages
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    agent_loop: str | None = None
    tools: list[Any] | None = None


@dataclass
class Dataset:
    """The rows of one file, in file order."""

    path: str
    format: str  # resolved: jsonl | parquet | gsm8k | verl | hf
    rows: list[PromptRow]
    skipped: int = 0  # bad rows dropped under skip_bad_rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptRow:
        return self.rows[i]

    def __iter__(self) -> Iterator[PromptRow]:
        return iter(self.rows)

    @classmethod
    def from_config(cls, cfg: DataConfig, *, eval: bool = False, **kw: Any) -> Dataset:
        """The train (or eval) file of a `[data]` config section. For GSM8K the config's key
        defaults (`prompt`, `label`) mean GSM8K's own fields (`question`, `answer`). A `datasets`
        directory holding several splits gives its `train` split for training and its `test`
        split (else `validation`) for evaluation unless the path names one (`DIR:SPLIT`)."""
        path = cfg.eval_path if eval else cfg.train_path
        if path is None:
            raise DatasetError("<config>", "data.eval_path", "expected a file, got none")
        fmt = _resolve_format(path, cfg.format)
        # jsonl may still be detected as GSM8K, and an hf directory may hold GSM8K's fields
        gsm8k_maybe = fmt in ("gsm8k", "jsonl", "hf")
        kw.setdefault("split", ("test", "validation") if eval else ("train",))
        return load_dataset(
            path,
            format=cfg.format,
            prompt_key=None if gsm8k_maybe and cfg.prompt_key == "prompt" else cfg.prompt_key,
            label_key=None if gsm8k_maybe and cfg.label_key == "label" else cfg.label_key,
            system_prompt=cfg.system_prompt,
            **kw,
        )


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_dataset(
    path: str | os.PathLike[str],
    *,
    format: str = "auto",
    prompt_key: str | None = None,
    label_key: str | None = None,
    system_prompt: str | None = None,
    skip_bad_rows: bool = False,
    split: str | Sequence[str] | None = None,
) -> Dataset:
    """Read and validate every row of `path`.

    `format`: `auto`, `jsonl`, `parquet`, `gsm8k`, `verl` or `hf`. `auto` goes by the path: a
    directory (or `DIR:SPLIT`) is a `datasets` directory (`hf`); `.parquet` is Parquet, read as
    `verl` when it has a `reward_model` column holding `ground_truth`; anything else is JSONL,
    read as GSM8K when its first row has `question` and a `####` `answer`. Keys default to
    `prompt`/`label` (`question`/`answer` for GSM8K).

    `verl` rows (verl's data-preparation scripts' schema): the prompt is the `prompt` column (a
    chat message list), the label `reward_model.ground_truth` (a number becomes its string), and
    the metadata holds every other column (`data_source`, `ability`, `extra_info`, ...; the
    `reward_model` struct included) as plain Python values. `label_key` is not used.

    `hf`: a directory written by `datasets`' `save_to_disk`: a `Dataset`, or a `DatasetDict` of
    which `DIR:SPLIT` names the split (else the first of `split` it has, or its only split). Its
    rows are verl rows when it has a `reward_model` column, else JSONL (or GSM8K) rows.

    With `system_prompt`, text prompts become chat messages (see `with_system_prompt`).
    """
    path = os.fspath(path)
    fmt = _resolve_format(path, format)
    if fmt == "hf":
        if format == "auto":
            log.info("dataset_format_detected", path=path, format="hf",
                     why="a directory: read as one written by datasets' save_to_disk")
        records, schema = _hf_records(path, split)
        if schema == "jsonl" and _looks_like_gsm8k(records, prompt_key):
            schema = "gsm8k"
    else:
        if not os.path.isfile(path):
            raise DatasetError(path, "", "no such file")
        if fmt in ("parquet", "verl"):
            records = _parquet_records(path)
            if format == "auto" and _has_ground_truth(records):
                fmt = "verl"
                log.info("dataset_format_detected", path=path, format="verl",
                         why="a Parquet file with reward_model.ground_truth")
        else:
            records = _jsonl_records(path)
        if format == "auto" and fmt == "jsonl" and _looks_like_gsm8k(records, prompt_key):
            fmt = "gsm8k"
        schema = fmt
    if schema == "gsm8k":
        prompt_key, label_key = prompt_key or "question", label_key or "answer"
    else:
        prompt_key, label_key = prompt_key or "prompt", label_key or "label"

    rows: list[PromptRow] = []
    skipped = 0
    for index, (where, obj) in enumerate(records):
        try:
            if isinstance(obj, _BadJSON):
                raise _BadRow(obj.problem)
            if schema == "verl":
                row = _make_verl_row(index, obj, prompt_key)
            else:
                row = _make_row(index, obj, prompt_key, label_key, gsm8k=schema == "gsm8k")
            if system_prompt is not None:
                row.prompt = with_system_prompt(row.prompt, system_prompt)
        except _BadRow as e:
            if not skip_bad_rows:
                raise DatasetError(path, where, str(e)) from None
            skipped += 1
            if skipped <= _MAX_LOGGED_BAD_ROWS:
                log.warning("bad_row_skipped", path=path, where=where, problem=str(e))
            continue
        rows.append(row)
    if skipped:
        log.warning("bad_rows_skipped", path=path, skipped=skipped, kept=len(rows))
    if not rows:
        why = f" ({skipped} bad rows skipped)" if skipped else ""
        raise DatasetError(path, "", f"no rows{why}")
    extra = {"rows_as": schema} if fmt == "hf" else {}
    log.info("dataset_loaded", path=path, format=fmt, rows=len(rows), skipped=skipped, **extra)
    return Dataset(path=path, format=fmt, rows=rows, skipped=skipped)


_FORMATS = ("auto", "jsonl", "parquet", "gsm8k", "verl", "hf")


def _resolve_format(path: str, format: str) -> str:
    if format not in _FORMATS:
        raise DatasetError(
            path, "", f"unknown format {format!r} (expected {', '.join(_FORMATS[:-1])} or hf)"
        )
    if format != "auto":
        return format
    if os.path.isdir(path) or (":" in path and os.path.isdir(path.rsplit(":", 1)[0])):
        return "hf"
    return "parquet" if path.endswith((".parquet", ".pq")) else "jsonl"


class _BadRow(Exception):
    """A problem with one row; the loader adds the file and line."""


@dataclass
class _BadJSON:
    problem: str


def _jsonl_records(path: str) -> list[tuple[str, Any]]:
    records: list[tuple[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj: Any = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                obj = _BadJSON(f"invalid JSON: {e.msg} at column {e.colno}")
            records.append((f"line {lineno}", obj))
    return records


def _parquet_records(path: str) -> list[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(
            path, "", "reading Parquet needs pyarrow, which is not installed (pip install pyarrow)"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises its own error types for corrupt files
        raise DatasetError(path, "", f"not a readable Parquet file: {e}") from None
    return [(f"row {i}", obj) for i, obj in enumerate(table.to_pylist())]


def _has_ground_truth(records: list[tuple[str, Any]]) -> bool:
    """The first row has verl's `reward_model` struct with a `ground_truth` field."""
    first = next((obj for _, obj in records if isinstance(obj, dict)), None)
    rm = first.get("reward_model") if first is not None else None
    return isinstance(rm, dict) and "ground_truth" in rm


_HF_EXTRA = "data.format = 'hf' needs the `datasets` package: pip install 'rollmesh[datasets]'"


def _hf_records(
    path: str, split: str | Sequence[str] | None
) -> tuple[list[tuple[str, Any]], str]:
    """The rows of a `save_to_disk` directory (`DIR` or `DIR:SPLIT`) and how to read them:
    `verl` when it has a `reward_model` column, else `jsonl`."""
    directory, named = path, None
    if not os.path.isdir(path) and ":" in path:
        directory, named = path.rsplit(":", 1)
    if not os.path.isdir(directory):
        raise DatasetError(path, "", "no such directory (data.format = 'hf' reads a directory "
                                     "written by datasets' save_to_disk, or DIR:SPLIT)")
    try:
        import datasets
    except ImportError:
        raise DatasetError(path, "", _HF_EXTRA) from None
    try:
        loaded = datasets.load_from_disk(directory)
    except Exception as e:  # datasets raises FileNotFoundError and its own errors
        raise DatasetError(
            path, "", f"not a Hugging Face datasets directory written by save_to_disk: {e}"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if named is None:
            wanted = [split] if isinstance(split, str) else list(split or ())
            named = next((s for s in wanted if s in loaded), None)
            if named is None and len(splits) == 1:
                named = splits[0]
            if named is None:
                raise DatasetError(
                    path, "", f"a DatasetDict with splits {', '.join(splits)}: name one as "
                              f"{directory}:SPLIT"
                )
        elif named not in loaded:
            raise DatasetError(path, "", f"no split {named!r} (splits: {', '.join(splits)})")
        loaded = loaded[named]
    elif named is not None:
        raise DatasetError(path, "", f"split {named!r} named, but {directory} holds one Dataset "
                                     "(no splits): give the directory alone")
    table = loaded.with_format(None)
    records = [(f"row {i}", obj) for i, obj in enumerate(table.to_list())]
    return records, "verl" if _has_ground_truth(records) else "jsonl"


def _looks_like_gsm8k(records: list[tuple[str, Any]], prompt_key: str | None) -> bool:
    """The first row has GSM8K's fields (and the prompt key, if given, is GSM8K's)."""
    first = next((obj for _, obj in records if isinstance(obj, dict)), None)
    return (
        first is not None
        and prompt_key in (None, "question")
        and isinstance(first.get("question"), str)
        and isinstance(first.get("answer"), str)
        and gsm8k_final_answer(first["answer"]) is not None
    )


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _make_row(index: int, obj: Any, prompt_key: str, label_key: str, *, gsm8k: bool) -> PromptRow:
    if not isinstance(obj, dict):
        raise _BadRow(f"expected a JSON object, got {_type_name(obj)}")
    for key in (prompt_key, label_key):
        if key not in obj:
            raise _BadRow(f"missing key {key!r} (row keys: {', '.join(map(str, obj)) or 'none'})")
    prompt = _check_prompt(obj[prompt_key], prompt_key)
    agent_loop, tools = obj.get("agent_loop"), obj.get("tools")
    if agent_loop is not None and not isinstance(agent_loop, str):
        raise _BadRow(f"'agent_loop': expected a string or null, got {_type_name(agent_loop)}")
    if tools is not None and not isinstance(tools, list):
        raise _BadRow(f"'tools': expected a list or null, got {_type_name(tools)}")
    metadata = {k: v for k, v in obj.items() if k not in (prompt_key, label_key, *_RESERVED)}
    label = obj[label_key]
    if gsm8k:
        if not isinstance(label, str):
            raise _BadRow(f"{label_key!r}: expected a string, got {_type_name(label)}")
        final = gsm8k_final_answer(label)
        if final is None:
            raise _BadRow(f"{label_key!r}: no '#### <answer>' line")
        metadata["solution"] = label
        label = final
    return PromptRow(index, prompt, label, metadata, agent_loop, tools)


def _plain(v: Any) -> Any:
    """A value as msgpack-serialisable Python: numpy scalars and arrays, tuples (Arrow maps)
    and nested containers become ints, floats, strs, lists and dicts."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, np.ndarray):
        return [_plain(x) for x in v.tolist()]
    if isinstance(v, np.generic):
        return v.item()
    return v


def _make_verl_row(index: int, obj: Any, prompt_key: str) -> PromptRow:
    """A row of verl's schema: `prompt` a chat message list, `reward_model.ground_truth` the
    label, every other column metadata (`data_source`, `ability`, `extra_info`, ...)."""
    if not isinstance(obj, dict):
        raise _BadRow(f"expected a row object, got {_type_name(obj)}")
    obj = _plain(obj)
    if prompt_key not in obj:
        raise _BadRow(
            f"missing key {prompt_key!r} (row keys: {', '.join(map(str, obj)) or 'none'})"
        )
    raw = obj[prompt_key]
    if not isinstance(raw, list):
        raise _BadRow(f"{prompt_key!r}: expected a list of chat messages, got {_type_name(raw)}")
    # Arrow gives every message every field of the column's struct (None where a message had
    # none, e.g. tool_calls): drop those, as the message was written; content stays.
    raw = [{k: v for k, v in m.items() if v is not None or k == "content"}
           if isinstance(m, dict) else m for m in raw]
    prompt = _check_prompt(raw, prompt_key)
    rm = obj.get("reward_model")
    if not isinstance(rm, dict):
        raise _BadRow(
            "missing 'reward_model' (expected a struct holding 'ground_truth')" if rm is None
            else f"'reward_model': expected a struct holding 'ground_truth', got {_type_name(rm)}"
        )
    label = rm.get("ground_truth")
    if label is None:
        raise _BadRow("'reward_model.ground_truth': missing or null")
    if isinstance(label, (int, float)) and not isinstance(label, bool):
        label = str(label)
    elif isinstance(label, str) and not label.strip():
        raise _BadRow("'reward_model.ground_truth': empty string")
    source = obj.get("data_source")
    if source is not None and not isinstance(source, str):
        raise _BadRow(f"'data_source': expected a string, got {_type_name(source)}")
    agent_loop, tools = obj.get("agent_loop"), obj.get("tools")
    if agent_loop is not None and not isinstance(agent_loop, str):
        raise _BadRow(f"'agent_loop': expected a string or null, got {_type_name(agent_loop)}")
    if tools is not None and not isinstance(tools, list):
        raise _BadRow(f"'tools': expected a list or null, got {_type_name(tools)}")
    metadata = {k: v for k, v in obj.items() if k not in (prompt_key, *_RESERVED)}
    return PromptRow(index, prompt, label, metadata, agent_loop, tools)


def _check_prompt(prompt: Any, key: str) -> str | Messages:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _BadRow(f"{key!r}: empty prompt")
        return prompt
    if not isinstance(prompt, list):
        raise _BadRow(
            f"{key!r}: expected a string or a list of chat messages, got {_type_name(prompt)}"
        )
    if not prompt:
        raise _BadRow(f"{key!r}: empty message list")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict):
            raise _BadRow(f"{key!r}[{i}]: expected a message object, got {_type_name(m)}")
        if not isinstance(m.get("role"), str):
            raise _BadRow(f"{key!r}[{i}].role: expected a string, got {_type_name(m.get('role'))}")
        content = m.get("content")
        # None: an assistant turn that only calls tools; list: multi-part content.
        if "content" not in m or not isinstance(content, (str, list, type(None))):
            raise _BadRow(
                f"{key!r}[{i}].content: expected a string, a list or null, got "
                + ("nothing" if "content" not in m else _type_name(content))
            )
    return prompt


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def gsm8k_final_answer(answer: str) -> str | None:
    """`'...\\n#### 1,000'` -> `'1000'`: the text after the last line's `####`, stripped, with
    thousands commas removed; None if no line starts with `####`."""
    finals = [line[4:] for line in answer.splitlines() if line.startswith("####")]
    if not finals:
        return None
    return _THOUSANDS.sub("", finals[-1].strip()) or None


def with_system_prompt(prompt: str | Messages, system_prompt: str | None) -> str | Messages:
    """Chat messages with `system_prompt` first: a text prompt becomes [system, user]; a message
    list gets the system message prepended unless it already starts with one (the row's own
    system message wins). Without a system prompt, the prompt is returned as it is."""
    if system_prompt is None:
        return prompt
    if isinstance(prompt, str):
        return [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]
    if prompt and prompt[0].get("role") == "system":
        return prompt
    return [{"role": "system", "content": system_prompt}, *prompt]


# ---------------------------------------------------------------------------------------------
# Cursor and source
# ---------------------------------------------------------------------------------------------


class PromptCursor:
    """Walks row positions 0..n_rows-1, epoch after epoch, in a permutation fixed by (seed,
    epoch) (identity order without shuffle). `state()` is plain data; `from_state` continues
    exactly where the saved cursor stopped."""

    def __init__(
        self, n_rows: int, seed: int = 0, shuffle: bool = True, *, epoch: int = 0, offset: int = 0
    ) -> None:
        if n_rows < 1:
            raise ValueError(f"PromptCursor: n_rows: expected int >= 1, got {n_rows}")
        if epoch < 0 or not 0 <= offset <= n_rows:
            raise ValueError(
                f"PromptCursor: expected epoch >= 0 and 0 <= offset <= {n_rows}, "
                f"got epoch={epoch} offset={offset}"
            )
        self.n_rows, self.seed, self.shuffle = n_rows, int(seed), bool(shuffle)
        self.epoch, self.offset = epoch, offset
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_rows)
        # Only the bit generator's raw stream is used: numpy guarantees it across versions
        # (Generator.permutation may change), so a resumed run sees the same order.
        bits = np.random.PCG64(np.random.SeedSequence([self.seed & (2**63 - 1), epoch]))
        return np.argsort(bits.random_raw(self.n_rows), kind="stable")

    def next(self) -> int:
        """The next row position; moves to the next epoch after the last one."""
        if self.offset >= self.n_rows:
            self.epoch, self.offset = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            self._order, self._order_epoch = self._permutation(self.epoch), self.epoch
        assert self._order is not None
        index = int(self._order[self.offset])
        self.offset += 1
        return index

    def state(self) -> dict[str, Any]:
        return {
            "n_rows": self.n_rows,
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], n_rows: int | None = None) -> PromptCursor:
        """Restore a saved cursor; `n_rows` (the dataset now loaded) must match the saved one,
        or the saved positions would point at other rows."""
        if n_rows is not None and n_rows != state["n_rows"]:
            raise ValueError(
                f"PromptCursor: the saved cursor is for {state['n_rows']} rows, the dataset has "
                f"{n_rows}: it changed since the checkpoint"
            )
        return cls(
            state["n_rows"], state["seed"], state["shuffle"],
            epoch=state["epoch"], offset=state["offset"],
        )


@dataclass
class PromptGroup:
    """One prompt to sample `group_size` responses for. `group_id` is `e<epoch>-r<row index>-
    g<serial>`: the serial counts groups handed out, so ids are unique and, after a restore,
    the same as in the interrupted run."""

    group_id: str
    row: PromptRow
    group_size: int
    epoch: int


class PromptSource:
    """A dataset, a cursor over it and the group size: what the rollouter draws prompts from."""

    def __init__(
        self, rows: Sequence[PromptRow], group_size: int, *, seed: int = 0, shuffle: bool = True,
        shard: int = 0, shards: int = 1,
    ) -> None:
        """With several rollout shards (`shards` > 1) this source is shard `shard`'s: the rows
        whose dataset index is `shard` modulo `shards`, and group ids that begin with
        `s<shard>-` (unique across the shards; `group_origin`)."""
        if group_size < 1:
            raise ValueError(f"PromptSource: group_size: expected int >= 1, got {group_size}")
        if not 0 <= shard < shards:
            raise ValueError(f"PromptSource: expected 0 <= shard < shards, got shard={shard} "
                             f"shards={shards}")
        if shards > 1:
            rows = [r for r in rows if r.index % shards == shard]
            if not rows:
                raise ValueError(f"PromptSource: rollout shard {shard} of {shards} has no "
                                 f"prompt (the dataset has fewer rows than rollouters)")
        self.rows, self.group_size = rows, group_size
        self.prefix = f"s{shard}-" if shards > 1 else ""
        self.cursor = PromptCursor(len(rows), seed, shuffle)
        self.serial = 0

    @classmethod
    def from_config(
        cls, cfg: DataConfig, dataset: Sequence[PromptRow] | None = None, *, shard: int = 0,
        shards: int = 1,
    ) -> PromptSource:
        """A source over `dataset`, or over the config's train file (loaded here); with
        `shards` > 1, shard `shard` of it."""
        rows = dataset if dataset is not None else Dataset.from_config(cfg)
        seed = 0 if cfg.seed is None else cfg.seed
        return cls(rows, cfg.group_size, seed=seed, shuffle=cfg.shuffle, shard=shard,
                   shards=shards)

    def next_group(self) -> PromptGroup:
        pos = self.cursor.next()
        row = self.rows[pos]
        epoch = self.cursor.epoch
        group = PromptGroup(f"{self.prefix}e{epoch}-r{row.index}-g{self.serial}", row,
                            self.group_size, epoch)
        self.serial += 1
        return group

    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor.state(), "serial": self.serial}

    def restore(self, state: dict[str, Any]) -> None:
        self.cursor = PromptCursor.from_state(state["cursor"], n_rows=len(self.rows))
        self.serial = int(state["serial"])


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def chat_messages(row: PromptRow, system_prompt: str | None = None) -> Messages:
    """The row's prompt as chat messages (`system_prompt` applied): a text prompt is the
    user's message. What `render_prompt` renders, for loops that send it themselves."""
    prompt = with_system_prompt(row.prompt, system_prompt)
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def render_prompt(row: PromptRow, tokenizer: Any, system_prompt: str | None = None) -> list[int]:
    """Prompt token ids, through the tokenizer's own chat template (with the generation prompt
    and the row's tools): a text prompt is the user's message (after `system_prompt`, when
    given). Only a tokenizer without a chat template encodes a text prompt as it is (with the
    tokenizer's special tokens, e.g. BOS); chat messages need a template."""
    prompt = with_system_prompt(row.prompt, system_prompt)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str):
        if not has_template:
            return list(tokenizer.encode(prompt, add_special_tokens=True))
        prompt = [{"role": "user", "content": prompt}]
    elif not has_template:
        raise ValueError(
            f"row {row.index}: the prompt is chat messages but the tokenizer has no chat template"
        )
    # Render to text, then encode: the same ids as tokenize=True, whatever the transformers
    # version returns from apply_chat_template (list or BatchEncoding).
    text = tokenizer.apply_chat_template(
        prompt, tools=row.tools, tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
