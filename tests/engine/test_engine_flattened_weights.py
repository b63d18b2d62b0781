"""Flattened-bucket weight updates on a real engine: a trainer process sending each bucket as one
gloo broadcast of its bytes (`load_format="flattened_bucket"`), and refused buckets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_harness import REPO, Engine, chat_prompt, free_port, greedy_decode, repo_env

from rollmesh.models.loading import build_tiny

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def fresh_engine(tmp_path_factory):
    """An engine of this module's own: these tests change its weights and version."""
    e = Engine(tmp_path_factory.mktemp("flattened") / "engine.log", "--weight-version", "v0")
    yield e
    assert e.stop() == 0, e.log()


def _send(engine: Engine, steps: list[dict]) -> dict:
    cmd = [sys.executable, str(HERE / "bucket_broadcast.py"), engine.url, str(free_port()),
           json.dumps(steps)]
    # The group's timeout is 60 s: a sender stuck in a broadcast nobody receives fails the
    # run, well within this limit.
    done = subprocess.run(cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _reference(spec: str, dtype: str) -> torch.nn.Module:
    model, _ = build_tiny(spec)
    if dtype == "bfloat16":  # the engine holds what a bf16 broadcast carries, in float32
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    return model


def test_flattened_buckets_replace_the_weights_sync_after_sync(fresh_engine):
    """Several syncs in one group: buckets of several tensors and one-tensor buckets (the
    embedding is larger than a bucket), float32 (received into the model: the second sync lands
    straight in the storage the first one left) and bfloat16 (cast into it)."""
    _, tok = build_tiny("tiny")
    prompt = chat_prompt(tok, "Flattened")
    before = fresh_engine.generate(prompt, max_new_tokens=16, temperature=0, ignore_eos=True)
    steps = [{"spec": "tiny:seed=11", "version": "f1", "bucket_kb": 100},
             {"spec": "tiny:seed=12", "version": "f2", "bucket_kb": 100},
             {"spec": "tiny:seed=13", "version": "f3", "bucket_kb": 256, "dtype": "bfloat16"}]
    outs = []
    for step in steps:
        replies = _send(fresh_engine, [step])
        assert replies["init"]["success"] and replies["destroy"]["success"], replies
        (buckets,) = replies["updates"]
        assert len(buckets) >= 3 and all(r["success"] for r in buckets), buckets
        info = fresh_engine.get("/get_model_info")[1]
        assert info["weight_version"] == step["version"]
        out = fresh_engine.generate(prompt, max_new_tokens=16, temperature=0, ignore_eos=True)
        assert out["meta_info"]["weight_version"] == step["version"]
        model = _reference(step["spec"], step.get("dtype", "float32"))
        assert out["output_ids"] == greedy_decode(model, prompt, 16), step
        outs.append(out["output_ids"])
    assert len({tuple(o) for o in [before["output_ids"], *outs]}) == 4  # each sync changed them


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_a_refused_flattened_bucket_is_drained_and_the_next_sync_lands(fresh_engine, bad):
    """A bucket that does not fit the model is received (the sender does not hang), refused
    with a message naming the weight, the model left as it was; the next sync in the same
    group works."""
    _, tok = build_tiny("tiny")
    prompt = chat_prompt(tok, "Refused flattened")
    before = fresh_engine.generate(prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    version = before["meta_info"]["weight_version"]
    good = {"spec": "tiny:seed=21", "version": f"after-{bad}", "bucket_kb": 128}
    replies = _send(fresh_engine, [{"spec": "tiny:seed=20", "version": "never", "bad": bad},
                                   good])
    (refused,), accepted = replies["updates"]
    assert refused["success"] is False, refused
    name = "model.layers.0.self_attn.k_proj.weight"
    assert name in refused["message"]
    assert ("shape" if bad == "shape" else "int32") in refused["message"]
    assert replies["bytes"][0] == 385600 * 4  # the whole bucket went over the wire
    assert all(r["success"] for r in accepted), accepted
    after = fresh_engine.generate(prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    assert after["meta_info"]["weight_version"] == f"after-{bad}" != version
    assert after["output_ids"] == greedy_decode(_reference("tiny:seed=21", "float32"), prompt, 10)
    assert fresh_engine.get("/health_generate")[0] == 200
