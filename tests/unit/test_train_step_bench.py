"""benchmarks/train_step.py: its op counter counts what runs, its batches are what it says, and
one variant x batch at the small shape on CPU gives a well-formed result and rows."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import train_step  # noqa: E402


def test_counter_counts_ops_and_syncs_of_a_known_sequence():
    a, b, host = torch.randn(4, 8), torch.randn(8, 3), torch.randn(5)
    counter = train_step.OpCounter("cpu", [a])
    with counter.mode():
        c = a @ b  # mm (b meets a device tensor: it is one)
        d = c.relu()  # relu
        float(d.sum())  # sum, then a sync on a device tensor (tainted through `a`)
        float(host.sum())  # sum, then a host-side read: `host` never met a device tensor
        torch.nonzero(d)  # data-dependent, on the device
    assert counter.ops["mm"] == 1 and counter.ops["relu"] == 1 and counter.ops["sum"] == 2
    assert counter.ops["_local_scalar_dense"] == 2
    assert counter.total == 7
    assert b in counter.tainted and host not in counter.tainted
    assert counter.syncs == {"device:item": 1, "host:item": 1}
    assert counter.data_dependent == {"device:nonzero": 1}
    assert counter.summary(1)["syncs_per_optimizer_step"] == 2


def test_counter_sees_the_host_device_boundary_on_cpu():
    host = torch.ones(3)
    counter = train_step.OpCounter("cpu")
    with counter.host_boundaries(), counter.mode():
        on_device = host.to(torch.device("cpu"))  # a copy to the device in a GPU run
        back = (on_device * 2).cpu()  # a blocking device -> host copy
        float(back.sum())  # host-side bookkeeping
    assert counter.syncs == {"device:d2h": 1, "host:item": 1}
    assert torch.Tensor.cpu is not None and torch.Tensor.to.__name__ == "to"


def test_rl_lengths_have_the_tail_and_groups_share_prompts():
    lens = train_step.lengths("rl", 16, 4, (128, 512), 300, 4096, 1024)
    assert len(lens) == 16 and max(r for _, r in lens) == 4096
    assert all(128 <= p <= 512 for p, _ in lens)
    assert len({p for p, _ in lens[:4]}) == 1
    assert train_step.lengths("equal", 4, 4, (1, 2), 3, 4, 64) == [(8, 56)] * 4


@pytest.mark.timeout(120)
def test_small_shape_variants_run_and_give_well_formed_rows(tmp_path):
    args = argparse.Namespace(
        device="cpu", shape="small", dir=tmp_path / "ckpt", seqs=4, group_size=4,
        rl_prompt=(4, 8), rl_median=8, rl_max=24, equal_len=16, repeats=1, set=[], threads=1,
        batch="rl")
    train_step.write_checkpoint(args.dir, "small")
    got, threads = {}, torch.get_num_threads()
    try:
        for variant in ("plain", "rollmesh"):
            args.variant = variant
            got[variant] = train_step.run_variant(args)
    finally:
        torch.set_num_threads(threads)
    lens = train_step.lengths("rl", 4, 4, (4, 8), 8, 24, 16)
    for r in got.values():
        assert r["status"] == "ok" and r["step_s"] > 0 and r["peak"] > 0
        assert r["real_tokens"] == sum(p + q for p, q in lens)
        assert r["counts"]["aten_ops"] > 100 and r["counts"]["optimizer_steps"] == 1
        assert r["counts"]["top_ops"][0][1] > 0
        assert any(op == "mm" for op, _ in r["counts"]["top_ops"])
        assert r["profile"]["top"]
    assert [p["grad"] for p in got["plain"]["passes"]] == [True]
    # one mini-batch: the old log-probs come from the training forward, no separate pass
    assert [p["grad"] for p in got["rollmesh"]["passes"]] == [True]
    assert set(got["rollmesh"]["phases"]) >= {"prepare", "update_policy"}
    rows = train_step.compare(args, "rl", lens, got["rollmesh"], got["plain"], "cpu", None)
    assert [r["unit"] for r in rows] == ["tokens/s", "GiB", "ops", "syncs"]
    for r in rows:
        assert r["rollmesh"] > 0 and r["baseline"] > 0 and r["met"] in (True, False)
        assert r["ratio"] == pytest.approx(r["rollmesh"] / r["baseline"])
