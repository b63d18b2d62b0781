"""A weight sync from a CUDA trainer into a CUDA engine on the same GPU: the trainer's own
publisher over gloo through host memory (NCCL refuses two ranks on one device), then every
parameter read back from the engine (SGLang's /get_weights_by_name) equals the trainer's bit for
bit, and the engine decodes as the trained model does."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollmesh.training.checkpoint import full_state_dict
from rollmesh.training.batching import from_groups
from rollmesh.training.weight_sender import WeightSender
from rollmesh.training.ranks import Ranks
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from rollmesh.wire.transport import Transport
from tests.engine.engine_harness import Engine
from tests.unit.test_trainer import experiment, make_groups


@pytest.mark.slow
def test_cuda_trainer_syncs_a_cuda_engine_bit_for_bit(tmp_path):
    exp = experiment("trainer.device=cuda", "model.dtype=float32", "sync.backend=gloo",
                     "sync.bucket_mb=0.05")
    state = build_state(exp, device=torch.device("cuda"))
    update_policy(state, prepare(state, from_groups(make_groups(1))))
    trained = {n: t.float().cpu() for n, t in full_state_dict(state.model, Ranks()).items()}

    engine = Engine(tmp_path / "engine.log", "--device", "cuda", "--dtype", "float32",
                    "--weight-version", "0")
    try:
        async def publish() -> int:
            with Transport() as transport:
                publisher = WeightSender(transport, {"engines": [engine.url],
                                                  "synchronizer": "tcp://127.0.0.1:1"},
                                      exp.sync, torch.device("cuda"))
                await publisher.open()
                try:
                    await publisher.join_weight_group()
                    return await publisher.broadcast(state.model, torch.float32, 1)
                finally:
                    publisher.reset_group()
                    await publisher.engines.destroy_weights_update_group("weight_update_group")
                    await publisher.close()

        assert asyncio.run(publish()) == sum(t.numel() * 4 for t in trained.values())
        assert engine.get("/get_model_info")[1]["weight_version"] == "1"
        for name, tensor in trained.items():
            status, rows = engine.request("POST", "/get_weights_by_name",
                                          {"name": name, "truncate_size": 1 << 30})
            assert status == 200, rows
            assert torch.equal(torch.tensor(rows, dtype=torch.float32), tensor), name
    finally:
        assert engine.stop() == 0, engine.log()


@pytest.mark.slow
def test_an_overlapped_sync_sends_the_snapshot_while_the_cuda_trainer_steps_on(tmp_path):
    """`sync.overlap` on CUDA over gloo: the snapshot lies in pinned host memory, copied on the
    side stream; the trainer's next step (its optimizer waits for the copy) runs before the
    snapshot is sent, and the engine holds exactly the weights of the snapshot's step."""
    exp = experiment("trainer.device=cuda", "model.dtype=float32", "sync.backend=gloo",
                     "sync.bucket_mb=0.05", "sync.overlap=true",
                     'sync.load_format="flattened_bucket"')
    state = build_state(exp, device=torch.device("cuda"))
    update_policy(state, prepare(state, from_groups(make_groups(1))))
    trained = {n: t.float().cpu() for n, t in full_state_dict(state.model, Ranks()).items()}

    engine = Engine(tmp_path / "engine.log", "--device", "cuda", "--dtype", "float32",
                    "--weight-version", "0")
    try:
        async def publish() -> tuple[int, bool]:
            with Transport() as transport:
                publisher = WeightSender(transport, {"engines": [engine.url],
                                                  "synchronizer": "tcp://127.0.0.1:1"},
                                      exp.sync, torch.device("cuda"))
                await publisher.open()
                try:
                    snapshot = publisher.take_snapshot(state.model, torch.float32,
                                                       state.optimizer)
                    pinned = snapshot.device.type == "cpu" and snapshot.flat.is_pinned()
                    update_policy(state, prepare(state, from_groups(make_groups(2))))
                    await publisher.join_weight_group()
                    return await publisher.broadcast_snapshot(snapshot, 1), pinned
                finally:
                    publisher.reset_group()
                    await publisher.engines.destroy_weights_update_group("weight_update_group")
                    await publisher.close()

        sent, pinned = asyncio.run(publish())
        assert pinned and sent == sum(t.numel() * 4 for t in trained.values())
        assert engine.get("/get_model_info")[1]["weight_version"] == "1"
        moved = full_state_dict(state.model, Ranks())
        assert not all(torch.equal(moved[n].float().cpu(), t) for n, t in trained.items())
        for name, tensor in trained.items():
            status, rows = engine.request("POST", "/get_weights_by_name",
                                          {"name": name, "truncate_size": 1 << 30})
            assert status == 200, rows
            assert torch.equal(torch.tensor(rows, dtype=torch.float32), tensor), name
    finally:
        assert engine.stop() == 0, engine.log()


def test_an_nccl_snapshot_lies_on_the_gpu_and_survives_the_next_step():
    """With nccl the snapshot goes on the GPU (it fits beside the tiny model): taken on the
    side stream, it holds the step's weights bit for bit after the next step has run."""
    exp = experiment("trainer.device=cuda", "model.dtype=bfloat16", "sync.backend=nccl",
                     "sync.overlap=true")
    state = build_state(exp, device=torch.device("cuda"))
    update_policy(state, prepare(state, from_groups(make_groups(1))))
    trained = {n: p.detach().to(torch.bfloat16).clone()
               for n, p in state.model.named_parameters()}
    with Transport() as transport:
        publisher = WeightSender(transport, {"engines": ["http://127.0.0.1:1"],
                                          "synchronizer": "tcp://127.0.0.1:1"},
                              exp.sync, torch.device("cuda"))
        snapshot = publisher.take_snapshot(state.model, torch.bfloat16, state.optimizer)
        update_policy(state, prepare(state, from_groups(make_groups(2))))
        publisher.copied.synchronize()
        assert snapshot.device.type == "cuda"
        held = snapshot.tensors()
        assert held.keys() == trained.keys()
        for name, tensor in trained.items():
            assert torch.equal(held[name], tensor), name
        assert not all(torch.equal(p.detach().to(torch.bfloat16), trained[n])
                       for n, p in state.model.named_parameters())
        publisher.synchronizer.close()
