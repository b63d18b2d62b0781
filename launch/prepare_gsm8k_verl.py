"""GSM8K as verl's Parquet, the way verl's examples/data_preprocess/gsm8k.py writes it, for
`data.format = "verl"` (or `auto`):

    python launch/prepare_gsm8k_verl.py SRC data/gsm8k_verl [--limit N]

writes OUT/train.parquet and OUT/test.parquet from SRC's train and test splits. SRC is a
directory holding GSM8K in one of these forms (nothing is downloaded here):

    datasets    a directory written by `save_to_disk` of the Hugging Face dataset openai/gsm8k:
                datasets.load_dataset("openai/gsm8k", "main").save_to_disk(SRC)
    hf parquet  the dataset's Parquet files as the Hub serves them (columns question, answer):
                SRC/main/train-00000-of-00001.parquet (or SRC/train-*.parquet, SRC/train.parquet)
    jsonl       GSM8K's JSONL as published: SRC/train.jsonl, SRC/test.jsonl (question, answer)
    verl        verl's Parquet (its gsm8k.py output): SRC/train.parquet, SRC/test.parquet with
                prompt and reward_model; copied as it is (the first N rows with --limit)

From question and answer it writes one row per problem: data_source "openai/gsm8k", prompt
[{"role": "user", "content": question + instruction}], ability "math", reward_model {"style":
"rule", "ground_truth": final answer}, extra_info {"split", "index", "answer", "question"}. With
the `datasets` package the file is written by `Dataset.to_parquet`, as verl does; without it by
pyarrow, with the same schema.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from typing import Any

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
LAYOUTS = (
    "a `datasets` save_to_disk directory of openai/gsm8k (dataset_dict.json, splits train and "
    "test); Hugging Face's Parquet files (main/train-*.parquet, train-*.parquet or "
    "train.parquet: columns question, answer); train.jsonl and test.jsonl (question, answer); "
    "or verl's Parquet (train.parquet and test.parquet: prompt, reward_model)"
)


class SourceError(Exception):
    """What SRC holds is not GSM8K in a form this script reads: names the file and what it
    expected."""


def extract_solution(answer: str) -> str:
    """verl's extract_solution: the number after '#### ', commas removed."""
    found = re.search("#### (\\-?[0-9\\.\\,]+)", answer)
    if found is None:
        raise ValueError(f"no '#### <number>' in the answer {answer[-80:]!r}")
    return found.group(0).split("#### ")[1].replace(",", "")


def verl_row(ex: dict[str, Any], split: str, idx: int, where: str) -> dict:
    """One GSM8K problem (question, answer) as verl's gsm8k.py maps it."""
    question, answer = ex.get("question"), ex.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str):
        raise SourceError(f"{where}: row {idx}: expected strings 'question' and 'answer', got "
                          f"keys {sorted(ex)}")
    try:
        label = extract_solution(answer)
    except ValueError as e:
        raise SourceError(f"{where}: row {idx}: {e}") from None
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": label},
        "extra_info": {"split": split, "index": idx, "answer": answer, "question": question},
    }


