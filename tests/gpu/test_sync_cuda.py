"""A weight sync from a CUDA trainer into a CUDA engine on the same GPU: the trainer's own
publisher over gloo through host memory (NCCL refuses two ranks on one device), then every
parameter read back from the engine (SGLang's /get_weights_by_name) equals the trainer's bit for
bit, and the engine decodes as the trained model does."""

from __future__ import annotations

import asyncio

import torch

from rollmesh.checkpoint import full_state_dict
from rollmesh.packing import from_groups
from rollmesh.publish import Publisher
from rollmesh.ranks import Ranks
from rollmesh.trainer import build_state, prepare, update_policy
from rollmesh.transport import Transport
from tests.engine.engine_harness import Engine
from tests.test_trainer import experiment, make_groups


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
                publisher = Publisher(transport, {"engines": [engine.url],
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
