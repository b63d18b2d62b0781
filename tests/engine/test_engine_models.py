"""The tiny model and its tokenizer: specs, determinism, the committed asset, checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rollmesh.models import loading as models

GSM8K = Path("/work/shared/data/gsm8k")


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("tiny:foo=1", "unknown key 'foo'"),
        ("tiny:hidden=x", "needs an integer"),
        ("tiny:hidden", "needs an integer"),
        ("tiny:hidden=60,heads=8", "multiple of heads"),
        ("tiny:heads=4,kv_heads=3", "multiple of kv_heads"),
        ("tiny:layers=0", "must be positive"),
        ("huge", "expected 'tiny'"),
    ],
)
def test_bad_specs_name_the_problem(spec, needle):
    with pytest.raises(models.ModelSpecError, match=needle):
        models.TinySpec.parse(spec)


def test_spec_values():
    s = models.TinySpec.parse("tiny:hidden=128, layers=4,heads=4,kv_heads=2,seed=1")
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.seed) == (128, 4, 4, 2, 1)
    assert models.TinySpec.parse("tiny") == models.TinySpec()


def test_build_tiny_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, tok = models.build_tiny("tiny")
    assert torch.equal(torch.rand(1), expected_next)
    b, _ = models.build_tiny("tiny")
    c, _ = models.build_tiny("tiny:seed=1")
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert a.config.vocab_size == len(tok) and a.config.hidden_size == 64
    assert a.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")


def test_tokenizer_asset_round_trips_and_has_the_chat_template():
    assert models.TOKENIZER_FILE.stat().st_size < 200_000
    tok = models.tiny_tokenizer()
    rows = GSM8K.joinpath("test.jsonl").read_text().splitlines()[:50] if GSM8K.exists() else []
    texts = [t for row in rows for t in json.loads(row).values()] + ["unicode: é ü 😀 日本"]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+3?"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids


@pytest.mark.skipif(not GSM8K.exists(), reason="GSM8K data not on this machine")
def test_build_tokenizer_regenerates_the_committed_asset(tmp_path):
    out = models.build_tokenizer(GSM8K, tmp_path / "tokenizer.json")
    assert out.read_bytes() == models.TOKENIZER_FILE.read_bytes()


def test_materialize_then_load_gives_the_same_model(tmp_path):
    spec = "tiny:hidden=32,layers=1,heads=2,kv_heads=1,seed=4"
    path = models.materialize(spec, tmp_path / "ckpt")
    loaded, tok = models.load_model(str(path), torch.device("cpu"), torch.float32)
    built, built_tok = models.build_tiny(spec)
    sl, sb = loaded.state_dict(), built.state_dict()
    assert sl.keys() == sb.keys() and all(torch.equal(sl[k], sb[k]) for k in sb)
    text = "Natalia sold 48/2 = <<48/2=24>>24 clips"
    assert tok.encode(text) == built_tok.encode(text)
    assert tok.chat_template == built_tok.chat_template


def test_load_model_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(models.ModelSpecError, match="config.json"):
        models.load_model(str(tmp_path), torch.device("cpu"), torch.float32)
    assert models.resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert models.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