def verl_rows(jsonl: str, split: str, limit: int | None = None) -> list[dict]:
    """GSM8K's JSONL (question, answer per line) as verl's rows."""
    rows = []
    with open(jsonl, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(rows) >= limit:
                break
            try:
                ex = json.loads(line)
            except json.JSONDecodeError as e:
                raise SourceError(f"{jsonl}: line {n}: expected a JSON object ({e})") from None
            if not isinstance(ex, dict):
                raise SourceError(f"{jsonl}: line {n}: expected a JSON object, got "
                                  f"{type(ex).__name__}")
            rows.append(verl_row(ex, split, len(rows), jsonl))
    return rows


def write_parquet(rows: list[dict], path: str) -> str:
    """Write as verl does (`datasets.Dataset.to_parquet`), or with pyarrow and the same schema."""
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        datasets.Dataset.from_list(rows).to_parquet(path)
        return "datasets"
    import pyarrow as pa
    import pyarrow.parquet as pq

    s = pa.string()
    schema = pa.schema([
        ("data_source", s),
        ("prompt", pa.list_(pa.struct([("role", s), ("content", s)]))),
        ("ability", s),
        ("reward_model", pa.struct([("style", s), ("ground_truth", s)])),
        ("extra_info", pa.struct([("split", s), ("index", pa.int64()), ("answer", s),
                                  ("question", s)])),
    ])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return "pyarrow"


def _parquet_files(src: str, split: str) -> list[str]:
    for pattern in (f"{split}.parquet", f"{split}-*.parquet", f"main/{split}-*.parquet",
                    f"main/{split}.parquet"):
        found = sorted(glob.glob(os.path.join(glob.escape(src), pattern)))
        if found:
            return found
    return []


def read_split(src: str, split: str) -> tuple[str, Any, str]:
    """SRC's `split`: ("jsonl", its path, where), ("qa", a pyarrow table with question and
    answer, where) or ("verl", a pyarrow table in verl's schema, where)."""
    if not os.path.isdir(src):
        raise SourceError(f"{src}: expected a directory holding GSM8K: {LAYOUTS}")
    if os.path.isfile(os.path.join(src, "dataset_dict.json")):
        try:
            import datasets
        except ImportError:
            raise SourceError(f"{src}: a `datasets` directory needs the datasets package "
                              "(pip install 'rollmesh[datasets]')") from None
        saved = datasets.load_from_disk(src)
        if split not in saved:
            raise SourceError(f"{os.path.join(src, 'dataset_dict.json')}: expected the splits "
                              f"{', '.join(SPLITS)}, got {', '.join(saved)}")
        where = f"{src} (datasets, split {split})"
        return _classify(saved[split].with_format("arrow")[:], where)
    if os.path.isfile(os.path.join(src, "state.json")):
        raise SourceError(f"{src}: a single `datasets` split; expected a DatasetDict with the "
                          "splits train and test (save_to_disk of load_dataset('openai/gsm8k', "
                          "'main'))")
    jsonl = os.path.join(src, f"{split}.jsonl")
    if os.path.isfile(jsonl):
        return "jsonl", jsonl, jsonl
    files = _parquet_files(src, split)
    if not files:
        raise SourceError(f"{src}: no {split} split found: expected {LAYOUTS}")
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for f in files:
        try:
            tables.append(pq.read_table(f))
        except (pa.ArrowException, OSError) as e:
            raise SourceError(f"{f}: expected a Parquet file ({e})") from None
    where = files[0] if len(files) == 1 else f"{os.path.dirname(files[0])}/{split}-*.parquet"
    try:
        table = pa.concat_tables(tables)
    except pa.ArrowException:
        raise SourceError(f"{where}: expected files of one schema") from None
    return _classify(table, where)


def _classify(table: Any, where: str) -> tuple[str, Any, str]:
    names = set(table.column_names)
    if {"question", "answer"} <= names:
        return "qa", table, where
    if {"prompt", "reward_model"} <= names:
        return "verl", table, where
    raise SourceError(f"{where}: expected GSM8K's columns question and answer (openai/gsm8k) or "
                      f"verl's prompt and reward_model, got {', '.join(sorted(names))}")


def convert(kind: str, data: Any, where: str, split: str, dst: str,
            limit: int | None) -> tuple[int, str]:
    """Write the split to `dst`: (rows, how it was written)."""
    if kind == "verl":
        import pyarrow.parquet as pq

        table = data if limit is None else data.slice(0, limit)
        pq.write_table(table, dst)
        return table.num_rows, "pyarrow, verl's rows as they are"
    if kind == "jsonl":
        rows = verl_rows(data, split, limit)
    else:
        qa = data.select(["question", "answer"])
        qa = qa if limit is None else qa.slice(0, limit)
        rows = [verl_row(ex, split, i, where) for i, ex in enumerate(qa.to_pylist())]
    return len(rows), write_parquet(rows, dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="directory holding GSM8K's train and test splits: a `datasets` "
                                "save_to_disk directory, Hugging Face's Parquet files, the "
                                "JSONL, or verl's Parquet")
    ap.add_argument("out", help="directory to write train.parquet and test.parquet into")
    ap.add_argument("--limit", type=int, default=None, help="at most N rows per split")
    args = ap.parse_args(argv)
    try:
        sources = {split: read_split(args.src, split) for split in SPLITS}
        os.makedirs(args.out, exist_ok=True)
        for split, (kind, data, where) in sources.items():
            dst = os.path.join(args.out, f"{split}.parquet")
            if os.path.abspath(dst) == os.path.abspath(where):
                raise SourceError(f"{where}: the source is the output: pick another OUT")
            n, how = convert(kind, data, where, split, dst, args.limit)
            print(f"{dst}: {n} rows from {where} (written by {how})")
    except SourceError as e:
        print(f"prepare_gsm8k_verl: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
