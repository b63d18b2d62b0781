"""A weight sync from a CUDA trainer into a CUDA engine on the same GPU: the trainer's own
publisher over gloo through host memory (NCCL refuses two ranks on one device), or by CUDA IPC
handle (`sync.transport = "handles"`), then every parameter read back from the engine (SGLang's
/get_weights_by_name) equals the trainer's bit for bit, and the engine decodes as the trained
model does. SGLang's `update_weights_from_tensor` payload as rollmesh writes it: its pickle
stream checked op by op (globals within SGLang's SafeUnpickler list, the device as its UUID),
and decoded in a child process the way SGLang does (test only: rollmesh never unpickles)."""

from __future__ import annotations

import asyncio
import base64
import json
import pickletools
import subprocess
import sys

import pytest
import torch

from rollmesh.training.checkpoint import full_state_dict
from rollmesh.training.batching import from_groups
from rollmesh.training.weight_sender import WeightSender
from rollmesh.training.ranks import Ranks
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from rollmesh.wire.transport import Transport
from rollmesh.weight_sync.buckets import WeightSpec
from rollmesh.weight_sync.handles import Packed, layout, sglang_payload, view_of
from tests.engine.engine_harness import REPO, Engine, repo_env
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


@pytest.mark.slow
def test_cuda_ipc_sync_into_a_cuda_engine_on_the_same_gpu_bit_for_bit(tmp_path):
    """sync.transport = "handles" from a CUDA trainer: the weights packed into one CUDA buffer,
    its IPC handle sent in the built-in engine's msgpack form, the engine copying from it."""
    exp = experiment("trainer.device=cuda", "model.dtype=float32", 'sync.transport="handles"')
    state = build_state(exp, device=torch.device("cuda"))
    update_policy(state, prepare(state, from_groups(make_groups(1))))
    trained = {n: t.float().cpu() for n, t in full_state_dict(state.model, Ranks()).items()}

    engine = Engine(tmp_path / "engine.log", "--device", "cuda", "--dtype", "float32",
                    "--weight-version", "0")
    try:
        async def publish() -> tuple[int, str, bool]:
            with Transport() as transport:
                publisher = WeightSender(transport, {"engines": [engine.url],
                                                  "synchronizer": "tcp://127.0.0.1:1"},
                                      exp.sync, torch.device("cuda"))
                await publisher.open()
                try:
                    assert publisher.transport == "handles"
                    sent = await publisher.broadcast(state.model, torch.float32, 1)
                    return sent, publisher.packed.device.type, publisher.group is None
                finally:
                    await publisher.close()

        sent, device, no_group = asyncio.run(publish())
        assert device == "cuda" and no_group
        assert sent == sum(t.numel() * 4 for t in trained.values())
        assert engine.get("/get_model_info")[1]["weight_version"] == "1"
        for name, tensor in trained.items():
            status, rows = engine.request("POST", "/get_weights_by_name",
                                          {"name": name, "truncate_size": 1 << 30})
            assert status == 200, rows
            assert torch.equal(torch.tensor(rows, dtype=torch.float32), tensor), name
    finally:
        assert engine.stop() == 0, engine.log()


# The globals SGLang 0.5.23's SafeUnpickler lets through that a payload of CUDA tensors may
# name (srt/utils/common.py ALLOWED_GLOBALS, the part for tensors, storages and dtypes).
SGLANG_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"), ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"), ("torch.storage", "TypedStorage"),
    ("torch.storage", "UntypedStorage"), ("torch", "Size"), ("torch", "bfloat16"),
    ("torch", "float32"), ("torch", "float16"), ("builtins", "tuple"), ("builtins", "list"),
}

# Decodes a payload as SGLang does (its patch maps the device UUID back to an index), prints
# each tensor's values: run in a child, the trainer (this test) holding the buffer meanwhile.
DECODE = """
import base64, json, pickle, sys, torch
import torch.multiprocessing.reductions as r
original = r.rebuild_cuda_tensor
def by_uuid(*args):
    args = list(args)
    args[6] = next(i for i in range(torch.cuda.device_count())
                   if str(torch.cuda.get_device_properties(i).uuid) == args[6])
    return original(*args)
r.rebuild_cuda_tensor = by_uuid
named = pickle.loads(base64.b64decode(sys.stdin.read()))
print(json.dumps([[n, str(t.dtype), list(t.shape), t.float().cpu().flatten().tolist()]
                  for n, t in named]))
"""


def _globals_and_strings(raw: bytes) -> tuple[set[tuple[str, str]], list[str]]:
    """The (module, name) of every global a pickle stream names, and its strings, read op by
    op with pickletools (nothing executed)."""
    found, strings, memo, recent = set(), [], {}, []
    for op, arg, _ in pickletools.genops(raw):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            strings.append(arg)
            recent.append(arg)
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            recent.append(memo.get(arg))
        elif op.name in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
            memo[len(memo) if op.name == "MEMOIZE" else arg] = recent[-1] if recent else None
            continue
        elif op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add((recent[-2], recent[-1]))
        else:
            recent.append(None)
    return found, strings


def test_the_sglang_payload_is_torchs_cuda_reduction_with_the_device_uuid():
    a = torch.randn(4, 8, device="cuda").to(torch.bfloat16)
    b = torch.tensor([1.5, -2.25, 3.0], device="cuda")
    entries, size = layout([WeightSpec("model.a", torch.bfloat16, (4, 8)),
                            WeightSpec("model.b", torch.float32, (3,))])
    packed = Packed(torch.device("cuda"))
    packed.ensure(size)
    packed.fill(entries, [a, b])
    payload = sglang_payload([(e.name, view_of(packed.flat, e)) for e in entries], tp_size=2)
    assert len(payload) == 2  # one per TP rank, each its own IPC reference
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    for entry in payload:
        found, strings = _globals_and_strings(base64.b64decode(entry, validate=True))
        assert ("torch.multiprocessing.reductions", "rebuild_cuda_tensor") in found
        assert found <= SGLANG_ALLOWED, found - SGLANG_ALLOWED
        assert {"model.a", "model.b", uuid} <= set(strings)
    done = subprocess.run([sys.executable, "-c", DECODE], input=payload[1], cwd=REPO,
                          env=repo_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    decoded = json.loads(done.stdout.strip().splitlines()[-1])
    assert decoded == [["model.a", "torch.bfloat16", [4, 8], a.float().cpu().flatten().tolist()],
                       ["model.b", "torch.float32", [3], b.cpu().tolist()]]
    packed.close()
