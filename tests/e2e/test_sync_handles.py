"""Weight syncs by handle (`sync.transport = "handles"`) into a real built-in engine process:
the trainer's own sender and `sync_weights`, the real synchronizer (the Rig of
tests/unit/test_sync_overlap.py); the weights travel through a shared-memory segment and
/update_weights_from_tensor. Hostile bodies on that route are each a 400 naming what was wrong,
the engine's weights unchanged."""

from __future__ import annotations

import asyncio
import base64
import os
import pickle

import msgpack
import pytest

from rollmesh.training.weight_sender import finish_sync, sync_weights
from rollmesh.weight_sync.handles import SHM_DIR
from rollmesh.wire.transport import Transport
from tests.unit.test_sync_overlap import BF16, Rig, assert_same_bits
from tests.unit.test_sync_overlap import engine  # noqa: F401 - pytest fixtures

HANDLES = 'sync.transport="handles"'


@pytest.mark.slow
def test_blocking_and_overlapped_syncs_by_handle_land_bit_exact(tmp_path, engine):
    """Two blocking syncs and one overlapped, by shared memory: after each the engine holds
    bit for bit what the trainer sent (bfloat16 from float32 weights) under that version; no
    weight-update group is built; the segment is kept between syncs and unlinked on close."""

    async def body():
        with Transport() as t:
            async with Rig(tmp_path, t, engine, BF16, HANDLES) as rig:
                assert rig.publisher.transport == "handles"
                names = [n for n, _ in rig.state.model.named_parameters()]
                segments, rows = set(), []
                for version in (1, 2, 3):
                    rig.switch(overlap=version == 3)
                    await rig.step()
                    sent = rig.weights()
                    rows.append(await sync_weights(rig.state, rig.publisher))
                    await finish_sync(rig.state, rig.publisher)
                    assert rig.publisher.group is None
                    segments.add(rig.publisher.packed.name)
                    assert await rig.engine_version() == str(version)
                    assert_same_bits(await rig.engine_weights(names), sent)
                rows.append(rig.publisher.take_finished())
                assert await rig.engine_sessions() == (False, 0)
                assert os.path.exists(os.path.join(SHM_DIR, *segments))
            return segments, rows, rig.sync.stats()

    segments, rows, stats = asyncio.run(body())
    assert len(segments) == 1 and not os.path.exists(os.path.join(SHM_DIR, *segments))
    nbytes = rows[0]["sync_bytes"]
    assert nbytes > 0 and rows[1]["sync_bytes"] == rows[3]["sync_bytes"] == nbytes
    assert rows[3]["synced_version"] == 3
    assert stats["version"] == 3 and stats["syncs"] == 3 and stats["failures"] == 0


def _table(**body) -> str:
    return base64.b64encode(msgpack.packb(body, use_bin_type=True)).decode()


@pytest.mark.slow
def test_hostile_bodies_are_refused_naming_why_with_the_weights_unchanged(engine):
    name = "model.norm.weight"
    status, before = engine.post("/get_weights_by_name", {"name": name, "truncate_size": 1 << 30})
    assert status == 200
    version = engine.get("/get_model_info")[1]["weight_version"]
    good = {"kind": "shm", "segment": "rollmesh_w_1_1", "size": 256,
            "tensors": [[name, "float32", [64], 0, 256]]}
    cases = [
        ({"load_format": None, "serialized_named_tensors": [
            base64.b64encode(pickle.dumps([(name, 1)])).decode()]}, "reads no pickle"),
        ({"load_format": "rollmesh_handles", "serialized_named_tensors": [
            base64.b64encode(pickle.dumps([(name, 1)])).decode()]}, "reads no pickle"),
        ({"load_format": "flattened_bucket", "serialized_named_tensors": [_table(**good)]},
         "takes only 'rollmesh_handles'"),
        ({"serialized_named_tensors": [_table(**{**good, "segment": "../x"})]},
         "not a rollmesh segment name"),
        ({"serialized_named_tensors": [_table(**{**good, "segment": "psm_foreign"})]},
         "not a rollmesh segment name"),
        ({"serialized_named_tensors": [_table(**good)]}, "cannot open"),
        ({"serialized_named_tensors": [_table(**{**good, "tensors": [
            ["no.such", "float32", [64], 0, 256]]})]}, "unknown weight 'no.such'"),
        ({"serialized_named_tensors": [_table(**{**good, "tensors": [
            [name, "float32", [32], 0, 128]]})]}, "does not match the model's"),
        ({"serialized_named_tensors": [_table(**{**good, "tensors": [
            [name, "int32", [64], 0, 256]]})]}, "cannot load into the model's"),
        ({"serialized_named_tensors": [_table(**good), _table(**good)]}, "a list of one entry"),
    ]
    for body, error in cases:
        body.setdefault("load_format", "rollmesh_handles")
        status, reply = engine.post("/update_weights_from_tensor",
                                    {**body, "weight_version": "hostile"})
        assert status == 400 and reply["success"] is False, (body, reply)
        assert error in reply["message"], (error, reply)
    # offsets past the end of a real segment: one of the trainer's, too small for the table
    from multiprocessing.shared_memory import SharedMemory
    shm = SharedMemory(name=f"rollmesh_w_{os.getpid()}_9", create=True, size=128)
    try:
        status, reply = engine.post("/update_weights_from_tensor", {
            "load_format": "rollmesh_handles", "weight_version": "hostile",
            "serialized_named_tensors": [_table(**{**good, "segment": shm.name})]})
    finally:
        shm.close()
        shm.unlink()
    assert status == 400 and "past the end of the segment" in reply["message"], reply
    status, after = engine.post("/get_weights_by_name", {"name": name, "truncate_size": 1 << 30})
    assert after == before
    assert engine.get("/get_model_info")[1]["weight_version"] == version
