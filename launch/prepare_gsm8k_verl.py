"""GSM8K's JSONL (question, answer) as verl's Parquet, the way verl's
examples/data_preprocess/gsm8k.py writes it, for `data.format = "verl"` (or `auto`):

    python launch/prepare_gsm8k_verl.py ../shared/data/gsm8k data/gsm8k_verl [--limit N]

reads SRC/train.jsonl and SRC/test.jsonl and writes OUT/train.parquet and OUT/test.parquet, one
row per problem: data_source "openai/gsm8k", prompt [{"role": "user", "content": question +
instruction}], ability "math", reward_model {"style": "rule", "ground_truth": final answer},
extra_info {"split", "index", "answer", "question"}. With the `datasets` package the file is
written by `Dataset.to_parquet`, as verl does; without it by pyarrow, with the same schema.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def extract_solution(answer: str) -> str:
    """verl's extract_solution: the number after '#### ', commas removed."""
    found = re.search("#### (\\-?[0-9\\.\\,]+)", answer)
    if found is None:
        raise ValueError(f"no '#### <number>' in the answer {answer[-80:]!r}")
    return found.group(0).split("#### ")[1].replace(",", "")


def verl_rows(jsonl: str, split: str, limit: int | None = None) -> list[dict]:
    rows = []
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            if limit is not None and len(rows) >= limit:
                break
            ex = json.loads(line)
            idx = len(rows)
            rows.append({
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": ex["question"] + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": extract_solution(ex["answer"])},
                "extra_info": {"split": split, "index": idx, "answer": ex["answer"],
                               "question": ex["question"]},
            })
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="directory holding GSM8K's train.jsonl and test.jsonl")
    ap.add_argument("out", help="directory to write train.parquet and test.parquet into")
    ap.add_argument("--limit", type=int, default=None, help="at most N rows per split")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for split in ("train", "test"):
        src = os.path.join(args.src, f"{split}.jsonl")
        if not os.path.isfile(src):
            print(f"prepare_gsm8k_verl: {src}: no such file", file=sys.stderr)
            return 2
        rows = verl_rows(src, split, args.limit)
        dst = os.path.join(args.out, f"{split}.parquet")
        how = write_parquet(rows, dst)
        print(f"{dst}: {len(rows)} rows (written by {how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
