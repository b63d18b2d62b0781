"""The trainer: the update on fixed batches in-process, and the trainer role as real processes
(one and two ranks) fed by a real MessageQueue."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rollmesh.algorithms import aggregate, gae_advantages, grpo_advantages, kl_estimate
from rollmesh.config import ConfigError, ExperimentConfig, apply_overrides, parse_config, to_dict
from rollmesh.models.loading import build_tiny
from rollmesh.wire.messages import Group, Trajectory
from rollmesh.launcher.supervisor import Child, Supervisor
from rollmesh.training import batching
from rollmesh.training.batching import BatchData, from_groups
from rollmesh.training.state import TrainState, build_state
from rollmesh.training.step import (
    StepBatch, batch_logprobs, critic_micro_batch_loss, critic_values, micro_batch_loss,
    micro_batches, prepare,
    step_metrics, update_policy,
)
from rollmesh.wire.transport import RpcClient, Transport, free_port
from tests.helpers.queue import put_group

ROOT = Path(__file__).resolve().parents[2]
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
    source = "tests/unit/test_trainer.py"
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


GAE = ('algorithm.advantage="gae"', "algorithm.critic_lr=1e-3")


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


@torch.no_grad()
def with_old(state: TrainState, data: StepBatch) -> StepBatch:
    """`data` with its proximal log-probs filled in: the default step (one update per batch)
    takes them from its training forward and leaves `data.old` None; these are the same
    numbers, the policy's log-probs before the update. Call it before `update_policy`."""
    if data.old is not None:
        return data
    return dataclasses.replace(data, old=batch_logprobs(state, data, state.model))


def evaluate_loss(state: TrainState, data: BatchData) -> float:
    """The step's objective on `data` with the current parameters (no update)."""
    norm = {"global_tokens": max(float(data.mask.sum()), 1.0),
            "global_seqs": max(float((data.mask.sum(dim=1) > 0).sum()), 1.0)}
    total = 0.0
    for _, mb in micro_batches(state, data):
        total += micro_batch_loss(state, mb, norm)[1]["loss"]
    return float(state.ranks.sum_(torch.tensor([total], dtype=torch.float64)))


def old_values(state: TrainState, data: BatchData) -> torch.Tensor | None:
    """The critic's values for the whole batch [B, T] (0 outside the mask) before this step's
    updates; None without a critic."""
    both = critic_values(state, data)
    return None if both is None else both[0]


@torch.no_grad()
def evaluate_value_loss(state: TrainState, data: StepBatch) -> float:
    """The critic's clipped value loss on a prepared `data` with its current parameters."""
    norm = {"global_tokens": max(float(data.mask.sum()), 1.0)}
    total = 0.0
    for _, mb in micro_batches(state, data):
        total += critic_micro_batch_loss(state, mb, norm)[1]["value_loss"]
    return float(state.ranks.sum_(torch.tensor([total], dtype=torch.float64)))


def params_of(state, model: str = "model") -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in getattr(state, model).named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].detach().float() - b[k].detach().float()).abs().max()) for k in a)


async def start_queue(sup: Supervisor, exp: ExperimentConfig) -> str:
    mq = sup.spawn("message_queue", "rollmesh.mq.role:main", env=ENV,
                   config={"experiment": to_dict(exp), "bind": f"tcp://127.0.0.1:{free_port()}"})
    return (await sup.wait_ready(mq, 120))["rpc"]


async def put_groups(t: Transport, mq_rpc: str, groups: list[Group]) -> None:
    client = RpcClient(t, mq_rpc, timeout_s=30)
    try:
        for g in groups:
            assert await put_group(client, g)
    finally:
        client.close()


def spawn_trainers(sup: Supervisor, exp: ExperimentConfig, config: dict[str, Any]) -> list[Child]:
    config = {"experiment": to_dict(exp), "threads": 1, **config}
    if exp.trainer.ranks > 1:
        config["rendezvous"] = f"tcp://127.0.0.1:{free_port()}"
    return [sup.spawn("trainer", "rollmesh.training.role:main", instance=r, env=ENV, config=config,
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
    (*GAE, "algorithm.gamma=0.99", "algorithm.lam=0.95", "algorithm.use_reference=true",
     "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true"),
    ('algorithm.loss="gspo"', 'algorithm.loss_agg="seq-mean-token-mean"',
     "algorithm.gspo_clip_low=0.2", "algorithm.gspo_clip_high=0.2"),
    ('algorithm.loss_agg="seq-mean-token-sum-norm"', 'algorithm.advantage="grpo_mean_only"'),
], ids=["ppo", "decoupled_ppo", "tis_seq_mean", "rloo_bypass_entropy", "kl_loss", "kl_reward",
        "gae_kl_reward", "gspo", "dr_grpo"])
