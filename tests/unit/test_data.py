"""rollmesh.rollout.data: JSONL rows (text and chat prompts), every bad row's exact message, GSM8K from
the real file, the cursor's determinism and exact resume across epochs, prompt groups, and
prompt rendering through a chat template."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgpack
import pytest

from rollmesh.config import DataConfig
from rollmesh.rollout.data import (
    Dataset,
    DatasetError,
    PromptCursor,
    PromptRow,
    PromptSource,
    gsm8k_final_answer,
    load_dataset,
    render_prompt,
    with_system_prompt,
)
from tests.helpers.prompts import drop_long_prompts

GSM8K = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k"
needs_gsm8k = pytest.mark.skipif(
    not (GSM8K / "train.jsonl").is_file(), reason=f"GSM8K data not found at {GSM8K}"
)

CHAT = [{"role": "user", "content": "what is 2 + 2 ?"}]
TOOLS = [{"name": "calc", "parameters": {"type": "object"}}]


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# -- JSONL ---------------------------------------------------------------------------------------


def test_text_and_chat_prompts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "hello world", "label": "42", "source": "a", "difficulty": 3},
        "   ",  # blank lines are not rows
        {"prompt": CHAT, "label": {"answer": 4}, "agent_loop": "tool_agent", "tools": TOOLS},
        {"prompt": "x", "label": None, "agent_loop": None, "tools": None},
    ])
    ds = load_dataset(path)
    assert (ds.format, len(ds), ds.skipped) == ("jsonl", 3, 0)
    assert ds[0] == PromptRow(0, "hello world", "42", {"source": "a", "difficulty": 3})
    assert ds[1] == PromptRow(1, CHAT, {"answer": 4}, {}, "tool_agent", TOOLS)
    assert ds[2] == PromptRow(2, "x", None, {})


def test_custom_keys(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "hello", "a": 1, "prompt": "not me"}])
    (row,) = load_dataset(path, prompt_key="q", label_key="a")
    assert (row.prompt, row.label, row.metadata) == ("hello", 1, {"prompt": "not me"})


BAD_ROWS = [
    ('{"prompt": "a", "label": 1', "invalid JSON: Expecting ',' delimiter at column 27"),
    ("{bad", "invalid JSON: Expecting property name enclosed in double quotes at column 2"),
    ('["prompt", "label"]', "expected a JSON object, got list"),
    ({"label": 1, "question": "q"}, "missing key 'prompt' (row keys: label, question)"),
    ({"prompt": "p"}, "missing key 'label' (row keys: prompt)"),
    ({"prompt": 5, "label": 1}, "'prompt': expected a string or a list of chat messages, got int"),
    ({"prompt": None, "label": 1},
     "'prompt': expected a string or a list of chat messages, got null"),
    ({"prompt": "  ", "label": 1}, "'prompt': empty prompt"),
    ({"prompt": [], "label": 1}, "'prompt': empty message list"),
    ({"prompt": ["hi"], "label": 1}, "'prompt'[0]: expected a message object, got str"),
    ({"prompt": [{"content": "hi"}], "label": 1}, "'prompt'[0].role: expected a string, got null"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "user"}], "label": 1},
     "'prompt'[1].content: expected a string, a list or null, got nothing"),
    ({"prompt": [{"role": "user", "content": 3}], "label": 1},
     "'prompt'[0].content: expected a string, a list or null, got int"),
    ({"prompt": "p", "label": 1, "agent_loop": 7},
     "'agent_loop': expected a string or null, got int"),
    ({"prompt": "p", "label": 1, "tools": {"calc": 1}},
     "'tools': expected a list or null, got dict"),
]


@pytest.mark.parametrize("bad,problem", BAD_ROWS)
def test_bad_row_is_an_error_naming_file_line_and_problem(tmp_path, bad, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "label": 1}, "", bad])
    with pytest.raises(DatasetError) as err:
        load_dataset(path)
    assert str(err.value) == f"{path}: line 3: {problem}"
    assert (err.value.path, err.value.where, err.value.problem) == (str(path), "line 3", problem)


def test_skip_bad_rows_counts_them_and_keeps_indices(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "a", "label": 1}, "{bad", {"prompt": 3, "label": 1}, {"prompt": "d", "label": 4},
    ])
    ds = load_dataset(path, skip_bad_rows=True)
    assert ds.skipped == 2
    assert [(r.index, r.prompt) for r in ds] == [(0, "a"), (3, "d")]


def test_file_level_errors(tmp_path, monkeypatch):
    with pytest.raises(DatasetError, match=r"nope\.jsonl: no such file$"):
        load_dataset(tmp_path / "nope.jsonl")
    empty = write_jsonl(tmp_path / "e.jsonl", ["", "  "])
    with pytest.raises(DatasetError, match=r"e\.jsonl: no rows$"):
        load_dataset(empty)
    allbad = write_jsonl(tmp_path / "b.jsonl", ["{bad"])
    with pytest.raises(DatasetError, match=r"b\.jsonl: no rows \(1 bad rows skipped\)$"):
        load_dataset(allbad, skip_bad_rows=True)
    with pytest.raises(DatasetError, match="unknown format 'csv'"):
        load_dataset(empty, format="csv")

    pq = tmp_path / "d.parquet"
    pq.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError) as err:
        load_dataset(pq)
    assert str(err.value) == (
        f"{pq}: reading Parquet needs pyarrow, which is not installed (pip install pyarrow)"
    )


def test_parquet(tmp_path):
    import pyarrow as pa  # a dependency: Parquet is tested, never skipped
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"prompt": "hello", "label": "1", "extra": 2}, {"prompt": "bye", "label": "2", "extra": 3},
    ]), path)
    ds = load_dataset(path)
    assert ds.format == "parquet"
    assert ds[1] == PromptRow(1, "bye", "2", {"extra": 3})
    bad = tmp_path / "bad.parquet"
    bad_rows = [{"prompt": "a", "label": 1}, {"prompt": None, "label": 1}]
    pq.write_table(pa.Table.from_pylist(bad_rows), bad)
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 1: 'prompt': expected a string"):
        load_dataset(bad)


def test_system_prompt(tmp_path):
    sys_msg = {"role": "system", "content": "be brief"}
    assert with_system_prompt("hi", None) == "hi"
    assert with_system_prompt("hi", "be brief") == [sys_msg, {"role": "user", "content": "hi"}]
    assert with_system_prompt(CHAT, "be brief") == [sys_msg, *CHAT]
    own = [{"role": "system", "content": "mine"}, *CHAT]
    assert with_system_prompt(own, "be brief") == own  # the row's own system message wins

    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi", "label": 1}])
    (row,) = load_dataset(path, system_prompt="be brief")
    assert row.prompt == [sys_msg, {"role": "user", "content": "hi"}]


# -- GSM8K ---------------------------------------------------------------------------------------


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("a = <<1+1=2>>2\n#### 72") == "72"
    assert gsm8k_final_answer("x\n####   1,000  ") == "1000"
    assert gsm8k_final_answer("#### 1,234,567") == "1234567"
    assert gsm8k_final_answer("#### -3") == "-3"
    assert gsm8k_final_answer("#### 1\nmore\n#### 2") == "2"
    assert gsm8k_final_answer("no final line #### 5") is None
    assert gsm8k_final_answer("####   ") is None


@needs_gsm8k
def test_gsm8k_real_file():
    ds = load_dataset(GSM8K / "train.jsonl")  # auto-detected from question/answer
    assert (ds.format, len(ds)) == ("gsm8k", 7473)
    first = ds[0]
    assert first.label == "72"
    assert first.prompt.startswith("Natalia sold clips to 48 of her friends in April")
    assert first.metadata["solution"].endswith("#### 72")
    assert "<<48+24=72>>" in first.metadata["solution"]
    assert (ds[345].label, ds[345].metadata["solution"].splitlines()[-1]) == ("1080", "#### 1,080")
    assert ds[367].label == "850000"
    assert all(r.label.lstrip("-").isdigit() for r in ds)

    cfg = DataConfig(
        train_path=str(GSM8K / "train.jsonl"), eval_path=str(GSM8K / "test.jsonl"),
        format="gsm8k", prompt_key="question", label_key="answer", system_prompt="be brief",
    )
    ev = Dataset.from_config(cfg, eval=True)
    assert (ev.format, len(ev)) == ("gsm8k", 1319)
    assert ev[0].prompt[0] == {"role": "system", "content": "be brief"}
    # The config's default keys mean GSM8K's own fields.
    assert Dataset.from_config(DataConfig(train_path=str(GSM8K / "test.jsonl"))).format == "gsm8k"


def test_gsm8k_bad_answer(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [
        {"question": "q1", "answer": "so\n#### 4"}, {"question": "q2", "answer": "no final line"},
    ])
    with pytest.raises(DatasetError) as err:
        load_dataset(path, format="gsm8k")
    assert str(err.value) == f"{path}: line 2: 'answer': no '#### <answer>' line"


# -- cursor and source ---------------------------------------------------------------------------


def draws(cursor: PromptCursor, n: int) -> list[int]:
    return [cursor.next() for _ in range(n)]


def test_cursor_epochs_are_permutations():
    c = PromptCursor(10, seed=3)
    epochs = [draws(c, 10) for _ in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3  # a new order each epoch
    assert draws(PromptCursor(10, seed=3), 30) == sum(epochs, [])  # deterministic
    assert draws(PromptCursor(10, seed=4), 10) != epochs[0]
    assert draws(PromptCursor(4, shuffle=False), 9) == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert c.epoch == 2 and c.offset == 10


@pytest.mark.parametrize("k", [0, 1, 6, 7, 8, 13, 14, 20])
def test_cursor_resume_is_exact_across_epochs(k):
    n, m = 7, 25
    uninterrupted = draws(PromptCursor(n, seed=11), k + m)
    first = PromptCursor(n, seed=11)
    draws(first, k)
    state = msgpack.unpackb(msgpack.packb(first.state()))  # plain data, as in a checkpoint
    restored = PromptCursor.from_state(state, n_rows=n)
    assert draws(restored, m) == uninterrupted[k:]


def test_cursor_state_and_errors():
    c = PromptCursor(5, seed=1)
    draws(c, 7)
    assert c.state() == {"n_rows": 5, "epoch": 1, "offset": 2, "seed": 1, "shuffle": True}
    with pytest.raises(ValueError, match="saved cursor is for 5 rows, the dataset has 6"):
        PromptCursor.from_state(c.state(), n_rows=6)
    with pytest.raises(ValueError, match="n_rows: expected int >= 1, got 0"):
        PromptCursor(0)


def rows(n: int) -> list[PromptRow]:
    return [PromptRow(i * 10, f"p{i}", str(i)) for i in range(n)]  # index != position


def test_prompt_source_groups_and_restore():
    src = PromptSource(rows(3), group_size=4, seed=5)
    groups = [src.next_group() for _ in range(7)]
    assert all(g.group_size == 4 for g in groups)
    assert len({g.group_id for g in groups}) == 7
    assert sorted(g.row.index for g in groups[:3]) == [0, 10, 20]
    g = groups[4]
    assert (g.epoch, g.group_id) == (1, f"e1-r{g.row.index}-g4")

    src2 = PromptSource(rows(3), group_size=4, seed=5)
    for _ in range(4):
        src2.next_group()
    saved = src2.state()
    fresh = PromptSource(rows(3), group_size=4, seed=5)
    fresh.restore(saved)
    assert [fresh.next_group() for _ in range(3)] == groups[4:]

    cfg = DataConfig(train_path="unused", group_size=2, seed=5, shuffle=False)
    src3 = PromptSource.from_config(cfg, rows(2))
    assert [(g.row.index, g.group_size) for g in (src3.next_group(), src3.next_group())] == [
        (0, 2), (10, 2)
    ]


# -- rendering -----------------------------------------------------------------------------------

WORDS = ["<unk>", "<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "tool", "calc",
         "hello", "world", "be", "brief", "what", "is", "2", "+", "?"]
TEMPLATE = (
    "{% if tools %}{% for t in tools %}tool {{ t.name }} {% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(WORDS[:6])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    return fast


def ids(text: str) -> list[int]:
    return [WORDS.index(w) for w in text.split()]


def test_render_prompt(tokenizer):
    text = PromptRow(0, "hello world")
    # a text prompt is the user's message, through the template, never encoded raw
    assert render_prompt(text, tokenizer) == ids("<|user|> hello world <|end|> <|assistant|>")
    assert render_prompt(PromptRow(1, CHAT), tokenizer) == ids(
        "<|user|> what is 2 + 2 ? <|end|> <|assistant|>"
    )
    assert render_prompt(text, tokenizer, system_prompt="be brief") == ids(
        "<|system|> be brief <|end|> <|user|> hello world <|end|> <|assistant|>"
    )
    with_tools = PromptRow(2, CHAT, tools=TOOLS)
    assert render_prompt(with_tools, tokenizer) == ids(
        "tool calc <|user|> what is 2 + 2 ? <|end|> <|assistant|>"
    )
    short = PromptRow(3, "hello")
    kept = drop_long_prompts([short, PromptRow(1, CHAT)], tokenizer, max_prompt_tokens=5)
    assert kept == [short]


def test_render_chat_needs_a_template(tokenizer):
    bare = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer)
    bare.chat_template = None
    assert render_prompt(PromptRow(0, "hello"), bare) == ids("<s> hello")
    with pytest.raises(ValueError, match="row 3: the prompt is chat messages but the tokenizer"):
        render_prompt(PromptRow(3, CHAT), bare)


QWEN_TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "llama3.1"])
def test_prompts_render_through_the_real_chat_templates(family):
    """Text and message prompts, with and without tools, come out exactly as the family's own
    template renders them (Qwen2.5's default system prompt and tool block included)."""
    from tests.helpers.hf_checkpoints import build_tokenizer

    tok = build_tokenizer(family)

    def expected(messages, tools=None):
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=True)
        return text, tok.encode(text, add_special_tokens=False)

    user = [{"role": "user", "content": "What is 12 plus 30?"}]
    text, want = expected(user)
    assert render_prompt(PromptRow(0, "What is 12 plus 30?"), tok) == want
    if family == "qwen2.5":
        assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                        "helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 12 plus 30?"
                        "<|im_end|>\n<|im_start|>assistant\n")
    if family == "llama3.1":
        assert want[0] == tok.bos_token_id and want.count(tok.bos_token_id) == 1
    text, want = expected([{"role": "system", "content": "Be brief."}, *user], QWEN_TOOLS)
    assert render_prompt(PromptRow(1, user, tools=QWEN_TOOLS), tok, "Be brief.") == want
    assert '"name": "calculator"' in text and "Be brief." in text
