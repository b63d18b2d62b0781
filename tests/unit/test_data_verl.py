"""Data the way verl users have it: verl's Parquet schema (as its data-preparation scripts write
it, through pyarrow's nested types and through `datasets`' to_parquet), read with
data.format = "verl" and "auto"; its bad rows; Hugging Face `datasets` directories written by
save_to_disk (a Dataset, a DatasetDict and its splits); the missing-extra error; and a short
run that trains on a verl-schema GSM8K Parquet file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollmesh.config import DataConfig
from rollmesh.rollout.data import Dataset, DatasetError, PromptSource, gsm8k_final_answer, load_dataset

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"
pytestmark = pytest.mark.skipif(
    not (GSM8K / "train.jsonl").is_file(), reason=f"GSM8K data not found at {GSM8K}"
)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

S = pa.string()
PROMPT = pa.list_(pa.struct([("role", S), ("content", S)]))
REWARD_MODEL = pa.struct([("style", S), ("ground_truth", S)])
EXTRA_INFO = pa.struct([("split", S), ("index", pa.int64()), ("answer", S), ("question", S)])
VERL_SCHEMA = pa.schema([("data_source", S), ("prompt", PROMPT), ("ability", S),
                         ("reward_model", REWARD_MODEL), ("extra_info", EXTRA_INFO)])


def gsm8k_rows(split: str = "train", n: int = 6) -> list[dict]:
    """The first `n` GSM8K problems as verl's examples/data_preprocess/gsm8k.py maps them."""
    rows = []
    with open(GSM8K / f"{split}.jsonl", encoding="utf-8") as f:
        for idx, line in zip(range(n), f):
            ex = json.loads(line)
            rows.append({
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": ex["question"] + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule",
                                 "ground_truth": gsm8k_final_answer(ex["answer"])},
                "extra_info": {"split": split, "index": idx, "answer": ex["answer"],
                               "question": ex["question"]},
            })
    return rows


def write_verl(path: Path, rows: list[dict], schema: pa.Schema = VERL_SCHEMA) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def check_gsm8k_rows(ds: Dataset, rows: list[dict]) -> None:
    assert len(ds) == len(rows)
    for got, want in zip(ds, rows):
        assert got.prompt == want["prompt"]
        assert got.label == want["reward_model"]["ground_truth"]
        assert isinstance(got.label, str)
        assert got.metadata["data_source"] == "openai/gsm8k"
        assert got.metadata["ability"] == "math"
        assert got.metadata["extra_info"] == want["extra_info"]
        assert got.agent_loop is None and got.tools is None
        # what the rollouter ships: plain, msgpack-serialisable data
        assert msgpack.unpackb(msgpack.packb(got.metadata)) == got.metadata
    assert ds[2].label == "5"  # the third GSM8K problem's answer


def test_verl_parquet_written_with_pyarrow_nested_types(tmp_path):
    rows = gsm8k_rows()
    path = write_verl(tmp_path / "train.parquet", rows)
    schema = pq.read_schema(path)
    assert pa.types.is_list(schema.field("prompt").type)
    assert pa.types.is_struct(schema.field("reward_model").type)
    for fmt in ("verl", "auto"):
        ds = load_dataset(path, format=fmt)
        assert ds.format == "verl", fmt
        check_gsm8k_rows(ds, rows)
    # explicitly `parquet`: the flat reader, which wants a `label` column
    with pytest.raises(DatasetError, match=r"train\.parquet: row 0: missing key 'label'"):
        load_dataset(path, format="parquet")


def test_verl_parquet_written_by_datasets_as_verl_does(tmp_path):
    datasets = pytest.importorskip("datasets")  # the test extra has it; verl writes this way
    rows = gsm8k_rows(n=8)
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    ds = load_dataset(path)  # auto
    assert ds.format == "verl"
    check_gsm8k_rows(ds, rows)