def test_one_optimisation_step_lowers_the_loss_on_a_fixed_batch(overrides):
    exp = experiment(*overrides)
    with torch_threads(2):
        state = build_state(exp)
        data = prepare(state, from_groups(make_groups(1)))
        fixed = with_old(state, data)
        before = evaluate_loss(state, fixed)
        stats = update_policy(state, data)
        after = evaluate_loss(state, fixed)
    assert stats["loss"] == pytest.approx(before, abs=1e-6)  # micro-batches sum to the batch loss
    assert after < before - 1e-3, (before, after)
    assert stats["grad_norm"] > 0 and stats["lr"] == pytest.approx(1e-3)
    assert 0 <= stats["clip_frac"] <= 1 and stats["entropy"] > 0
    assert stats["approx_kl_k1"] == pytest.approx(0, abs=1e-5)  # one update: still the old policy


def behaviour_noise(groups: list[Group], seed: int, scale: float = 0.6) -> list[Group]:
    """The groups with their behaviour log-probs moved by N(0, scale) on generated tokens: an
    engine that disagrees with the trainer, so importance weights spread around 1."""
    rng = np.random.default_rng(seed)
    for g in groups:
        for t in g.trajectories:
            noise = rng.normal(0, scale, len(t.logprobs)).astype(np.float32)
            t.logprobs = (t.logprobs + noise * t.loss_mask).astype(np.float32)
    return groups


def _tis_weight(data, cap):
    return torch.exp(data.old - data.behaviour).clamp(max=cap)


def _token_mean(x, data):
    return float((x * data.mask).sum() / data.mask.sum())


# Each case: the policy loss of the first update (the ratio to the old policy is 1 there),
# computed from the prepared batch as the option's formula says.
FIRST_UPDATE = {
    "decoupled_mask": (
        ('algorithm.loss="decoupled_ppo"', "algorithm.behaviour_cap=1.0",
         'algorithm.behaviour_cap_mode="mask"'),
        lambda d: _token_mean(-torch.where(torch.exp(d.old - d.behaviour) > 1.0, 0.0,
                                           torch.exp(d.old - d.behaviour)) * d.advantages, d)),
    "decoupled_truncate": (
        ('algorithm.loss="decoupled_ppo"', "algorithm.behaviour_cap=1.0"),
        lambda d: _token_mean(-_tis_weight(d, 1.0) * d.advantages, d)),
    "tis_pg": (
        ('algorithm.loss="tis"', 'algorithm.tis_surrogate="pg"', "algorithm.tis_cap=1.5"),
        lambda d: _token_mean(-_tis_weight(d, 1.5) * d.advantages * d.old, d)),
    "gspo": (
        ('algorithm.loss="gspo"', 'algorithm.loss_agg="seq-mean-token-mean"'),
        lambda d: float(aggregate(-d.advantages, d.mask, "seq-mean-token-mean"))),
    "cispo": (
        ('algorithm.loss="cispo"',), lambda d: _token_mean(-d.advantages * d.old, d)),
    "dr_grpo_sum_norm": (
        ('algorithm.loss_agg="seq-mean-token-sum-norm"', "algorithm.loss_norm_tokens=50"),
        lambda d: float((-d.advantages * d.mask).sum() / 50 / (d.mask.sum(1) > 0).sum())),
}


@pytest.mark.parametrize("case", FIRST_UPDATE)
def test_policy_loss_options_reach_the_loss(case):
    """The trainer passes each loss option through: its first update's pg_loss is the option's
    formula on the prepared batch (and truncate vs mask, which differ, both come out right)."""
    overrides, expected = FIRST_UPDATE[case]
    with torch_threads(2):
        state = build_state(experiment(*overrides))
        data = prepare(state, from_groups(behaviour_noise(make_groups(3), seed=3)))
        fixed = with_old(state, data)
        stats = update_policy(state, data)
    assert stats["pg_loss"] == pytest.approx(expected(fixed), abs=2e-5)
    if case.startswith("decoupled"):
        assert 0.2 < stats["behaviour_weight_mean"] and stats["grad_norm"] > 0


