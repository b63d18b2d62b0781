"""Weight updates on a real engine: a trainer process broadcasting over gloo, and disk loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_harness import REPO, Engine, chat_prompt, free_port, greedy_decode, repo_env

from rollmesh.models.loading import build_tiny, materialize

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def fresh_engine(tmp_path_factory):
    """An engine of this module's own: these tests change its weights and version."""
    e = Engine(tmp_path_factory.mktemp("weights") / "engine.log", "--weight-version", "v0")
    yield e
    assert e.stop() == 0, e.log()


def _broadcast(engine: Engine, spec: str, version: str, *extra: str) -> dict:
    cmd = [sys.executable, str(HERE / "trainer_broadcast.py"), engine.url, str(free_port()), spec,
           version, *extra]
    done = subprocess.run(cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("dtype", "seed"), [("float32", 1), ("bfloat16", 2)])
def test_trainer_broadcast_replaces_the_weights(fresh_engine, dtype, seed):
    spec, version = f"tiny:seed={seed}", f"v{seed}"
    new_model, tok = build_tiny(spec)
    if dtype == "bfloat16":  # the engine holds what a bf16 broadcast carries, in float32
        for p in new_model.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    prompt = chat_prompt(tok, "After the sync")
    before = fresh_engine.generate(prompt, max_new_tokens=20, temperature=0, ignore_eos=True)
    assert before["meta_info"]["weight_version"] != version

    replies = _broadcast(fresh_engine, spec, version, *(["--bf16"] if dtype == "bfloat16" else []))
    assert replies["init"]["success"], replies
    assert replies["update"]["success"], replies
    assert replies["destroy"]["success"], replies
    assert fresh_engine.get("/get_model_info")[1]["weight_version"] == version

    after = fresh_engine.generate(prompt, max_new_tokens=20, temperature=0, ignore_eos=True)
    assert after["meta_info"]["weight_version"] == version
    assert after["output_ids"] == greedy_decode(new_model, prompt, 20)
    assert after["output_ids"] != before["output_ids"]
    # bit for bit, read back through SGLang's /get_weights_by_name (float32 lists are exact)
    for name, param in new_model.named_parameters(remove_duplicate=False):
        status, rows = fresh_engine.request("POST", "/get_weights_by_name",
                                            {"name": name, "truncate_size": 3})
        assert status == 200, rows
        assert torch.equal(torch.tensor(rows, dtype=torch.float32), param.detach()[:3]), name


def test_get_weights_by_name_refuses_an_unknown_name(fresh_engine):
    status, body = fresh_engine.request("POST", "/get_weights_by_name", {"name": "no.such"})
    assert (status, body) == (400, {"error": {"message": "Get parameter by name failed"}})
    status, body = fresh_engine.request("POST", "/get_weights_by_name", {"truncate_size": 1})
    assert status == 400 and "name is required" in json.dumps(body)


def test_a_refused_broadcast_leaves_the_model_intact(fresh_engine):
    _, tok = build_tiny("tiny")
    prompt = chat_prompt(tok, "Refused")
    before = fresh_engine.generate(prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    replies = _broadcast(fresh_engine, "tiny:seed=3", "v3", "--bad-name")
    assert replies["update"]["success"] is False
    assert "not.a.weight" in replies["update"]["message"]
    after = fresh_engine.generate(prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    assert after["output_ids"] == before["output_ids"]
    assert after["meta_info"]["weight_version"] == before["meta_info"]["weight_version"]


def test_update_from_disk_and_weight_version(fresh_engine, tmp_path):
    path = materialize("tiny:seed=4", tmp_path / "ckpt")
    model, tok = build_tiny("tiny:seed=4")
    prompt = chat_prompt(tok, "From disk")
    status, reply = fresh_engine.post("/update_weights_from_disk",
                                      {"model_path": str(path), "weight_version": "disk-4"})
    assert status == 200 and reply["success"], reply
    out = fresh_engine.generate(prompt, max_new_tokens=15, temperature=0, ignore_eos=True)
    assert out["meta_info"]["weight_version"] == "disk-4"
    assert out["output_ids"] == greedy_decode(model, prompt, 15)

    status, reply = fresh_engine.post("/update_weight_version", {"new_version": "7"})
    assert status == 200 and reply["success"]
    assert fresh_engine.get("/get_model_info")[1]["weight_version"] == "7"
    out = fresh_engine.generate(prompt, max_new_tokens=3, temperature=0)
    assert out["meta_info"]["weight_version"] == "7"

    status, reply = fresh_engine.post("/update_weights_from_disk",
                                      {"model_path": str(tmp_path / "missing")})
    assert status == 400 and reply["success"] is False
    assert fresh_engine.get("/get_model_info")[1]["weight_version"] == "7"


def test_engine_serves_a_materialized_checkpoint(tmp_path):
    path = materialize("tiny:hidden=32,layers=1,heads=2,kv_heads=1,seed=5", tmp_path / "small")
    model, tok = build_tiny("tiny:hidden=32,layers=1,heads=2,kv_heads=1,seed=5")
    e = Engine(tmp_path / "engine.log", model=str(path))
    try:
        prompt = chat_prompt(tok, "Checkpoint")
        out = e.generate(prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
        assert out["output_ids"] == greedy_decode(model, prompt, 10)
        assert e.get("/get_model_info")[1]["model_path"] == str(path)
    finally:
        assert e.stop() == 0
