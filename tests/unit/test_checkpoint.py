"""Checkpoints: a round trip in-process, atomic writes, kill-and-resume of a real trainer process,
and the Hugging Face export loaded by transformers and by the built-in engine."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rollmesh.training import checkpoint, checkpoint_io
from rollmesh.training.batching import from_groups
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from tests.unit.test_trainer import (
    GAE, experiment, make_groups, max_diff, params_of, reference_run, torch_threads,
)


def trained_state(*overrides: str):
    exp = experiment("trainer.warmup_steps=3", 'trainer.lr_schedule="cosine"', *overrides)
    with torch_threads(1):
        state = build_state(exp)
        update_policy(state, prepare(state, from_groups(make_groups(3))))
    state.step, state.version, state.samples_consumed = 1, 1, 8
    return exp, state


def test_save_and_load_restore_model_optimizer_scheduler_and_rngs(tmp_path):
    exp, state = trained_state()
    torch.manual_seed(123)
    np.random.seed(7)
    random.seed(9)
    path = checkpoint.save(tmp_path, model=state.model, optimizer=state.optimizer,
                           scheduler=state.scheduler, step=state.step, version=state.version,
                           tokenizer=state.tokenizer, samples_consumed=8,
                           data_cursor={"epoch": 0, "position": 5, "order": [3, 1, 2]})
    assert path == tmp_path / "step_00000001" and checkpoint.latest(tmp_path) == path
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    expected_rng = (torch.rand(3), np.random.rand(3), random.random())

    fresh = build_state(exp)
    saved = checkpoint.load(path, model=fresh.model, optimizer=fresh.optimizer,
                            scheduler=fresh.scheduler)
    assert (saved["step"], saved["version"], saved["samples_consumed"]) == (1, 1, 8)
    assert saved["data_cursor"] == {"epoch": 0, "position": 5, "order": [3, 1, 2]}
    assert max_diff(params_of(fresh), params_of(state)) == 0
    for p, q in zip(state.model.parameters(), fresh.model.parameters()):
        a, b = state.optimizer.state[p], fresh.optimizer.state[q]
        assert sorted(a) == sorted(b) == ["exp_avg", "exp_avg_sq", "step"]
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert fresh.scheduler.state_dict()["last_epoch"] == state.scheduler.state_dict()["last_epoch"]
    assert fresh.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]
    assert fresh.optimizer.param_groups[0]["betas"] == state.optimizer.param_groups[0]["betas"]
    got_rng = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got_rng[0], expected_rng[0])
    assert np.array_equal(got_rng[1], expected_rng[1]) and got_rng[2] == expected_rng[2]
    # the checkpoint holds no pickle: safetensors, JSON and msgpack only
    names = sorted(f.name for f in path.iterdir())
    assert all(n.endswith((".safetensors", ".json", ".msgpack", ".jinja")) for n in names), names


def save_state(directory, state):
    return checkpoint.save(directory, model=state.model, optimizer=state.optimizer,
                           scheduler=state.scheduler, step=state.step, version=state.version,
                           tokenizer=state.tokenizer, samples_consumed=state.samples_consumed,
                           critic=state.critic, critic_optimizer=state.critic_optimizer,
                           critic_scheduler=state.critic_scheduler)


def load_state(path, state):
    saved = checkpoint.load(path, model=state.model, optimizer=state.optimizer,
                            scheduler=state.scheduler, critic=state.critic,
                            critic_optimizer=state.critic_optimizer,
                            critic_scheduler=state.critic_scheduler)
    state.step, state.version = saved["step"], saved["version"]
    state.samples_consumed = saved["samples_consumed"]
    return saved


def test_gae_checkpoint_restores_the_critic_and_the_next_step_matches_an_uninterrupted_run(
        tmp_path):
    """Step 1, save, a new trainer state loads it and runs step 2: the same value loss, policy
    loss and parameters (policy and critic) as one uninterrupted run, bit for bit."""
    batches = [make_groups(20), make_groups(21)]
    # two mini-batches and a warm-up: step 2 uses the restored AdamW states and schedules
    common = (*GAE, "trainer.mini_batches=2", "trainer.warmup_steps=2",
              'trainer.lr_schedule="cosine"', "trainer.lr=2e-4")
    exp = experiment(*common)
    uninterrupted, expected = reference_run(exp, batches)
    with torch_threads(1):
        first = build_state(exp)
        update_policy(first, prepare(first, from_groups(batches[0])))
        first.step, first.version, first.samples_consumed = 1, 1, 8
        path = save_state(tmp_path, first)
        assert set(checkpoint.read_tensors(path, "critic")) == {
            n for n, _ in first.critic.named_parameters()}
        assert {k.rsplit(".", 1)[0] for k in checkpoint.read_tensors(path, "critic_optimizer")
                } == {n for n, _ in first.critic.named_parameters()}
        resumed = build_state(exp)
        load_state(path, resumed)
        assert max_diff(params_of(resumed, "critic"), params_of(first, "critic")) == 0
        for p, q in zip(first.critic.parameters(), resumed.critic.parameters()):
            a, b = first.critic_optimizer.state[p], resumed.critic_optimizer.state[q]
            assert sorted(a) == sorted(b) == ["exp_avg", "exp_avg_sq", "step"]
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert resumed.critic_scheduler.last_epoch == first.critic_scheduler.last_epoch == 2
        stats = update_policy(resumed, prepare(resumed, from_groups(batches[1])))
    for key in ("value_loss", "loss", "critic_lr", "lr", "critic_grad_norm", "value_mean"):
        assert stats[key] == pytest.approx(expected[1][key], abs=1e-7), key
    assert max_diff(params_of(resumed), params_of(uninterrupted)) < 1e-7
    assert max_diff(params_of(resumed, "critic"), params_of(uninterrupted, "critic")) < 1e-7
    # a GAE run cannot resume from a checkpoint without a critic
    _, policy_only = trained_state()
    plain = save_state(tmp_path / "plain", policy_only)
    with pytest.raises(ValueError, match="holds no critic"):
        load_state(plain, build_state(exp))


def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    exp, state = trained_state()
    kw = dict(model=state.model, optimizer=state.optimizer, scheduler=state.scheduler,
              tokenizer=state.tokenizer)
    first = checkpoint.save(tmp_path, step=1, version=1, **kw)
    real = checkpoint_io.write_safetensors

    def crash_half_way(path, specs, tensors, **k):
        def some():
            for i, t in enumerate(tensors):
                if i == len(specs) // 2:
                    raise OSError("disk full")
                yield t
        return real(path, specs, some(), **k)

    monkeypatch.setattr(checkpoint_io, "write_safetensors", crash_half_way)
    with pytest.raises(checkpoint.CheckpointError, match="rank 0: OSError: disk full"):
        checkpoint.save(tmp_path, step=2, version=2, **kw)
    assert checkpoint.latest(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]




def test_only_the_latest_checkpoints_are_kept_and_what_a_killed_save_left_goes(tmp_path):
    """trainer.keep_checkpoints: once a new checkpoint is `latest`, the older ones beyond `keep`
    go, and so does the temporary directory of a save that was killed (a power cut)."""
    exp, state = trained_state()
    kw = dict(model=state.model, optimizer=state.optimizer, scheduler=state.scheduler,
              tokenizer=state.tokenizer)
    (tmp_path / ".tmp-step_00000002-deadbeef").mkdir()  # a save killed half-way
    for step in (1, 2, 3):
        last = checkpoint.save(tmp_path, step=step, version=step, keep=2, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step_00000002", "step_00000003"]
    assert checkpoint.latest(tmp_path) == last
    checkpoint.save(tmp_path, step=4, version=4, keep=0, **kw)  # 0: all kept
    assert len(list(tmp_path.glob("step_*"))) == 3
    assert [p.name for p in checkpoint.prune(tmp_path, 1)] == ["step_00000002", "step_00000003"]
    assert checkpoint.latest(tmp_path).name == "step_00000004"