def test_straight_through_k3_has_k2s_gradient_and_k3s_clamped_value():
    """kl_estimator = "k3+": the KL loss reported is k3 (clamped by kl_clamp), the update is
    exactly the one k2 gives (same gradients, so the same AdamW step)."""
    groups = make_groups(4)
    runs = {}
    for estimator in ("k2", "k3+", "k3"):
        exp = experiment("algorithm.use_reference=true", "algorithm.kl_coef=0.5",
                         f'algorithm.kl_estimator="{estimator}"', "algorithm.kl_clamp=0.3")
        with torch_threads(2):
            state = build_state(exp)
            with torch.no_grad():  # a reference that differs from the policy
                gen = torch.Generator().manual_seed(0)
                for p in state.ref_model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
            data = prepare(state, from_groups(groups))
            fixed = with_old(state, data)
            stats = update_policy(state, data)
        runs[estimator] = (stats, params_of(state), fixed)
    stats, params, data = runs["k3+"]
    k3 = kl_estimate(data.old, data.ref, "k3", clamp=0.3)
    assert float(k3.max()) == pytest.approx(0.3) and float(k3.min()) < 0.3  # the clamp binds
    assert stats["kl_loss"] == pytest.approx(float(aggregate(k3, data.mask)), abs=1e-5)
    assert stats["kl_loss"] == pytest.approx(runs["k3"][0]["kl_loss"], abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(runs["k2"][0]["grad_norm"], rel=1e-5)
    assert max_diff(params, runs["k2"][1]) < 1e-6
    assert max_diff(params, runs["k3"][1]) > 1e-5  # k3's own gradient moves it elsewhere


def test_reward_shaping_and_truncated_responses_through_the_trainer():
    """Scale, DAPO overlong penalty and clip give the rewards the advantages are computed from;
    mask_truncated drops responses that hit the length limit from the loss."""
    groups = make_groups(6)
    cut = {(0, 1), (1, 2)}
    for gi, g in enumerate(groups):
        for ti, t in enumerate(g.trajectories):
            t.finish_reason = "length" if (gi, ti) in cut else "stop"
    shaping = ("algorithm.reward_scale=2.0", "algorithm.reward_clip=1.5",
               "algorithm.overlong_buffer=20", "algorithm.overlong_max_tokens=40")
    with torch_threads(2):
        state = build_state(experiment(*shaping))
        data = prepare(state, from_groups(groups))
        stats = update_policy(state, data)
        metrics = step_metrics(state, data, stats, 1.0)
    lengths = data.mask.sum(1)  # generated tokens: 3..39, so some are in the buffer
    penalty = ((20 - lengths) / 20).clamp(-1, 0)
    shaped = (2 * data.rewards + penalty).clamp(-1.5, 1.5)
    assert float(penalty.min()) < 0
    torch.testing.assert_close(data.shaped_rewards, shaped)
    torch.testing.assert_close(data.advantages,
                               grpo_advantages(shaped, data.group_index, data.mask))
    assert metrics["reward_shaped_mean"] == pytest.approx(float(shaped.mean()))
    assert metrics["truncated_frac"] == pytest.approx(2 / 8)
    assert metrics["reward_mean"] == pytest.approx(float(data.rewards.mean()))  # the scores
    with torch_threads(2):
        state = build_state(experiment(*shaping, "algorithm.mask_truncated=true"))
        masked = prepare(state, from_groups(groups))
        masked_stats = update_policy(state, masked)
    rows = [i for i in range(8) if (i // 4, i % 4) in cut]
    assert masked.mask[rows].sum() == 0 and masked.advantages[rows].abs().sum() == 0
    keep = [i for i in range(8) if i not in rows]
    torch.testing.assert_close(masked.mask[keep], data.mask[keep])
    assert masked_stats["loss_tokens"] == float(data.mask[keep].sum())
    torch.testing.assert_close(masked.shaped_rewards, shaped)  # lengths before the mask


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("overrides", [(), GAE], ids=["grpo", "gae"])
def test_micro_batches_accumulate_to_exactly_one_big_batch(overrides):
    """Gradients of each optimizer update are the same whether a mini-batch runs as many small
    micro-batches or as one (global normalisers); so are the losses. With GAE: the critic's too."""
    groups = make_groups(2, n_groups=3)
    results = []
    for budget in (64, 100_000):
        exp = experiment(f"trainer.micro_batch_tokens={budget}", "trainer.mini_batches=2",
                         'algorithm.loss_agg="seq-mean-token-sum"', *overrides)
        with torch_threads(1):
            state = build_state(exp)
            grads = []

            def capture(model, optimizer):
                step = optimizer.step

                def captured(*args, **kwargs):
                    grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                    return step(*args, **kwargs)

                optimizer.step = captured

            capture(state.model, state.optimizer)
            if state.critic is not None:
                capture(state.critic, state.critic_optimizer)
            stats = update_policy(state, prepare(state, from_groups(groups)))
        results.append((grads, stats["loss"], stats.get("value_loss")))
    (small, small_loss, small_value), (big, big_loss, big_value) = results
    assert len(small) == len(big) == (4 if overrides else 2)
    for a, b in zip(small, big):
        scale = max(float(g.abs().max()) for g in b.values())
        assert max_diff(a, b) < 1e-5 * scale
    # float32 sums in another order (transformers 5.24's kernels, the chunked LM head): the
    # first update's gradients agree to 1e-5 relative (above); the second mini-batch's loss is
    # taken after an AdamW step, whose first step is lr * sign(g), so a gradient entry near 0
    # that changes sign moves its parameter by 2 lr: 5e-5 relative.
    assert small_loss == pytest.approx(big_loss, rel=5e-5, abs=1e-6)
    if overrides:
        assert small_value == pytest.approx(big_value, rel=1e-5, abs=1e-6) and small_value > 0


def test_micro_batch_plan_covers_every_sequence_once_within_the_budget():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 300, 37).tolist()
    plan = batching.plan(lengths, list(range(37)), 3, 600)
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
    assert batching.staleness(versions, mask, 6).tolist() == [3, 1, 0]


def test_step_metrics_report_both_ages_staleness_and_since_admission():
    """`batch_staleness_*` from each sample's oldest token, `batch_admission_age_*` from the
    version its group was admitted at: a group admitted at 1 whose first tokens came from 2
    is 3 stale at version 5 and 4 versions past its admission."""
    groups = make_groups(3, n_groups=2, size=2)
    for g, (admitted, made) in zip(groups, [(1, 2), (4, 4)]):
        g.version_admitted = admitted
        for t in g.trajectories:
            t.versions = np.where(t.versions >= 0, made, -1).astype(np.int32)
    data = from_groups(groups)
    assert data.admitted.tolist() == [1, 1, 4, 4]

    class State:  # what step_metrics reads
        step, version, samples_consumed = 7, 5, 28

    m = step_metrics(State(), data, {}, 1.0)
    assert (m["batch_staleness_max"], m["batch_staleness_mean"]) == (3.0, 2.0)
    assert (m["batch_admission_age_max"], m["batch_admission_age_mean"]) == (4.0, 2.5)


def test_gae_without_a_critic_learning_rate_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        experiment('algorithm.advantage="gae"')
    assert str(err.value) == (
        "tests/unit/test_trainer.py: algorithm.critic_lr: missing required value (expected float > 0, "
        "as advantage = 'gae' trains a critic)")
    with pytest.raises(ConfigError, match="algorithm.value_clip: expected"):
        experiment(*GAE, "algorithm.value_clip=0")


# -- the critic (GAE) ------------------------------------------------------------------------------


def hand_trajectory(prompt: list[int], response: list[int], reward: float, name: str) -> Group:
    ids = np.array(prompt + response, np.int32)
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(response))].astype(np.uint8)
    traj = Trajectory(
        sample_id=name, group_id=name, token_ids=ids, logprobs=np.zeros(len(ids), np.float32),
        versions=np.where(mask == 1, 0, -1).astype(np.int32), loss_mask=mask,
        prompt_len=len(prompt), index=0, status="finished", reward=reward, reward_status="ok")
    return Group(group_id=name, trajectories=[traj])


