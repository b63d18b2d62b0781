"""The trainer on CUDA: a bf16 step on one GPU (autocast over float32 master weights), and FSDP2
over two GPUs with NCCL (bf16 mixed precision) when the host has two."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch

from rollmesh.training.batching import from_groups
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from tests.unit.test_trainer import experiment, make_groups

CUDA = torch.device("cuda")


def _step(state) -> dict:
    return update_policy(state, prepare(state, from_groups(make_groups(1))))


def test_bf16_step_on_one_gpu():
    exp = experiment("trainer.device=cuda", "model.dtype=bfloat16", "trainer.backend=nccl")
    state = build_state(exp, device=CUDA)
    params = dict(state.model.named_parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in params.values())
    before = {n: p.detach().clone() for n, p in params.items()}
    stats = _step(state)
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
    assert stats["loss_tokens"] > 0
    changed = [n for n, p in params.items() if not torch.equal(p.detach(), before[n])]
    assert len(changed) == len(params)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank: int, port: int, out: dict) -> None:
    from rollmesh.training.ranks import close_ranks, full_tensor, init_ranks

    torch.cuda.set_device(rank)
    ranks = init_ranks(f"tcp://127.0.0.1:{port}", rank, 2, "nccl", timeout_s=120)
    try:
        exp = experiment("trainer.device=cuda", "model.dtype=bfloat16", "trainer.backend=nccl")
        state = build_state(exp, ranks, torch.device("cuda", rank))
        stats = _step(state)
        first = next(iter(state.model.parameters()))
        out[rank] = (stats["loss"], full_tensor(first).float().cpu())
    finally:
        close_ranks(ranks)


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="FSDP2 over NCCL needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_fsdp2_bf16_step_on_two_gpus():
    import torch.multiprocessing as mp

    manager = mp.Manager()
    out = manager.dict()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_fsdp_rank, args=(_free_port(), out), nprocs=2, join=True)
    (loss0, w0), (loss1, w1) = out[0], out[1]
    assert math.isfinite(loss0) and math.isfinite(loss1)
    assert torch.equal(w0, w1)  # both ranks gather the same updated weights
