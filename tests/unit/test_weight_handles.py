"""Weight sync by handle (`rollmesh.weight_sync.handles`) in one process: the transport choice,
the table's layout, the trainer's shared-memory buffer, and the engine side's checks of a
hostile table (each refused with the model untouched). The same path through a real engine
process and the trainer's sender: tests/e2e/test_sync_handles.py."""

from __future__ import annotations

import base64
import contextlib
import os
import pickle

import msgpack
import pytest
import torch

from rollmesh.models.loading import build_tiny
from rollmesh.weight_sync.buckets import WeightSpec
from rollmesh.weight_sync.handles import (
    ALIGN, SHM_DIR, Packed, choose_transport, decode_handles, encode_handles, layout,
    load_from_handles,
)
from rollmesh.weight_sync.tensors import WeightUpdateError

CPU = torch.device("cpu")


def test_auto_takes_handles_only_when_every_engine_is_on_this_host():
    local = ["http://127.0.0.1:30000", "http://localhost:30001", "http://10.0.0.5:30002"]
    assert choose_transport("auto", local, "10.0.0.5", "builtin", CPU) == "handles"
    assert choose_transport("auto", [*local, "http://10.0.0.6:1"], "10.0.0.5", "builtin",
                            CPU) == "broadcast"
    assert choose_transport("auto", local[:1], "127.0.0.1", "sglang", CPU) == "broadcast"
    assert choose_transport("broadcast", local, "10.0.0.5", "builtin", CPU) == "broadcast"
    with pytest.raises(ValueError, match=r"engines \['http://10.0.0.6:1'\] are not on"):
        choose_transport("handles", ["http://10.0.0.6:1"], "10.0.0.5", "builtin", CPU)
    with pytest.raises(ValueError, match="SGLang engines take handles only from a GPU"):
        choose_transport("handles", local[:1], "127.0.0.1", "sglang", CPU)


def test_layout_aligns_every_tensor():
    specs = [WeightSpec("a", torch.bfloat16, (3,)), WeightSpec("b", torch.float32, (2, 2))]
    entries, size = layout(specs)
    assert [(e.offset, e.nbytes) for e in entries] == [(0, 6), (ALIGN, 16)]
    assert size == 2 * ALIGN


def _packed(model: torch.nn.Module, dtype: torch.dtype = torch.float32):
    specs = [WeightSpec(n, dtype, tuple(p.shape)) for n, p in model.named_parameters()]
    entries, size = layout(specs)
    packed = Packed(CPU)
    packed.ensure(size)
    packed.fill(entries, (p.detach() for p in model.parameters()))
    return packed, entries, size


def test_a_table_in_shared_memory_loads_bit_for_bit_and_the_segment_goes_on_close():
    sent, _ = build_tiny("tiny:seed=1")
    model, _ = build_tiny("tiny:seed=2")
    packed, entries, size = _packed(sent, torch.bfloat16)
    name = packed.name
    assert name.startswith(f"rollmesh_w_{os.getpid()}_")
    try:
        table = decode_handles(encode_handles(entries, segment=name, segment_size=size))
        assert load_from_handles(model, table) == len(entries)
    finally:
        packed.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    for (n, p), q in zip(sent.named_parameters(), model.parameters()):
        assert torch.equal(q, p.detach().to(torch.bfloat16).float()), n


def _b64(body) -> str:
    return base64.b64encode(msgpack.packb(body, use_bin_type=True)).decode()


@pytest.mark.parametrize(("mutate", "error"), [
    (lambda b: b.update(segment="../../etc/passwd"), "not a rollmesh segment name"),
    (lambda b: b.update(segment="/dev/shm/rollmesh_w_1_1"), "not a rollmesh segment name"),
    (lambda b: b.update(segment="psm_1234"), "not a rollmesh segment name"),
    (lambda b: b.update(kind="fd"), "kind 'fd'"),
    (lambda b: b["tensors"][0].__setitem__(3, 7), "not a multiple of 64"),
    (lambda b: b["tensors"][0].__setitem__(4, 12), "bytes for shape"),
    (lambda b: b["tensors"][0].__setitem__(1, "complex_thing"), "unknown dtype"),
    (lambda b: b["tensors"][0].__setitem__(3, -64), "bad name, shape, offset or size"),
    (lambda b: b.update(tensors=[["x"]]), "expected \\[name, dtype, shape, offset, nbytes\\]"),
])
def test_a_hostile_table_is_refused_naming_why(mutate, error):
    body = {"kind": "shm", "segment": "rollmesh_w_1_1", "size": 64,
            "tensors": [["w", "float32", [2, 2], 0, 16]]}
    mutate(body)
    with pytest.raises(WeightUpdateError, match=error):
        decode_handles(_b64(body))


def test_a_pickle_or_junk_is_refused_unread():
    with pytest.raises(WeightUpdateError, match="reads no pickle"):
        decode_handles(base64.b64encode(pickle.dumps([("w", 1)])).decode())
    with pytest.raises(WeightUpdateError, match="not base64"):
        decode_handles("%%%")
    with pytest.raises(WeightUpdateError, match="expected base64 strings"):
        decode_handles(12)