def test_critic_values_line_up_with_token_positions():
    """V_t, the value of token t, is the head on the hidden state of the prefix before token t:
    computed here prefix by prefix, without padding, and compared with the padded batch."""
    state = build_state(experiment(*GAE))
    critic = state.critic.eval()
    seqs = [[5, 9, 13, 2, 7, 11], [4, 8, 3]]
    tokens = torch.tensor([seqs[0], seqs[1] + [0, 0, 0]])
    attention = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    with torch.no_grad():
        values = critic(input_ids=tokens, attention_mask=attention)
        assert values.shape == (2, 6) and values.dtype == torch.float32
        for i, seq in enumerate(seqs):
            assert values[i, 0] == 0  # the first token has no state before it
            for t in range(1, len(seq)):
                prefix = torch.tensor([seq[:t]])
                hidden = critic.model(input_ids=prefix).last_hidden_state[0, -1]
                expected = critic.value_head(hidden)[0]
                assert float(values[i, t]) == pytest.approx(float(expected), abs=1e-5), (i, t)
        # token t itself does not move V_t (the value of choosing it), it moves V_{t+1}
        changed = tokens.clone()
        changed[0, 3] = 17
        moved = critic(input_ids=changed, attention_mask=attention)
    assert torch.equal(moved[0, :4], values[0, :4])
    assert float((moved[0, 4:] - values[0, 4:]).abs().min()) > 0
    # the batch path: each sequence's values on its generated tokens, 0 elsewhere
    groups = [hand_trajectory(seqs[0][:3], seqs[0][3:], 1.0, "a"),
              hand_trajectory(seqs[1][:1], seqs[1][1:], 0.0, "b")]
    data = from_groups(groups)
    batch_values = old_values(state, data)
    torch.testing.assert_close(batch_values, values * data.mask, atol=1e-6, rtol=0)
    assert float(batch_values[0, 3:].abs().min()) > 0
    # the value after each sequence's last token: the head on its last hidden state
    _, after = critic_values(state, data)
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            hidden = critic.model(input_ids=torch.tensor([seq])).last_hidden_state[0, -1]
            assert float(after[i]) == pytest.approx(float(critic.value_head(hidden)[0]), abs=1e-5)


