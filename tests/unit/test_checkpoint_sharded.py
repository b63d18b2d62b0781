"""Checkpoint format 2: one part per rank written by a background thread, `latest` only once every
part is on disk and checked, each rank reading back only what it holds (2 -> 1 and 1 -> 2 ranks),
format 1 still loading, and index.json refused when it does not tile its tensors."""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollmesh.training import checkpoint, checkpoint_io
from rollmesh.training.batching import from_groups
from rollmesh.training.ranks import Ranks
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from rollmesh.wire.transport import free_port
from tests.unit.test_checkpoint import trained_state
from tests.unit.test_sharded_load import write_checkpoint
from tests.unit.test_trainer import experiment, make_groups, torch_threads


def kw(state) -> dict[str, Any]:
    return dict(model=state.model, optimizer=state.optimizer, scheduler=state.scheduler,
                tokenizer=state.tokenizer, step=state.step, version=state.version)


def snapshot(state, full=lambda t: t.detach()) -> dict[str, torch.Tensor]:
    """Parameters and AdamW state, whole, by name (`full`: all-gathers a DTensor)."""
    out = {}
    for n, p in state.model.named_parameters():
        out[n] = full(p).clone()
        for k, v in state.optimizer.state.get(p, {}).items():
            out[f"{n}.{k}"] = full(v).clone()
    return out


def assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]), n


