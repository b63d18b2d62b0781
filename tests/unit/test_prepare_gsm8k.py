"""launch/prepare_gsm8k_verl.py on each form a user gets GSM8K in, written here (nothing is
downloaded): a `datasets` save_to_disk directory, Hugging Face's Parquet files of openai/gsm8k,
GSM8K's JSONL and verl's Parquet; anything else is refused naming the file and what was
expected. What it writes is read by rollmesh as verl's data."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollmesh.rollout.data import load_dataset

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch" / "prepare_gsm8k_verl.py"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

# GSM8K's shape: a question, and an answer whose last line is "#### <number>".
TRAIN = [
    {"question": "Ann has 3 apples and buys 4 more. How many apples does she have?",
     "answer": "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 12 pens. How many pens are in 100 boxes?",
     "answer": "100 * 12 = <<100*12=1200>>1200\n#### 1,200"},
    {"question": "Tom owes 5 dollars and pays 8. What is his balance?",
     "answer": "5 - 8 = -3\n#### -3"},
]
TEST = [{"question": "What is 6 times 7?", "answer": "6 * 7 = 42\n#### 42"}]
LABELS = {"train": ["7", "1200", "-3"], "test": ["42"]}


@pytest.fixture(scope="module")
def prepare():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k_verl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def check_out(out: Path, limit: int | None = None) -> None:
    """OUT holds verl's GSM8K rows, as rollmesh reads them."""
    for split, source in (("train", TRAIN), ("test", TEST)):
        want = source[:limit]
        ds = load_dataset(out / f"{split}.parquet")  # auto
        assert ds.format == "verl"
        assert len(ds) == len(want)
        for i, (got, ex) in enumerate(zip(ds, want)):
            assert got.prompt == [{"role": "user", "content": ex["question"] + " " + INSTRUCTION}]
            assert got.label == LABELS[split][i]
            assert got.metadata["data_source"] == "openai/gsm8k"
            assert got.metadata["extra_info"] == {"split": split, "index": i,
                                                  "answer": ex["answer"],
                                                  "question": ex["question"]}


def write_jsonl(src: Path) -> Path:
    src.mkdir()
    for split, rows in (("train", TRAIN), ("test", TEST)):
        (src / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


def test_gsm8k_jsonl_as_published(tmp_path, prepare):
    src = write_jsonl(tmp_path / "gsm8k")
    assert prepare([str(src), str(tmp_path / "out")]) == 0
    check_out(tmp_path / "out")


def test_a_datasets_save_to_disk_directory(tmp_path, prepare):
    datasets = pytest.importorskip("datasets")
    src = tmp_path / "gsm8k_hf"
    # what datasets.load_dataset("openai/gsm8k", "main") returns, saved as a user would
    datasets.DatasetDict({"train": datasets.Dataset.from_list(TRAIN),
                          "test": datasets.Dataset.from_list(TEST)}).save_to_disk(str(src))
    assert prepare([str(src), str(tmp_path / "out")]) == 0
    check_out(tmp_path / "out")
    assert prepare([str(src), str(tmp_path / "two"), "--limit", "2"]) == 0
    check_out(tmp_path / "two", limit=2)


def test_hugging_face_parquet_files_as_the_hub_serves_them(tmp_path, prepare):
    src = tmp_path / "openai_gsm8k"
    (src / "main").mkdir(parents=True)
    for split, rows in (("train", TRAIN), ("test", TEST)):
        pq.write_table(pa.Table.from_pylist(rows),
                       src / "main" / f"{split}-00000-of-00001.parquet")
    done = subprocess.run([sys.executable, str(SCRIPT), str(src), str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "train-00000-of-00001.parquet" in done.stdout
    check_out(tmp_path / "out")
    # the split's files directly in SRC (the `main` folder itself) read the same
    assert prepare([str(src / "main"), str(tmp_path / "out2")]) == 0
    check_out(tmp_path / "out2")


def test_verl_parquet_is_taken_as_it_is(tmp_path, prepare):
    verl = tmp_path / "verl"  # what verl's examples/data_preprocess/gsm8k.py writes
    assert prepare([str(write_jsonl(tmp_path / "gsm8k")), str(verl)]) == 0
    assert prepare([str(verl), str(tmp_path / "out"), "--limit", "1"]) == 0
    for split in ("train", "test"):
        want = pq.read_table(verl / f"{split}.parquet").slice(0, 1)
        assert pq.read_table(tmp_path / "out" / f"{split}.parquet").equals(want)
    check_out(tmp_path / "out", limit=1)


def test_anything_else_is_refused_naming_the_file_and_what_was_expected(tmp_path, prepare,
                                                                         capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare([str(empty), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"prepare_gsm8k_verl: {empty}: no train split found: expected" in err
    assert "save_to_disk" in err and "question, answer" in err and "reward_model" in err
    assert not (tmp_path / "out").exists()  # nothing written

    other = tmp_path / "other"
    other.mkdir()
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist([{"problem": "1+1?", "solution": "2"}]),
                       other / f"{split}.parquet")
    assert prepare([str(other), str(tmp_path / "out")]) == 2
    assert (f"prepare_gsm8k_verl: {other / 'train.parquet'}: expected GSM8K's columns question "
            "and answer (openai/gsm8k) or verl's prompt and reward_model, got problem, "
            "solution") in capsys.readouterr().err

    bad = write_jsonl(tmp_path / "bad")
    (bad / "test.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "four"}) + "\n")
    assert prepare([str(bad), str(tmp_path / "out")]) == 2
    assert (f"prepare_gsm8k_verl: {bad / 'test.jsonl'}: row 0: no '#### <number>' in the "
            "answer 'four'") in capsys.readouterr().err

    not_a_dir = tmp_path / "train.jsonl"
    not_a_dir.write_text("")
    assert prepare([str(not_a_dir), str(tmp_path / "out")]) == 2
    assert f"{not_a_dir}: expected a directory holding GSM8K" in capsys.readouterr().err