def test_gae_step_matches_a_hand_computation():
    """One sequence, 2 prompt + 3 response tokens, reward 1; the value head is set to a constant
    0.5, so every V_t = 0.5 (t >= 1). gamma 0.9, lam 0.8:
        delta = [0.9*0.5 - 0.5, 0.9*0.5 - 0.5, 1 - 0.5] = [-0.05, -0.05, 0.5]
        A2 = 0.5;  A1 = -0.05 + 0.72*0.5 = 0.31;  A0 = -0.05 + 0.72*0.31 = 0.1732
        R = A + V = [0.6732, 0.81, 1.0];   advantages = A whitened (unbiased std)
    First (only) update: the ratio is 1 and V = old V, so pg_loss = -mean(advantages) and
    value_loss = 0.5 * mean((0.5 - R)^2) = 0.5 * (0.1732^2 + 0.31^2 + 0.5^2) / 3."""
    exp = experiment(*GAE, "algorithm.gamma=0.9", "algorithm.lam=0.8")
    with torch_threads(1):
        state = build_state(exp)
        with torch.no_grad():
            state.critic.value_head.weight.zero_()
            state.critic.value_head.bias.fill_(0.5)
        data = prepare(state, from_groups([hand_trajectory([7, 8], [20, 21, 22], 1.0, "h")]))
        stats = update_policy(state, data)
    adv = torch.tensor([0.1732, 0.31, 0.5])
    whitened = (adv - adv.mean()) / (adv.std() + 1e-8)
    torch.testing.assert_close(data.values, torch.tensor([[0, 0, 0.5, 0.5, 0.5]]))
    torch.testing.assert_close(data.returns, torch.tensor([[0, 0, 0.6732, 0.81, 1.0]]))
    torch.testing.assert_close(data.advantages[0, 2:], whitened)
    assert data.advantages[0, :2].abs().sum() == 0
    assert stats["pg_loss"] == pytest.approx(float(-whitened.mean()), abs=1e-6)
    assert stats["value_loss"] == pytest.approx(0.5 * (0.1732**2 + 0.31**2 + 0.5**2) / 3, rel=1e-5)
    assert stats["value_clip_frac"] == 0 and stats["critic_grad_norm"] > 0
    assert stats["value_mean"] == pytest.approx(0.5)
    assert stats["returns_mean"] == pytest.approx((0.6732 + 0.81 + 1.0) / 3)


