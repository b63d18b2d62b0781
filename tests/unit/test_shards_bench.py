"""benchmarks/shards.py's arithmetic (its runs start a process stack: not here): the
configurations it parses, the workers it deals, the medians of its repeats, and the per-shard
costs it writes, which simulate.py's cost model turns back into what was measured."""

import argparse
import dataclasses

import pytest

from benchmarks import shards
from benchmarks.simulate import (ProcessCosts, Workload, queue_seconds_per_sample,
                                 rollouter_seconds_per_sample)


def test_configs_and_dealing():
    assert shards.parse_configs("1x1, 2X2,4x1") == [(1, 1), (2, 2), (4, 1)]
    for bad in ("2", "0x1", "2xq", ""):
        with pytest.raises(SystemExit):
            shards.parse_configs(bad)
    assert shards.dealt(5, 2) == [0, 1, 0, 1, 0]  # the launcher's: worker k to k % N


def test_median_of_repeats_goes_into_dicts_and_lists():
    runs = [{"config": "2x2", "x": 1.0, "by": [1, 10], "cpu": {"a": {"main": 0.1}}},
            {"config": "2x2", "x": 3.0, "by": [3, 30], "cpu": {"a": {"main": 0.5}}},
            {"config": "2x2", "x": 2.0, "by": [2, 20], "cpu": {"a": {"main": 0.2}}}]
    assert shards.median_of(runs) == {"config": "2x2", "x": 2.0, "by": [2, 20],
                                      "cpu": {"a": {"main": 0.2}}}


def test_costs_give_back_the_measured_per_sample_figures():
    args = argparse.Namespace(prompt_tokens=40, new_tokens=2, group_size=16)
    r = {"config": "2x2", "rollouters": 2, "queues": 2, "agents": 4, "rewards": 2,
         "resumes": 0, "queued_samples": 1000,
         "per_sample": {"rollouter0": {"main_net_us": 900.0}, "rollouter1": {"main_net_us": 700.0},
                        "queue0": {"main_net_us": 300.0}, "queue1": {"main_net_us": 300.0}},
         "idle_cpu_per_s": {"rollouter0_main": 0.01, "rollouter0_all": 0.02,
                            "rollouter1_main": 0.03, "queue0_main": 0.004, "queue1_main": 0.006}}
    costs = shards.shard_costs(r, args)
    assert costs["rollouter_idle_cores"] == pytest.approx(0.02)
    assert costs["queue_idle_cores"] == pytest.approx(0.005)
    p = dataclasses.replace(ProcessCosts(), **costs)
    w = Workload("t", 0, "2x2", 0.0, 0.0, 0.0, 40.0, 42.0, 0.0, 16)
    assert 1e6 * rollouter_seconds_per_sample(w, p, 2, 1) == pytest.approx(800.0)
    assert 1e6 * queue_seconds_per_sample(w, p) == pytest.approx(300.0)
    assert set(costs) <= {f.name for f in dataclasses.fields(ProcessCosts)}