def test_the_preparation_script_writes_what_verl_writes(tmp_path):
    out = tmp_path / "gsm8k_verl"
    done = subprocess.run([sys.executable, "launch/prepare_gsm8k_verl.py", str(GSM8K), str(out),
                           "--limit", "6"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert pq.read_schema(out / "train.parquet").remove_metadata().equals(VERL_SCHEMA)
    check_gsm8k_rows(load_dataset(out / "train.parquet"), gsm8k_rows(n=6))
    test = load_dataset(out / "test.parquet", format="verl")
    assert test[0].metadata["extra_info"]["split"] == "test"

    # the example experiment reads those files as they are
    from rollmesh.config import load_experiment

    exp = load_experiment(ROOT / "configs" / "gsm8k_verl.toml", [
        f"data.train_path={out / 'train.parquet'}", f"data.eval_path={out / 'test.parquet'}"])
    assert exp.data.format == "verl"
    assert len(Dataset.from_config(exp.data)) == 6
    assert Dataset.from_config(exp.data, eval=True)[0].metadata["data_source"] == "openai/gsm8k"


def test_labels_other_columns_and_math_style_sources(tmp_path):
    rows = [
        {"data_source": "DigitalLearningGmbH/MATH-lighteval",
         "prompt": [{"role": "system", "content": "box it"},
                    {"role": "user", "content": "1/2 + 1/2?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "1"},
         "extra_info": {"split": "test", "index": 0}},
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "6 * 7?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "42"},
         "extra_info": {"split": "test", "index": 1}},
    ]
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # extra_info's struct: inferred
    ds = load_dataset(path, format="verl")
    assert [r.label for r in ds] == ["1", "42"]
    assert [r.metadata["data_source"] for r in ds] == [
        "DigitalLearningGmbH/MATH-lighteval", "openai/gsm8k"]
    assert ds[0].prompt[0] == {"role": "system", "content": "box it"}

    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.Table.from_pylist([{**rows[1], "reward_model": {"ground_truth": 7}}]), ints)
    assert pq.read_schema(ints).field("reward_model").type.field("ground_truth").type == pa.int64()
    (row,) = load_dataset(ints)
    assert row.label == "7"  # a number becomes its string
    floats = tmp_path / "floats.parquet"
    pq.write_table(pa.Table.from_pylist([{**rows[1], "reward_model": {"ground_truth": 2.5}}]),
                   floats)
    assert load_dataset(floats)[0].label == "2.5"

    # messages of one column share one struct type: fields a message did not have are dropped
    tools = tmp_path / "tools.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "prompt": [{"role": "user", "content": "hi", "name": None},
                   {"role": "assistant", "content": None, "name": "bot"}],
        "reward_model": {"ground_truth": "x"}}]), tools)
    (row,) = load_dataset(tools)
    assert row.prompt == [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": None, "name": "bot"}]
    assert row.metadata == {"reward_model": {"ground_truth": "x"}}

    # system_prompt: the row's own system message wins, as for any chat prompt
    ds = load_dataset(path, format="verl", system_prompt="be brief")
    assert ds[0].prompt[0]["content"] == "box it"
    assert ds[1].prompt[0] == {"role": "system", "content": "be brief"}


def test_bad_verl_rows_name_the_file_the_row_and_the_problem(tmp_path):
    good = gsm8k_rows(n=1)[0]
    cases = [
        ({**good, "reward_model": {"style": "rule", "ground_truth": None}},
         "row 1: 'reward_model.ground_truth': missing or null"),
        ({**good, "reward_model": None},
         "row 1: missing 'reward_model' (expected a struct holding 'ground_truth')"),
        ({**good, "prompt": None}, "row 1: 'prompt': expected a list of chat messages, got null"),
        ({**good, "prompt": []}, "row 1: 'prompt': empty message list"),
        ({**good, "prompt": [{"role": None, "content": "x"}]},
         "row 1: 'prompt'[0].role: expected a string, got null"),
    ]
    for i, (bad, problem) in enumerate(cases):
        path = write_verl(tmp_path / f"bad{i}.parquet", [good, bad, good])
        with pytest.raises(DatasetError) as err:
            load_dataset(path, format="verl")
        assert str(err.value) == f"{path}: {problem}"
        ds = load_dataset(path, format="verl", skip_bad_rows=True)
        assert (len(ds), ds.skipped, [r.index for r in ds]) == (2, 1, [0, 2])

    # a string prompt is not verl's schema
    flat = tmp_path / "flat.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "reward_model": {"ground_truth": "1"}}]),
                   flat)
    with pytest.raises(DatasetError, match=r"flat\.parquet: row 0: 'prompt': expected a list of "
                                           r"chat messages, got str"):
        load_dataset(flat)
    # no reward_model column: auto reads it as flat Parquet; verl names what is missing
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "label": "1"}]), plain)
    assert load_dataset(plain).format == "parquet"
    with pytest.raises(DatasetError) as err:
        load_dataset(plain, format="verl")
    assert str(err.value) == f"{plain}: row 0: 'prompt': expected a list of chat messages, got str"
    with pytest.raises(DatasetError, match=r"nothing\.parquet: no such file"):
        load_dataset(tmp_path / "nothing.parquet", format="verl")