def test_gae_bootstraps_a_truncated_response_with_the_critics_value():
    """As test_gae_step_matches_a_hand_computation (V = 0.5 everywhere, gamma 0.9, lam 0.8,
    reward 1), the response cut off by the length limit, bootstrap_truncated on:
        delta = [-0.05, -0.05, 1 + 0.9*0.5 - 0.5 = 0.95]
        A2 = 0.95;  A1 = -0.05 + 0.72*0.95 = 0.634;  A0 = -0.05 + 0.72*0.634 = 0.40648
        R = A + V = [0.90648, 1.134, 1.45]
    The same response with finish reason "stop" keeps V = 0 after its last token."""
    group = hand_trajectory([7, 8], [20, 21, 22], 1.0, "h")
    group.trajectories[0].finish_reason = "length"
    exp = experiment(*GAE, "algorithm.gamma=0.9", "algorithm.lam=0.8",
                     "algorithm.bootstrap_truncated=true")
    with torch_threads(1):
        state = build_state(exp)
        with torch.no_grad():
            state.critic.value_head.weight.zero_()
            state.critic.value_head.bias.fill_(0.5)
        data = prepare(state, from_groups([group]))
        group.trajectories[0].finish_reason = "stop"
        ended = prepare(state, from_groups([group]))
    torch.testing.assert_close(data.returns, torch.tensor([[0, 0, 0.90648, 1.134, 1.45]]))
    torch.testing.assert_close(ended.returns, torch.tensor([[0, 0, 0.6732, 0.81, 1.0]]))
    with pytest.raises(ConfigError, match="bootstrap_truncated: expected false with advantage"):
        experiment("algorithm.bootstrap_truncated=true")


def test_gae_advantages_are_gae_of_the_critics_values_on_a_real_batch():
    """prepare() on sampled groups: advantages and returns are gae_advantages of the sequence
    rewards on their last generated tokens and the critic's values, computed per sequence."""
    exp = experiment(*GAE, "algorithm.gamma=0.95", "algorithm.lam=0.9")
    with torch_threads(2):
        state = build_state(exp)
        data = prepare(state, from_groups(make_groups(5)))
        values = torch.zeros_like(data.mask)
        critic = state.critic.eval()
        with torch.no_grad():
            for i in range(data.size):
                n = int(data.lengths[i])
                hidden = critic.model(input_ids=data.tokens[i:i + 1, :n]).last_hidden_state[0]
                values[i, 1:n] = critic.value_head(hidden[:-1])[:, 0]  # V_t from position t-1
    values = values * data.mask
    last = (data.mask * torch.arange(data.mask.shape[1])).argmax(dim=1)
    token_rewards = torch.zeros_like(data.mask)
    token_rewards[torch.arange(data.size), last] = data.rewards
    adv, returns = gae_advantages(token_rewards, values, data.mask, 0.95, 0.9)
    torch.testing.assert_close(data.values, values, atol=1e-5, rtol=0)
    torch.testing.assert_close(data.returns, returns, atol=1e-5, rtol=0)
    torch.testing.assert_close(data.advantages, adv, atol=1e-4, rtol=0)


def test_one_critic_update_lowers_the_value_loss_on_a_fixed_batch():
    exp = experiment(*GAE, "trainer.mini_batches=2", "algorithm.value_clip=0.05")
    with torch_threads(2):
        state = build_state(exp)
        data = prepare(state, from_groups(make_groups(1)))
        before = evaluate_value_loss(state, data)
        critic_before = params_of(state, "critic")
        stats = update_policy(state, data)
        after = evaluate_value_loss(state, data)
    assert after < before - 1e-3, (before, after)
    assert max_diff(params_of(state, "critic"), critic_before) > 0
    # the second mini-batch starts from the moved critic: a clip range this small bites there
    assert 0 < stats["value_clip_frac"] < 1
    assert stats["critic_grad_norm"] > 0 and stats["critic_lr"] == pytest.approx(1e-3)
    assert stats["value_explained_var"] < 1 and "value_error" in stats


# -- processes -------------------------------------------------------------------------------------


def test_tensorboard_sink_writes_event_files_where_installed(tmp_path):
    pytest.importorskip("tensorboard", reason="the optional `tensorboard` extra is not installed")
    from rollmesh.runtime.log import get_logger
    from rollmesh.training.metrics_sink import tensorboard_writer as _tensorboard

    writer = _tensorboard(tmp_path / "tensorboard", get_logger())
    writer.add_scalar("reward_mean", 0.5, 1)
    writer.flush()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
