"""The trainer: the update on fixed batches in-process, and the trainer role as real processes
(one and two ranks) fed by a real MessageQueue."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rollmesh import packing
from rollmesh.config import ExperimentConfig, apply_overrides, parse_config, to_dict
from rollmesh.engine.models import build_tiny
from rollmesh.packing import from_groups
from rollmesh.protocol import Group, PutGroup, StatsRequest, Trajectory
from rollmesh.runtime import Child, Supervisor
from rollmesh.trainer import build_state, evaluate_loss, prepare, update_policy
from rollmesh.transport import RpcClient, Transport, free_port

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


# -- helpers (shared with test_checkpoint and test_sync) -------------------------------------------


# The experiment these tests train: written out here, so that they do not move when the example
# configs in configs/ change.
BASE: dict[str, Any] = {
    "seed": 1,
    "model": {"path": "tiny", "dtype": "float32", "max_context": 512},
    "data": {"train_path": "unused.jsonl", "format": "jsonl", "group_size": 4,
             "max_prompt_tokens": 128},
    "rollout": {"max_new_tokens": 64, "batch_groups": 2, "max_concurrent": 8,
                "temperature": 1.0},
    "staleness": {"max_staleness": 1},
    "algorithm": {"advantage": "grpo", "loss": "ppo", "old_logprobs": "recompute"},
    "trainer": {"lr": 1e-3, "warmup_steps": 0, "lr_schedule": "constant", "total_steps": 10,
                "micro_batch_tokens": 256, "mini_batches": 1, "device": "cpu", "backend": "gloo"},
    "sync": {"sync_every": 1, "backend": "gloo", "bucket_mb": 64.0},
}


def experiment(*overrides: str) -> ExperimentConfig:
    source = "tests/test_trainer.py"
    return parse_config(ExperimentConfig, apply_overrides(BASE, overrides, source), source)


def make_groups(seed: int, n_groups: int = 2, size: int = 4, spec: str = "tiny") -> list[Group]:
    """Groups as the rollout side makes them: prompt + sampled response, behaviour log-probs from
    the initial tiny model (temperature 1), rewards that differ within each group."""
    rng = np.random.default_rng(seed)
    model, _ = build_tiny(spec)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(3, 2000, int(rng.integers(5, 20)))
        trajs = []
        for i in range(size):
            response = rng.integers(3, 2000, int(rng.integers(3, 40)))
            ids = np.concatenate([prompt, response]).astype(np.int32)
            with torch.no_grad():
                logits = model(input_ids=torch.from_numpy(ids).long()[None]).logits[0]
            targets = torch.from_numpy(ids[1:]).long()[:, None]
            lp = torch.log_softmax(logits[:-1], -1).gather(1, targets)
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(response))].astype(np.uint8)
            behaviour = np.r_[0.0, lp[:, 0].numpy()].astype(np.float32) * mask
            trajs.append(Trajectory(
                sample_id=f"s-{seed:03d}-{g:03d}-{i:03d}", group_id=f"g-{seed:03d}-{g:03d}",
                token_ids=ids, logprobs=behaviour.astype(np.float32),
                versions=np.where(mask == 1, 0, -1).astype(np.int32), loss_mask=mask,
                prompt_len=len(prompt), index=i, status="finished", reward=float(i % 2),
                reward_status="ok"))
        groups.append(Group(group_id=f"g-{seed:03d}-{g:03d}", trajectories=trajs))
    return groups


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_run(exp: ExperimentConfig, batches: list[list[Group]]) -> tuple[Any, list[dict]]:
    """The uninterrupted one-rank run, in this process: (state, per-step stats)."""
    with torch_threads(1):
        state = build_state(exp)
        stats = []
        for groups in batches:
            data = prepare(state, from_groups(groups))
            stats.append(update_policy(state, data))
            state.step += 1
        return state, stats


def params_of(state) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in state.model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].detach().float() - b[k].detach().float()).abs().max()) for k in a)


async def start_queue(sup: Supervisor, exp: ExperimentConfig) -> str:
    mq = sup.spawn("message_queue", "rollmesh.message_queue:main", env=ENV,
                   config={"experiment": to_dict(exp), "bind": f"tcp://127.0.0.1:{free_port()}"})
    return (await sup.wait_ready(mq, 120))["rpc"]


async def put_groups(t: Transport, mq_rpc: str, groups: list[Group]) -> None:
    client = RpcClient(t, mq_rpc, timeout_s=30)
    try:
        for g in groups:
            assert (await client.request(PutGroup(group=g))).accepted
    finally:
        client.close()


def spawn_trainers(sup: Supervisor, exp: ExperimentConfig, config: dict[str, Any]) -> list[Child]:
    config = {"experiment": to_dict(exp), "threads": 1, **config}
    if exp.trainer.ranks > 1:
        config["rendezvous"] = f"tcp://127.0.0.1:{free_port()}"
    return [sup.spawn("trainer", "rollmesh.trainer:main", instance=r, env=ENV, config=config,
                      grace_s=30) for r in range(exp.trainer.ranks)]


async def wait_exit(children: list[Child], timeout_s: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(c.process.poll() is None for c in children):
        failed = [c.failure() for c in children if c.fatal is not None]
        if failed:
            raise AssertionError(failed)
        if time.monotonic() > deadline:
            raise AssertionError(f"trainer still running after {timeout_s}s")
        await asyncio.sleep(0.1)
    return [c.process.returncode for c in children]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def with_supervisor(tmp_path: Path, body):
    async def main():
        with Transport() as t:
            sup = Supervisor(t, heartbeat_s=0.5, liveness=6, log_dir=tmp_path / "logs")
            try:
                return await body(t, sup)
            finally:
                await sup.close(grace_s=10)

    return asyncio.run(main())


# -- in-process ------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    (),
    ('algorithm.loss="decoupled_ppo"', "algorithm.behaviour_cap=2.0"),
    ('algorithm.loss="tis"', 'algorithm.loss_agg="seq-mean-token-mean"'),
    ('algorithm.advantage="rloo"', 'algorithm.old_logprobs="bypass"',
     "algorithm.entropy_coef=0.01"),
    ("algorithm.use_reference=true", "algorithm.kl_coef=0.1", 'algorithm.kl_estimator="k2"'),
    ('algorithm.advantage="reinforce_pp"', "algorithm.use_reference=true", "algorithm.kl_coef=0.1",
     "algorithm.kl_in_reward=true"),
], ids=["ppo", "decoupled_ppo", "tis_seq_mean", "rloo_bypass_entropy", "kl_loss", "kl_reward"])
def test_one_optimisation_step_lowers_the_loss_on_a_fixed_batch(overrides):
    exp = experiment(*overrides)
    with torch_threads(2):
        state = build_state(exp)
        data = prepare(state, from_groups(make_groups(1)))
        before = evaluate_loss(state, data)
        stats = update_policy(state, data)
        after = evaluate_loss(state, data)
    assert stats["loss"] == pytest.approx(before, abs=1e-6)  # micro-batches sum to the batch loss
    assert after < before - 1e-3, (before, after)
    assert stats["grad_norm"] > 0 and stats["lr"] == pytest.approx(1e-3)
    assert 0 <= stats["clip_frac"] <= 1 and stats["entropy"] > 0


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_micro_batches_accumulate_to_exactly_one_big_batch():
    """Gradients of each optimizer update are the same whether a mini-batch runs as many small
    micro-batches or as one (global normalisers); so are the losses."""
    groups = make_groups(2, n_groups=3)
    results = []
    for budget in (64, 100_000):
        exp = experiment(f"trainer.micro_batch_tokens={budget}", "trainer.mini_batches=2",
                         'algorithm.loss_agg="seq-mean-token-sum"')
        with torch_threads(1):
            state = build_state(exp)
            grads = []
            step = state.optimizer.step

            def capture(*args, **kwargs):
                grads.append({n: p.grad.clone() for n, p in state.model.named_parameters()})
                return step(*args, **kwargs)

            state.optimizer.step = capture
            stats = update_policy(state, prepare(state, from_groups(groups)))
        results.append((grads, stats["loss"]))
    (small, small_loss), (big, big_loss) = results
    assert len(small) == len(big) == 2
    for a, b in zip(small, big):
        scale = max(float(g.abs().max()) for g in b.values())
        assert max_diff(a, b) < 1e-5 * scale
    assert small_loss == pytest.approx(big_loss, abs=1e-6)


def test_micro_batch_plan_covers_every_sequence_once_within_the_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 300, 37).tolist()
    plan = packing.plan(lengths, list(range(37)), 3, 600)
    assert len({len(mbs) for mbs in plan}) == 1  # every rank runs as many micro-batches
    seen = sorted(i for mbs in plan for mb in mbs for i in mb)
    assert seen == list(range(37))
    for mbs in plan:
        for mb in mbs:
            if len(mb) > 1:
                assert len(mb) * max(lengths[i] for i in mb) <= 600
    loads = [sum(lengths[i] for mb in mbs for i in mb) for mbs in plan]
    assert max(loads) - min(loads) <= max(lengths)


def test_staleness_is_trainer_version_minus_oldest_generated_version():
    versions = torch.tensor([[-1, 3, 4, 5], [-1, -1, 5, 5], [-1, -1, -1, -1]])
    mask = (versions >= 0).float()
    assert packing.staleness(versions, mask, 6).tolist() == [3, 1, 0]


def test_gae_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="critic"):
        build_state(experiment('algorithm.advantage="gae"'))


# -- processes -------------------------------------------------------------------------------------


def test_two_rank_training_equals_one_rank_training(tmp_path):
    """Two trainer processes (FSDP2 over gloo) against the in-process one-rank run, 2 steps."""
    batches = [make_groups(10), make_groups(11)]
    common = ("trainer.total_steps=2", "trainer.mini_batches=2", "trainer.lr=2e-4")
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
    two = load_file(tmp_path / "ckpt/step_00000002/model.safetensors")
    one_state, one_stats = reference_run(experiment(*common), batches)
    assert max_diff(two, params_of(build_state(experiment(*common)))) > 1e-4  # it did train
    diff = max_diff(two, params_of(one_state))
    print("two-rank vs one-rank max abs diff", diff)
    assert diff < 1e-5, diff
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m, ref in zip(metrics, one_stats):
        assert m["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert m["samples_consumed"] == 8 * m["step"] and m["batch_staleness_max"] == 0
        for key in ("pg_loss", "clip_frac", "approx_kl", "entropy", "grad_norm", "lr",
                    "batch_staleness_mean", "tokens_per_s", "reward_mean", "version"):
            assert key in m


def test_tensorboard_sink_writes_event_files_where_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="the optional `tensorboard` extra is not installed")
    from rollmesh.log import get_logger
    from rollmesh.trainer import _tensorboard

    writer = _tensorboard(tmp_path / "tensorboard", get_logger())
    writer.add_scalar("reward_mean", 0.5, 1)
    writer.flush()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