def test_hf_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    train, test = gsm8k_rows("train", 6), gsm8k_rows("test", 4)
    one = tmp_path / "one"
    datasets.Dataset.from_list(train).save_to_disk(str(one))
    for fmt in ("hf", "auto"):
        ds = load_dataset(one, format=fmt)
        assert ds.format == "hf"
        check_gsm8k_rows(ds, train)
    with pytest.raises(DatasetError, match="split 'train' named, but .* holds one Dataset"):
        load_dataset(f"{one}:train", format="hf")

    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(both))
    assert len(load_dataset(f"{both}:test", format="hf")) == 4
    assert len(load_dataset(f"{both}:train")) == 6  # auto: DIR:SPLIT is a datasets directory
    assert len(load_dataset(both / "test", format="hf")) == 4  # one split's own directory
    with pytest.raises(DatasetError) as err:
        load_dataset(both, format="hf")
    assert str(err.value) == (
        f"{both}: a DatasetDict with splits train, test: name one as {both}:SPLIT")
    with pytest.raises(DatasetError, match=r"no split 'dev' \(splits: train, test\)"):
        load_dataset(f"{both}:dev", format="hf")
    # from a config: train_path gets the train split, eval_path the test split
    cfg = DataConfig(train_path=str(both), eval_path=str(both), format="hf")
    assert [r.metadata["extra_info"]["split"] for r in Dataset.from_config(cfg)] == ["train"] * 6
    assert [r.metadata["extra_info"]["split"]
            for r in Dataset.from_config(cfg, eval=True)] == ["test"] * 4
    assert len(PromptSource.from_config(cfg).rows) == 6

    # rows without reward_model: read like JSONL rows (prompt_key / label_key), GSM8K detected
    flat = tmp_path / "flat"
    datasets.Dataset.from_list([{"q": "2+2?", "a": "4"}]).save_to_disk(str(flat))
    (row,) = load_dataset(flat, format="hf", prompt_key="q", label_key="a")
    assert (row.prompt, row.label, row.metadata) == ("2+2?", "4", {})
    raw = tmp_path / "raw"
    lines = (GSM8K / "train.jsonl").read_text().splitlines()[:3]
    datasets.Dataset.from_list([json.loads(x) for x in lines]).save_to_disk(str(raw))
    cfg = DataConfig(train_path=str(raw), format="hf")
    rows = Dataset.from_config(cfg)
    assert [r.label for r in rows] == ["72", "10", "5"]

    with pytest.raises(DatasetError, match=r"not a Hugging Face datasets directory"):
        load_dataset(tmp_path, format="hf")
    with pytest.raises(DatasetError, match=r"missing: no such directory"):
        load_dataset(tmp_path / "missing", format="hf")


def test_hf_without_the_datasets_package_names_the_extra(tmp_path):
    code = (
        "import sys; sys.modules['datasets'] = None\n"  # import datasets now raises ImportError
        "from rollmesh.rollout.data import DatasetError, load_dataset\n"
        "try:\n"
        f"    load_dataset({str(tmp_path)!r}, format='hf')\n"
        "except DatasetError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"{tmp_path}: data.format = 'hf' needs the `datasets` package: "
        "pip install 'rollmesh[datasets]'"
    )