def test_the_streaming_writer_writes_what_safetensors_reads(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(4, 2).to(torch.bfloat16),
               "step": torch.tensor(7.0), "empty": torch.zeros(0, 3),
               "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    size, sha = checkpoint_io.write_safetensors(tmp_path / "x.safetensors", specs,
                                                iter(tensors.values()))
    assert size == (tmp_path / "x.safetensors").stat().st_size
    assert sha == checkpoint_io.sha256_file(tmp_path / "x.safetensors")
    with safe_open(tmp_path / "x.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for n, t in tensors.items():
            assert f.get_tensor(n).dtype == t.dtype and torch.equal(f.get_tensor(n), t), n
        assert torch.equal(f.get_slice("a")[1:3], tensors["a"][1:3])
    with pytest.raises(ValueError, match="the header says"):
        checkpoint_io.write_safetensors(tmp_path / "y.safetensors", specs[:1],
                                        iter([torch.zeros(2)]))


def test_format_2_layout_one_part_per_rank_with_an_index(tmp_path):
    _, state = trained_state()
    path = checkpoint.save(tmp_path, **kw(state))
    names = {f.name for f in path.iterdir()}
    assert {"rank_0.safetensors", "rng_0.msgpack", "index.json", "trainer_state.json",
            "config.json"} <= names
    assert not {"model.safetensors", "optimizer.safetensors", "rng.msgpack"} & names
    trainer_state = json.loads((path / "trainer_state.json").read_text())
    assert (trainer_state["format"], trainer_state["world_size"]) == (2, 1)
    index = json.loads((path / "index.json").read_text())
    files = index["files"]["rank_0.safetensors"]
    assert files["size"] == (path / "rank_0.safetensors").stat().st_size
    checkpoint.verify(path)
    name = "model.model.embed_tokens.weight"
    entry = index["tensors"][name]
    assert entry["dtype"] == "F32" and entry["pieces"] == [
        {"file": "rank_0.safetensors", "offset": [0, 0], "shape": entry["shape"]}]
    assert index["tensors"]["optimizer.model.embed_tokens.weight.step"]["shape"] == []
    assert_equal({f"{n}": t for n, t in checkpoint.read_tensors(path, "model").items()},
                 {n: p.detach() for n, p in state.model.named_parameters()})
    # a flipped byte: verify says which file
    with open(path / "rank_0.safetensors", "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(ValueError, match="rank_0.safetensors: sha256 differs"):
        checkpoint.verify(path)


def test_poll_is_not_done_while_the_writer_is_blocked_and_the_step_goes_on(tmp_path,
                                                                            monkeypatch):
    """The save waits for the copy alone: while its writer is held the trainer steps on (and
    changes the weights in place), `poll` says not yet and nothing is `latest`; released, the
    checkpoint holds the weights of the step it was started at."""
    _, state = trained_state()
    release, entered = threading.Event(), threading.Event()
    real = checkpoint_io.write_safetensors

    def held(*a, **k):
        entered.set()
        assert release.wait(60)
        return real(*a, **k)

    monkeypatch.setattr(checkpoint_io, "write_safetensors", held)
    want = snapshot(state)
    pending = checkpoint.start_save(tmp_path, **kw(state))
    assert entered.wait(30)
    assert pending.poll(Ranks()) is None
    with torch_threads(1):
        update_policy(state, prepare(state, from_groups(make_groups(4))))
    assert pending.poll(Ranks()) is None and checkpoint.latest(tmp_path) is None
    assert max((want[n] - p.detach()).abs().max() for n, p in state.model.named_parameters()) > 0
    release.set()
    assert pending.wait(Ranks()) == tmp_path / "step_00000001"
    assert pending.poll(Ranks()) == pending.wait(Ranks()) == checkpoint.latest(tmp_path)
    assert pending.copy_s >= 0 and pending.write_s > 0
    fresh = build_state(experiment("trainer.warmup_steps=3", 'trainer.lr_schedule="cosine"'))
    checkpoint.load(pending.final, model=fresh.model, optimizer=fresh.optimizer,
                    scheduler=fresh.scheduler)
    assert_equal(snapshot(fresh), want)


def write_format_1(directory: Path, state) -> Path:
    """A checkpoint as format 1 wrote it: whole tensors, rank 0's files alone."""
    path = directory / "step_00000001"
    path.mkdir(parents=True)
    params = {n: p.detach().clone() for n, p in state.model.named_parameters()}
    optim = {f"{n}.{k}": v.clone() for n, p in state.model.named_parameters()
             for k, v in state.optimizer.state[p].items()}
    save_file(params, path / "model.safetensors", metadata={"format": "pt"})
    save_file(optim, path / "optimizer.safetensors", metadata={"format": "pt"})
    state.model.config.save_pretrained(path)
    (path / "trainer_state.json").write_text(json.dumps({
        "format": 1, "step": 1, "version": 1, "samples_consumed": 8, "world_size": 1,
        "optimizer": {"param_groups": checkpoint._hyper(state.optimizer)},
        "scheduler": checkpoint._scheduler_state(state.scheduler), "data_cursor": None,
        "extra": {}, "lora": False}))
    rng = msgpack.packb(checkpoint.rng_state(), use_bin_type=True)
    (path / "rng.msgpack").write_bytes(msgpack.packb({"ranks": [rng]}, use_bin_type=True))
    (directory / "latest").write_text(path.name + "\n")
    return path


def test_a_format_1_checkpoint_still_loads(tmp_path):
    exp, state = trained_state()
    path = write_format_1(tmp_path, state)
    assert checkpoint.latest(tmp_path) == path
    torch.manual_seed(5)
    fresh = build_state(exp)
    saved = checkpoint.load(path, model=fresh.model, optimizer=fresh.optimizer,
                            scheduler=fresh.scheduler)
    assert (saved["format"], saved["step"], saved["samples_consumed"]) == (1, 1, 8)
    assert_equal(snapshot(fresh), snapshot(state))
    assert fresh.scheduler.last_epoch == state.scheduler.last_epoch


@pytest.mark.parametrize("tamper,error", [
    ("gap", "a gap or an overlap"),
    ("overlap", r"rows 0\.\.2 then 1"),
    ("escape", "'../x' is not rank_<r>.safetensors"),
    ("dtype", "dtype 'O' is not one of"),
    ("bounds", "out of bounds"),
    ("type", "non-negative integers"),
])
def test_a_tampered_index_is_refused_with_what_is_wrong(tmp_path, tamper, error):
    _, state = trained_state()
    path = checkpoint.save(tmp_path, **kw(state))
    index = json.loads((path / "index.json").read_text())
    entry = index["tensors"]["model.model.embed_tokens.weight"]
    rows, cols = entry["shape"]
    piece = entry["pieces"][0]
    if tamper == "gap":
        piece["shape"] = [rows - 1, cols]
    elif tamper == "overlap":  # as many elements as the tensor, rows 1..2 twice
        entry["shape"] = [3, cols]
        entry["pieces"] = [{**piece, "offset": [0, 0], "shape": [2, cols]},
                           {**piece, "offset": [1, 0], "shape": [1, cols]}]
    elif tamper == "escape":
        index["files"]["../x"] = index["files"]["rank_0.safetensors"]
        piece["file"] = "../x"
    elif tamper == "dtype":
        entry["dtype"] = "O"
    elif tamper == "bounds":
        piece["offset"] = [1, 0]
    else:
        piece["offset"] = [0, "0"]
    (path / "index.json").write_text(json.dumps(index))
    fresh = build_state(experiment("trainer.warmup_steps=3", 'trainer.lr_schedule="cosine"'))
    with pytest.raises(ValueError, match=error) as info:
        checkpoint.load(path, model=fresh.model, optimizer=fresh.optimizer,
                        scheduler=fresh.scheduler)
    assert str(path / "index.json") in str(info.value)


# -- two ranks -------------------------------------------------------------------------------------


def _rank(rank: int, rendezvous: str, model_path: str, one_rank_ckpt: str,
          out: str) -> dict[str, Any]:
    from rollmesh.training.ranks import close_ranks, full_tensor, init_ranks

    torch.set_num_threads(1)
    ranks = init_ranks(rendezvous, rank, 2, "gloo", timeout_s=60)
    result: dict[str, Any] = {}
    try:
        exp = experiment("trainer.ranks=2", f'model.path="{model_path}"')
        state = build_state(exp, ranks)
        update_policy(state, prepare(state, from_groups(make_groups(5))))
        state.step = state.version = 1
        result["path"] = checkpoint.save(out, **kw(state), ranks=ranks)
        result["saved"] = snapshot(state, full_tensor)
        # step 2: rank 1's part fails half-way: abandoned on every rank, step 1 stays latest
        real = checkpoint_io.write_safetensors
        if rank == 1:
            def fail(*a, **k):
                raise OSError("no space left on rank 1")
            checkpoint_io.write_safetensors = fail
        state.step = 2
        pending = checkpoint.start_save(out, **kw(state), ranks=ranks)
        result["failed"] = (pending.wait(ranks), pending.error)
        checkpoint_io.write_safetensors = real
        # 1 -> 2: a one-rank checkpoint into two ranks, each reading its rows
        fresh = build_state(exp, ranks)
        checkpoint.load(one_rank_ckpt, model=fresh.model, optimizer=fresh.optimizer,
                        scheduler=fresh.scheduler, ranks=ranks)
        result["loaded"] = snapshot(fresh, full_tensor)
        result["last_epoch"] = fresh.scheduler.last_epoch
        # one output row over two ranks: rank 1's shards are empty (and not stored)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        small = torch.nn.Linear(3, 1)
        fully_shard(small, mesh=init_device_mesh("cpu", (2,)))
        opt = torch.optim.AdamW(small.parameters(), lr=0.1)
        small(torch.ones(2, 3)).sum().backward()
        opt.step()
        checkpoint.save(f"{out}-small", model=small, optimizer=opt, step=1, version=1,
                        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
                        ranks=ranks)
        result["small"] = snapshot(SimpleNamespace(model=small, optimizer=opt), full_tensor)
    finally:
        close_ranks(ranks)
    return result


def test_two_ranks_save_their_shards_and_load_into_one_rank_and_back(tmp_path):
    model_path = write_checkpoint(tmp_path / "model", tied=False, dtype=torch.float32)
    exp = experiment(f'model.path="{model_path}"')
    with torch_threads(1):
        one = build_state(exp)
        update_policy(one, prepare(one, from_groups(make_groups(6))))
    one.step = one.version = 1
    one_rank = checkpoint.save(tmp_path / "one", **kw(one))
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "two"
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(_rank, [(r, rendezvous, str(model_path), str(one_rank), str(out))
                                       for r in range(2)], chunksize=1)
    path = out / "step_00000001"
    assert results[0]["path"] == path and results[1]["path"] is None
    for r in results:
        assert r["failed"][0] is False and "rank 1: OSError: no space left" in r["failed"][1]
    assert checkpoint.latest(out) == path
    assert sorted(p.name for p in out.iterdir()) == ["latest", "step_00000001"]
    checkpoint.verify(path)
    index = json.loads((path / "index.json").read_text())
    assert index["world_size"] == 2
    # intermediate_size 75 over 2 ranks: rows 0..37 and 38..74
    pieces = index["tensors"]["model.model.layers.0.mlp.gate_proj.weight"]["pieces"]
    assert [(p["file"], p["offset"][0], p["shape"][0]) for p in pieces] == [
        ("rank_0.safetensors", 0, 38), ("rank_1.safetensors", 38, 37)]
    with safe_open(path / "rank_1.safetensors", framework="pt") as f:
        assert not any(k.endswith(".step") for k in f.keys())  # rank 0 keeps the scalars
    # 2 -> 1
    with torch_threads(1):
        fresh = build_state(exp)
        checkpoint.load(path, model=fresh.model, optimizer=fresh.optimizer,
                        scheduler=fresh.scheduler)
    assert_equal(snapshot(fresh), results[0]["saved"])
    # 1 -> 2
    assert_equal(results[0]["loaded"], snapshot(one))
    assert results[0]["last_epoch"] == one.scheduler.last_epoch
    # an empty shard: rank 1 holds no row of the (1, 3) weight; its file lists no tensor
    small_path = Path(f"{out}-small/step_00000001")
    index = json.loads((small_path / "index.json").read_text())
    assert index["tensors"]["model.weight"]["pieces"] == [
        {"file": "rank_0.safetensors", "offset": [0, 0], "shape": [1, 3]}]
    with safe_open(small_path / "rank_1.safetensors", framework="pt") as f:
        assert list(f.keys()) == []
    small = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(small.parameters(), lr=0.1)
    checkpoint.load(small_path, model=small, optimizer=opt,
                    scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0))
    assert_equal(snapshot(SimpleNamespace(model=small, optimizer=opt)), results[0]["small"])


def test_the_trainer_tells_the_queue_a_step_is_saved_only_once_its_checkpoint_is_latest(
        tmp_path, monkeypatch):
    """role.save_checkpoint returns once the shards are copied; the link's checkpoint_step (the
    queue forgets the batches up to it) and saved_at move only when `settle_checkpoint` finds
    the checkpoint latest; a save abandoned leaves them, and the next save still works."""
    import asyncio

    from rollmesh.training import role

    _, state = trained_state()
    events: list[tuple[str, dict]] = []
    log = SimpleNamespace(info=lambda e, **k: events.append((e, k)),
                          error=lambda e, **k: events.append((e, k)))
    ctx = SimpleNamespace(log=log)
    link = SimpleNamespace(checkpoint_step=0, saved_at=0.0)
    release = threading.Event()
    real = checkpoint_io.write_safetensors
    fail = []

    def held(*a, **k):
        assert release.wait(60)
        if fail:
            raise OSError("disk full")
        return real(*a, **k)

    monkeypatch.setattr(checkpoint_io, "write_safetensors", held)

    async def body():
        await role.save_checkpoint(ctx, state, link, tmp_path)
        assert state.pending_save is not None
        await role.settle_checkpoint(ctx, state, link, wait=False)
        assert (link.checkpoint_step, link.saved_at, events) == (0, 0.0, [])
        release.set()
        await role.settle_checkpoint(ctx, state, link, wait=True)
        assert state.pending_save is None and link.checkpoint_step == 1 and link.saved_at > 0
        assert events[-1][0] == "checkpoint_saved" and events[-1][1]["step"] == 1
        assert {"copy_s", "write_s", "path", "version"} <= set(events[-1][1])
        fail.append(True)
        state.step = 2
        await role.save_checkpoint(ctx, state, link, tmp_path)
        await role.settle_checkpoint(ctx, state, link, wait=True)
        assert link.checkpoint_step == 1 and events[-1][0] == "checkpoint_abandoned"
        assert checkpoint.latest(tmp_path).name == "step_00000001"
        fail.clear()
        state.step = 3
        await role.save_checkpoint(ctx, state, link, tmp_path)
        state.step = 4  # a new save settles the one pending first
        await role.save_checkpoint(ctx, state, link, tmp_path)
        assert link.checkpoint_step == 3
        await role.settle_checkpoint(ctx, state, link, wait=True)
        assert link.checkpoint_step == 4 and checkpoint.latest(tmp_path).name == "step_00000004"

    asyncio.run(body())
