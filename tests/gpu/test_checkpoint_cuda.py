"""Checkpoint format 2 from a CUDA trainer: the shards go to pinned host buffers (kept for the
next save) by one non-blocking copy and a synchronize, the writing goes on while the weights
change on the device, and the checkpoint loads back bit for bit."""

from __future__ import annotations

import pytest
import torch

from rollmesh.training import checkpoint
from rollmesh.training.batching import from_groups
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from tests.unit.test_trainer import experiment, make_groups


def test_cuda_save_uses_pinned_buffers_again_and_loads_back(tmp_path):
    exp = experiment("trainer.device=cuda", "model.dtype=float32")
    state = build_state(exp, device=torch.device("cuda"))
    update_policy(state, prepare(state, from_groups(make_groups(1))))
    want = {n: p.detach().cpu().clone() for n, p in state.model.named_parameters()}
    kw = dict(model=state.model, optimizer=state.optimizer, scheduler=state.scheduler,
              tokenizer=state.tokenizer, version=1)
    pending = checkpoint.start_save(tmp_path, step=1, **kw)
    buffers = dict(checkpoint.HOST_BUFFERS.buffers)
    assert buffers and all(b.is_pinned() for b in buffers.values())
    with pytest.raises(RuntimeError, match="still being written"):
        checkpoint.start_save(tmp_path, step=9, **kw)
    update_policy(state, prepare(state, from_groups(make_groups(2))))  # changes the weights
    assert pending.wait(checkpoint.Ranks()) == tmp_path / "step_00000001"
    checkpoint.save(tmp_path, step=2, **kw)
    assert all(checkpoint.HOST_BUFFERS.buffers[n] is b for n, b in buffers.items())
    fresh = build_state(exp, device=torch.device("cuda"))
    checkpoint.load(tmp_path / "step_00000001", model=fresh.model, optimizer=fresh.optimizer,
                    scheduler=fresh.scheduler)
    for n, p in fresh.model.named_parameters():
        assert torch.equal(p.detach().cpu(), want[n]), n
