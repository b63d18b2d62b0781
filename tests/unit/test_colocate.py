"""Colocated mode's turn on the trainer's side (training/colocate.py), without other roles: the
optimizer state moved to host memory between steps and back changes nothing (the same
parameters, bit for bit, after several steps), and a turn reports its timings."""

from __future__ import annotations

import asyncio

import torch

from rollmesh.training.batching import from_groups
from rollmesh.training.colocate import Turn, move_optimizer_state
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from tests.unit.test_trainer import experiment, make_groups, params_of


def _train(offload: bool, steps: int = 3):
    exp = experiment(f"trainer.offload_optimizer={str(offload).lower()}", "trainer.lr=1e-2")
    state = build_state(exp)
    rows = []

    async def run() -> None:
        for seed in range(steps):
            async with Turn(state, None, None) as turn:  # no sender: no other role to ask
                data = prepare(state, from_groups(make_groups(seed)))
                update_policy(state, data)
            rows.append(turn.metrics())

    asyncio.run(run())
    return state, rows


def test_offloading_the_optimizer_state_changes_nothing():
    kept, _ = _train(offload=False)
    moved, rows = _train(offload=True)
    a, b = params_of(kept), params_of(moved)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the moments went out and back every step: all of AdamW's per-parameter state
    per_step = sum(2 * p.numel() * p.element_size() for p in moved.model.parameters())
    assert [r["colocate_optimizer_bytes"] for r in rows] == [per_step] * 3
    assert all(r["colocate_optimizer_offload_s"] >= 0 and r["colocate_turn_s"] > 0 for r in rows)
    assert "colocate_release_s" not in rows[0]  # rank 0 without a sender releases nothing


def test_moving_the_state_copies_every_moment_and_keeps_the_step_counters():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p])
    p.grad = torch.randn(4, 3)
    opt.step()
    st = opt.state[p]
    before = {k: v.clone() for k, v in st.items()}
    ids = {k: id(v) for k, v in st.items()}
    moved = move_optimizer_state(opt, torch.device("cpu"))
    assert moved == 2 * p.numel() * p.element_size()
    assert id(st["step"]) == ids["step"]  # the scalar counter stays where AdamW keeps it
    for k in ("exp_avg", "exp_avg_sq"):
        assert id(st[k]) != ids[k] and torch.equal(st[k], before[k])
