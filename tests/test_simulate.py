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
