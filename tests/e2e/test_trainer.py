"""End-to-end tests of trainer (they start processes); the unit tests and the
helpers they share are in tests/unit/test_trainer.py."""

from __future__ import annotations

import pytest
from rollmesh.training import checkpoint
from rollmesh.training.state import build_state
from rollmesh.wire.messages import StatsRequest
from rollmesh.wire.transport import RpcClient
from tests.unit.test_trainer import (
    GAE,
    experiment,
    make_groups,
    max_diff,
    params_of,
    put_groups,
    read_metrics,
    reference_run,
    spawn_trainers,
    start_queue,
    wait_exit,
    with_supervisor,
)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [(), (*GAE, "algorithm.critic_lr=2e-4")],
                         ids=["grpo", "gae"])
def test_two_rank_training_equals_one_rank_training(tmp_path, overrides):
    """Two trainer processes (FSDP2 over gloo) against the in-process one-rank run, 2 steps.
    With GAE the critic is sharded too: its parameters and value loss match as well."""
    batches = [make_groups(10), make_groups(11)]
    common = ("trainer.total_steps=2", "trainer.mini_batches=2", "trainer.lr=2e-4", *overrides)
    exp = experiment("trainer.ranks=2", *common)

    async def body(t, sup):
        mq = await start_queue(sup, exp)
        await put_groups(t, mq, batches[0] + batches[1])
        children = spawn_trainers(sup, exp, {
            "message_queue": mq, "metrics_path": str(tmp_path / "metrics.jsonl"),
            "checkpoint_dir": str(tmp_path / "ckpt")})
        await sup.wait_ready(children[0], 120)
        stats = await RpcClient(t, children[0].endpoints["rpc"], timeout_s=10).request(
            StatsRequest())
        return await wait_exit(children), stats

    codes, stats = with_supervisor(tmp_path, body)
    assert codes == [0, 0]
    assert stats.role == "trainer"
    # the two ranks' checkpoint (each rank's shards), loaded into one rank
    saved = build_state(experiment(*common))
    checkpoint.load(tmp_path / "ckpt/step_00000002", model=saved.model,
                    optimizer=saved.optimizer, scheduler=saved.scheduler, critic=saved.critic,
                    critic_optimizer=saved.critic_optimizer,
                    critic_scheduler=saved.critic_scheduler)
    two = params_of(saved)
    one_state, one_stats = reference_run(experiment(*common), batches)
    assert max_diff(two, params_of(build_state(experiment(*common)))) > 1e-4  # it did train
    diff = max_diff(two, params_of(one_state))
    print("two-rank vs one-rank max abs diff", diff)
    assert diff < 1e-5, diff
    if overrides:
        two_critic = params_of(saved, "critic")
        initial = params_of(build_state(experiment(*common)), "critic")
        assert max_diff(two_critic, initial) > 1e-4
        diff = max_diff(two_critic, params_of(one_state, "critic"))
        print("two-rank vs one-rank critic max abs diff", diff)
        assert diff < 1e-5, diff
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m, ref in zip(metrics, one_stats):
        assert m["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        for key in ("value_loss", "value_explained_var", "critic_grad_norm") if overrides else ():
            assert m[key] == pytest.approx(ref[key], abs=1e-5), key
        assert m["samples_consumed"] == 8 * m["step"] and m["batch_staleness_max"] == 0
        for key in ("pg_loss", "clip_frac", "approx_kl", "entropy", "grad_norm", "lr",
                    "batch_staleness_mean", "tokens_per_s", "reward_mean", "version"):
            assert key in m
