"""Invariants of the cluster simulator (benchmarks/simulate.py): no timing, a few seconds."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.simulate import Costs, analytic_pipeline_step, simulate, train_seconds

# A small cluster: 8 GPUs, 4 engines of at most 32 sequences, 256 samples per step.
SMALL = Costs(max_batch=32, batch=256, len_median=300, len_sigma=1.0, len_max=2000,
              prompt_len=50, train_tok_s=2000.0, logprob_tok_s=4000.0, n_ref=8,
              sync_s=1.0, switch_s=2.0)
RUN = dict(steps=8, warmup=3)


def no_tail(c: Costs, **changes) -> Costs:
    """Every response the same length, no prefill cost, no sync pause."""
    return dataclasses.replace(c, len_sigma=0.0, len_min=1, prefill_tok_s=1e15, sync_s=0.0,
                               **changes)


@pytest.mark.parametrize("train_tok_s", [200.0, 2000.0, 50_000.0])  # train-bound ... gen-bound
def test_no_tail_infinite_staleness_matches_the_pipeline_bound(train_tok_s):
    c = no_tail(SMALL, train_tok_s=train_tok_s)
    length = int(c.len_median)
    r = simulate(c, 8, 4, None, **RUN)
    bound = analytic_pipeline_step(c, 4, 4, length, c.async_logprobs)
    assert r.step_s == pytest.approx(bound, rel=1e-6)
    assert r.dropped == 0


def test_colocated_without_tail_is_generation_plus_training_plus_switch():
    c = no_tail(SMALL)  # 8 engines x 32 sequences: the whole batch in one wave
    r = simulate(c, 8, 8, 0, colocated=True, **RUN)
    gen_only = analytic_pipeline_step(dataclasses.replace(c, train_tok_s=1e15,
                                                          logprob_tok_s=1e15),
                                      8, 8, int(c.len_median), False)
    tokens = c.batch * (int(c.len_median) + c.prompt_len)
    assert r.step_s == pytest.approx(gen_only + train_seconds(c, tokens, 8, True) + c.switch_s,
                                     rel=1e-6)


@pytest.mark.parametrize("rollout_gpus", [2, 4, 6])
@pytest.mark.parametrize("seed", [0, 1])
def test_disaggregated_sync_is_never_faster_than_async(rollout_gpus, seed):
    c = dataclasses.replace(SMALL, async_logprobs=True)  # the same training work in both
    sync = simulate(c, 8, rollout_gpus, 0, seed=seed, **RUN)
    for s in (1, 2, None):
        assert sync.step_s >= simulate(c, 8, rollout_gpus, s, seed=seed, **RUN).step_s * (1 - 1e-9)
    assert sync.dropped == 0


def test_deterministic_with_a_seed():
    a = simulate(SMALL, 8, 4, 2, seed=7, **RUN)
    b = simulate(SMALL, 8, 4, 2, seed=7, **RUN)
    c = simulate(SMALL, 8, 4, 2, seed=8, **RUN)
    assert a.step_times == b.step_times and a.dropped == b.dropped
    assert a.step_times != c.step_times


def test_long_tail_makes_colocated_sync_slower_than_async():
    c = dataclasses.replace(SMALL, len_sigma=1.2)
    colo = simulate(c, 8, 8, 0, colocated=True, **RUN)
    best = min(simulate(c, 8, r, 2, **RUN).step_s for r in (2, 4, 6))
    assert best < colo.step_s


# -- the scale study (simulate.py --scale): the saturation model's arithmetic ----------------

from benchmarks.simulate import (  # noqa: E402
    ProcessCosts, Workload, load_at, queue_seconds_per_sample, rollouter_seconds_per_sample,
    saturation_gpus, shards_needed, weak_scaled, workload,
)

W = Workload(model="test", cell_gpus=128, label="async s=2 64:64", samples_per_gpu_s=0.5,
             rollout_fraction=0.5, seqs_per_rollout_gpu=256.0, prompt_tokens=300.0,
             tokens_per_sample=3300.0, resumes_per_sample=0.25, group_size=16)
ZERO = ProcessCosts(**{f.name: 0 for f in dataclasses.fields(ProcessCosts)
                       if f.name not in ("credits", "gpus_per_reward_worker", "disk_mb_s",
                                         "bytes_per_token")}, disk_mb_s=float("inf"))


@pytest.mark.parametrize("m", [2, 4, 8])
def test_weak_scaling_keeps_the_pipeline_step(m):
    """A cluster m times larger with a batch m times larger trains at the same step time."""
    c = no_tail(SMALL)
    cell = analytic_pipeline_step(c, 4, 4, int(c.len_median), True)
    big = analytic_pipeline_step(weak_scaled(c, m), 4 * m, 4 * m, int(c.len_median), True)
    assert big == pytest.approx(cell, rel=1e-12)


def test_rollouter_cost_per_sample_adds_its_parts():
    p = dataclasses.replace(ZERO, rollouter_per_sample_us=100.0, rollouter_per_group_us=320.0,
                            rollouter_per_resume_us=40.0, rollouter_per_prompt_token_ns=10.0,
                            codec_per_token_ns=2.0, worker_scan_ns=50.0, worker_index_ns=700.0)
    # 100 + 320/16 + 0.25 * 40 us; 300 * 10 ns; 1 ns a token for 5 + 2 * 0.25 messages;
    # (1 + 0.25) * 100 agent workers + 10 reward workers scanned at 50 ns
    expected = (100 + 20 + 10) * 1e-6 + (3000 + 3300 * 5.5 + 50 * (125 + 10)) * 1e-9
    assert rollouter_seconds_per_sample(W, p, 100, 10, scan=True) == pytest.approx(expected,
                                                                                  rel=1e-12)
    # the worker index instead: 700 ns for each of 1 + 0.25 Assigns and one Score
    indexed = expected - 50 * 135 * 1e-9 + 700 * 2.25 * 1e-9
    assert rollouter_seconds_per_sample(W, p, 100, 10) == pytest.approx(indexed)


def test_queue_cost_per_sample_batches_only_the_put():
    p = dataclasses.replace(ZERO, queue_per_sample_us=100.0, queue_per_put_us=800.0,
                            queue_per_token_ns=10.0, disk_mb_s=1000.0)
    one = queue_seconds_per_sample(W, p)
    eight = queue_seconds_per_sample(W, p, groups_per_put=8)
    fsync = 3300 * 13 / 1e9
    assert one == pytest.approx((100 + 800 / 16) * 1e-6 + 33e-6 + fsync)
    assert one - eight == pytest.approx(800 / 16 * 1e-6 * (1 - 1 / 8))


def test_rates_and_workers_grow_with_the_cluster():
    p = dataclasses.replace(ZERO, rollouter_per_sample_us=1000.0, credits=64)
    ld = load_at(W, p, 1024)
    assert ld.samples_per_s == pytest.approx(512.0)
    assert ld.agent_workers == 512 * 256 // 64 and ld.reward_workers == 512 // 8
    assert ld.rollouter == pytest.approx(0.512)  # 512 samples/s x 1 ms
    assert ld.rollouter_scan == 0.0


def test_the_worker_scan_makes_the_rollouter_load_quadratic():
    p = dataclasses.replace(ZERO, worker_scan_ns=100.0)
    a, b = load_at(W, p, 1000, scan=True), load_at(W, p, 2000, scan=True)
    assert b.rollouter == pytest.approx(4 * a.rollouter, rel=1e-3)
    assert a.rollouter_scan == pytest.approx(a.rollouter)


def test_saturation_is_where_the_load_reaches_one():
    p = dataclasses.replace(ZERO, rollouter_per_sample_us=500.0, queue_per_sample_us=200.0)
    # linear loads: rate = 0.5 N samples/s; one core at 500 us -> 2,000 samples/s -> N = 4,000
    assert saturation_gpus(W, p, "rollouter") == pytest.approx(4000, rel=1e-6)
    assert saturation_gpus(W, p, "queue") == pytest.approx(10_000, rel=1e-6)
    assert saturation_gpus(W, p, "rollouter", level=0.5) == pytest.approx(2000, rel=1e-6)
    scanned = dataclasses.replace(p, worker_scan_ns=300.0)
    n = saturation_gpus(W, scanned, "rollouter", scan=True)
    assert n < 4000 and load_at(W, scanned, n, scan=True).rollouter == pytest.approx(1.0,
                                                                                    abs=1e-3)
    # the index costs the same per dispatch at any size: the load stays linear
    indexed = dataclasses.replace(scanned, worker_index_ns=1000.0)
    a, b = load_at(W, indexed, 1000), load_at(W, indexed, 2000)
    assert b.rollouter == pytest.approx(2 * a.rollouter, rel=1e-9)
    assert saturation_gpus(W, ZERO, "queue") == float("inf")


def test_shards_split_the_load_and_the_fewest_are_found():
    p = dataclasses.replace(ZERO, rollouter_per_sample_us=500.0, worker_scan_ns=300.0,
                            queue_per_sample_us=200.0)
    one = load_at(W, p, 10_000, scan=True)
    four = load_at(W, p, 10_000, rollouters=4, queues=4, scan=True)
    assert four.queue == pytest.approx(one.queue / 4)
    assert four.rollouter < one.rollouter / 4  # each also scans a quarter of the workers
    for which in ("rollouter", "queue"):
        n = shards_needed(W, p, 10_000, which, 0.5, scan=True)
        key = "rollouters" if which == "rollouter" else "queues"
        assert getattr(load_at(W, p, 10_000, scan=True, **{key: n}), which) <= 0.5
        assert n == 1 or getattr(load_at(W, p, 10_000, scan=True, **{key: n - 1}), which) > 0.5


def test_workload_reads_the_best_run_of_the_cell():
    c = dataclasses.replace(SMALL, len_sigma=0.0, len_min=1)
    w, best = workload(c, "small", 8, 2, [0.25, 0.5, 0.75], **RUN)
    assert w.samples_per_gpu_s * 8 == pytest.approx(best.samples_per_s)
    assert w.rollout_fraction == best.rollout_gpus / 8
    assert w.tokens_per_sample == pytest.approx(c.prompt_len + c.len_median)
    assert w.seqs_per_rollout_gpu == c.max_batch / c.tp
    assert w.resumes_per_sample == pytest.approx(best.interruptions / (8 * c.batch))
    assert best.step_s == min(simulate(c, 8, r, 2, **RUN).step_s for r in (2, 4, 6))


def test_process_costs_with_an_unknown_key_is_refused(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    bad = tmp_path / "costs.json"
    bad.write_text('{"rollouter_per_sample_us": 1.0, "rolouter_per_group_us": 2.0}')
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "benchmarks/simulate.py"), "--scale",
                          "--process-costs", str(bad)], capture_output=True, text=True,
                         cwd=root, timeout=60)
    assert out.returncode == 2
    assert "rolouter_per_group_us" in out.stderr


def test_shards_carry_a_fixed_idle_load_and_one_put_loop_per_queue_shard():
    p = dataclasses.replace(ZERO, rollouter_per_sample_us=500.0, queue_per_sample_us=200.0,
                            put_rtt_us=500.0, rollouter_idle_cores=0.01, queue_idle_cores=0.02)
    one = load_at(W, p, 10_000)
    shards = load_at(W, p, 10_000, rollouters=10, queues=4)
    assert shards.rollouter == pytest.approx((one.rollouter - 0.01) / 10 + 0.01)
    assert shards.queue == pytest.approx((one.queue - 0.02) / 4 + 0.02)
    assert shards.put_loop == pytest.approx(one.put_loop / 40)  # 10 rollouters x 4 loops each
    # an idle load over the level: no shard count is enough
    with pytest.raises(ValueError):
        shards_needed(W, dataclasses.replace(p, queue_idle_cores=0.6), 1000, "queue", 0.5)


def test_scale_report_shows_the_default_shards_up_to_100000_gpus(capsys):
    import argparse

    from benchmarks.simulate import scale_report
    from rollmesh.config import default_shards

    args = argparse.Namespace(scale_gpus="1024,100000", scale_splits="0.5",
                              scale_staleness="2", steps=4, warmup=1, seed=0, scale_cell=8,
                              scale_models="7b", scale_check_gpus="", scale_level=0.5,
                              process_costs=None)
    small = dict(dataclasses.asdict(SMALL))
    rows = scale_report(args, ProcessCosts(), small)
    out = capsys.readouterr().out
    assert "with the default shards" in out
    n, m = default_shards(100_000)
    line = next(x for x in out.splitlines() if x.strip().startswith("100,000") and
                x.split()[1] == str(n))
    assert line.split()[2] == str(m)
    assert any("at 100,000 GPUs" in r["figure"] for r in rows)