def _reshape(row: list, shape: list[int]) -> None:
    """A row announcing another shape, its byte count consistent with it."""
    row[4] = row[4] // max(1, int(torch.tensor(row[2]).prod())) * int(torch.tensor(shape).prod())
    row[2] = shape


@pytest.mark.parametrize(("row", "error"), [
    (lambda r: r.__setitem__(3, r[3] + (1 << 20)), "past the end of the segment"),
    (lambda r: r.__setitem__(0, "no.such.weight"), "unknown weight 'no.such.weight'"),
    (lambda r: _reshape(r, [r[2][0] + 1, *r[2][1:]]), "does not match the model's"),
    (lambda r: (r.__setitem__(1, "int32")), "cannot load into the model's"),
])
def test_a_table_that_does_not_fit_leaves_the_model_untouched(row, error):
    sent, _ = build_tiny("tiny:seed=1")
    model, _ = build_tiny("tiny:seed=2")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    packed, entries, size = _packed(sent)
    try:
        body = msgpack.unpackb(base64.b64decode(
            encode_handles(entries, segment=packed.name, segment_size=size)))
        # the last tensor wrong: everything before it would load, were it not checked first
        row(body["tensors"][-1])
        with pytest.raises(WeightUpdateError, match=error):
            load_from_handles(model, decode_handles(_b64(body)))
    finally:
        packed.close()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_segment_that_is_gone_is_refused():
    body = {"kind": "shm", "segment": "rollmesh_w_999999999_1", "size": 64,
            "tensors": [["model.norm.weight", "float32", [64], 0, 256]]}
    model, _ = build_tiny("tiny")
    with pytest.raises(WeightUpdateError, match="cannot open"):
        load_from_handles(model, decode_handles(_b64(body)))


def test_sglangs_payload_is_written_only_for_cuda_tensors():
    from rollmesh.weight_sync.handles import sglang_payload
    # its form (torch's CUDA reduction, device as UUID) is checked in tests/gpu/test_sync_cuda.py
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        sglang_payload([("w", torch.zeros(2))])


def test_a_segment_left_under_our_name_is_not_reused_and_a_live_view_does_not_block_close():
    stale = f"rollmesh_w_{os.getpid()}_{Packed._count + 1}"
    from multiprocessing.shared_memory import SharedMemory
    left = SharedMemory(name=stale, create=True, size=64)  # a dead process's, same pid
    try:
        packed = Packed(CPU)
        flat = packed.ensure(128)
        assert packed.name != stale and flat.numel() == 128
        view = flat[:8]  # e.g. held by a failed sync's frame
        name = packed.name
        packed.close()
        assert not os.path.exists(os.path.join(SHM_DIR, name)) and view.numel() == 8
    finally:
        left.close()
        left.unlink()


CUDA_FIELDS = {"device_uuid": "GPU-0", "handle": b"h" * 64, "size": 256, "offset": 0,
               "ref_counter_handle": b"r", "ref_counter_offset": 0, "event_handle": b"e",
               "event_sync_required": True, "storage_offset": 0}


def test_a_cuda_table_needs_every_ipc_field_of_its_type():
    row = [["model.norm.weight", "float32", [64], 0, 256]]
    assert decode_handles(_b64({"kind": "cuda", "cuda": CUDA_FIELDS, "tensors": row}))["cuda"] \
        == CUDA_FIELDS
    for key, bad in (("handle", "not-bytes"), ("size", "256"), ("device_uuid", 0)):
        with pytest.raises(WeightUpdateError, match="cuda handle: expected the fields"):
            decode_handles(_b64({"kind": "cuda", "cuda": {**CUDA_FIELDS, key: bad},
                                 "tensors": row}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of an engine without CUDA")
def test_a_cuda_table_is_refused_by_an_engine_without_cuda():
    model, _ = build_tiny("tiny")
    table = decode_handles(_b64({"kind": "cuda", "cuda": CUDA_FIELDS, "tensors": [
        ["model.norm.weight", "float32", [64], 0, 256]]}))
    with pytest.raises(WeightUpdateError, match="a CUDA handle sent to an engine without CUDA"):
        load_from_handles(model, table)


def test_segments_a_killed_trainer_left_are_unlinked_by_the_next_one():
    """kill -9 leaves a trainer's segment behind (a whole model's bytes of host memory): the
    next process to make one unlinks those whose creator is dead, and only those."""
    import subprocess
    from multiprocessing.shared_memory import SharedMemory

    from rollmesh.weight_sync.handles import sweep_dead_segments

    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is dead now
    dead = SharedMemory(name=f"rollmesh_w_{gone.pid}_1", create=True, size=64)
    live = SharedMemory(name=f"rollmesh_w_{os.getpid()}_9999", create=True, size=64)
    other = SharedMemory(name=f"not_rollmesh_{gone.pid}_1", create=True, size=64)
    try:
        swept = sweep_dead_segments()  # (and any other dead process's left on this machine)
        assert dead.name in swept and live.name not in swept and other.name not in swept
        assert not os.path.exists(os.path.join(SHM_DIR, dead.name))
        assert os.path.exists(os.path.join(SHM_DIR, live.name))
        assert os.path.exists(os.path.join(SHM_DIR, other.name))
        assert dead.name not in sweep_dead_segments()
    finally:
        for shm in (dead, live, other):
            shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
