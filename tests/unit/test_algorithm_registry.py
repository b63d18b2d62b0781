"""The extension points of the training math: a policy loss, an advantage estimator and a reward
shaping added without editing rollmesh (through the registry's decorator, and through an entry
point), checked by the config, and trained with for a real step of the tiny model."""

from __future__ import annotations

import importlib.metadata
import sys
from dataclasses import dataclass

import pytest
import torch

from rollmesh.algorithms import LossInputs, policy_loss
from rollmesh.algorithms.registry import (
    advantage_estimators, policy_losses, register_advantage_estimator, register_policy_loss,
    register_reward_shaping, reward_shapings,
)
from rollmesh.config import ConfigError
from rollmesh.training.batching import from_groups
from rollmesh.training.state import build_state
from rollmesh.training.step import prepare, update_policy
from tests.unit.test_trainer import experiment, make_groups, torch_threads, with_old


@dataclass
class ScaledPGConfig:
    clip_high: float = 0.2  # a flat [algorithm] key: filled from algorithm.clip_high
    scale: float = 3.0  # the loss's own: its default


def scaled_pg(x: LossInputs, cfg: ScaledPGConfig):
    """-scale * A * logp, token by token (no ratio): a loss rollmesh does not have."""
    loss_t = -cfg.scale * x.advantages.detach().float() * x.logprobs.float()
    return x.aggregate(loss_t), {"scale": torch.tensor(cfg.scale), "clip_high_seen":
                                 torch.tensor(cfg.clip_high)}


@pytest.fixture
def scaled_pg_loss():
    register_policy_loss("scaled_pg", config=ScaledPGConfig)(scaled_pg)
    yield
    policy_losses.unregister("scaled_pg")


def test_builtins_are_registered_in_order_and_the_config_lists_them():
    assert policy_losses.names()[:5] == ["ppo", "decoupled_ppo", "tis", "gspo", "cispo"]
    assert advantage_estimators.names()[:5] == ["grpo", "grpo_mean_only", "rloo",
                                                "reinforce_pp", "gae"]
    assert reward_shapings.names()[0] == "default"
    assert advantage_estimators.get("gae").info == {"outcome": False, "critic": True}
    assert advantage_estimators.get("rloo").info == {"outcome": True, "critic": False}
    assert policy_losses.get("tis").info == {"needs_behaviour": True}
    with pytest.raises(ConfigError, match="algorithm.loss: expected one of 'ppo', "
                                          "'decoupled_ppo', 'tis', 'gspo', 'cispo', got 'mine'"):
        experiment('algorithm.loss="mine"')


def test_a_registered_loss_is_accepted_by_the_config_and_trains(scaled_pg_loss):
    exp = experiment('algorithm.loss="scaled_pg"', "algorithm.clip_high=0.25")
    cfg = policy_losses.get("scaled_pg").make_config(exp.algorithm)
    assert cfg == ScaledPGConfig(clip_high=0.25, scale=3.0)
    with torch_threads(2):
        state = build_state(exp)
        data = with_old(state, prepare(state, from_groups(make_groups(3))))
        stats = update_policy(state, data)
    # First update: the policy is the one that computed data.old, so logp == old.
    expected = float((-3.0 * data.advantages * data.old * data.mask).sum() / data.mask.sum())
    assert stats["pg_loss"] == pytest.approx(expected, abs=2e-5)
    assert abs(expected) > 1e-3 and stats["grad_norm"] > 0
    assert stats["clip_frac"] == 0.0  # a metric the loss does not return: filled in
    assert stats["approx_kl"] == pytest.approx(0.0, abs=1e-6)


def test_policy_loss_takes_the_loss_config_or_its_fields(scaled_pg_loss):
    torch.manual_seed(0)
    logp, adv, mask = torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 4)
    loss, metrics = policy_loss("scaled_pg", logp, logp, adv, mask, ScaledPGConfig(scale=2.0))
    assert float(loss) == pytest.approx(float((-2.0 * adv * logp).mean()), rel=1e-6)
    assert float(metrics["scale"]) == 2.0 and "approx_kl" in metrics
    loss, _ = policy_loss("scaled_pg", logp, logp, adv, mask, scale=0.5)
    assert float(loss) == pytest.approx(float((-0.5 * adv * logp).mean()), rel=1e-6)
    with pytest.raises(TypeError, match="unknown parameter"):
        policy_loss("scaled_pg", logp, logp, adv, mask, tis_cap=2.0)


def test_an_advantage_estimator_and_a_shaping_registered_by_a_user():
    @register_advantage_estimator("sign", outcome=True)
    def sign(*, mask, rewards, group_index, **_):
        return torch.sign(rewards - 0.5)[:, None] * mask, None

    @dataclass
    class Offset:
        reward_scale: float = 1.0  # a flat key
        offset: float = 0.25

    @register_reward_shaping("offset", config=Offset)
    def offset(rewards, lengths, cfg):
        return rewards.float() * cfg.reward_scale + cfg.offset

    try:
        exp = experiment('algorithm.advantage="sign"', 'algorithm.reward_shaping="offset"',
                         "algorithm.reward_scale=2.0")
        with torch_threads(2):
            state = build_state(exp)
            data = prepare(state, from_groups(make_groups(5)))
        torch.testing.assert_close(data.shaped_rewards, data.rewards.float() * 2.0 + 0.25)
        expected = torch.sign(data.shaped_rewards - 0.5)[:, None] * data.mask
        torch.testing.assert_close(data.advantages, expected)
        assert state.critic is None
    finally:
        advantage_estimators.unregister("sign")
        reward_shapings.unregister("offset")
    with pytest.raises(ConfigError, match="algorithm.advantage: expected one of 'grpo'"):
        experiment('algorithm.advantage="sign"')


def test_a_loss_from_an_entry_point_is_listed_and_loaded(monkeypatch, tmp_path):
    """A user's package names its loss under `rollmesh.policy_losses`: the config accepts the
    name before anything is imported, the trainer's lookup imports the module (its decorator
    registers the loss with its config)."""
    (tmp_path / "user_losses.py").write_text(
        "from rollmesh.algorithms import register_policy_loss\n"
        "from tests.unit.test_algorithm_registry import ScaledPGConfig, scaled_pg\n"
        "user_loss = register_policy_loss('user_loss', config=ScaledPGConfig)(scaled_pg)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    group = "rollmesh.policy_losses"
    ep = importlib.metadata.EntryPoint("user_loss", "user_losses:user_loss", group)
    real = importlib.metadata.entry_points

    def entry_points(**kw):
        if kw.get("group") == group:
            return importlib.metadata.EntryPoints([ep])
        return real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    try:
        exp = experiment('algorithm.loss="user_loss"')  # by name: nothing imported yet
        assert "user_losses" not in sys.modules
        assert policy_losses.names()[-1] == "user_loss"
        entry = policy_losses.get("user_loss")
        assert "user_losses" in sys.modules
        assert entry.fn is scaled_pg and entry.config is ScaledPGConfig
        torch.manual_seed(1)
        logp, adv, mask = torch.randn(1, 3), torch.randn(1, 3), torch.ones(1, 3)
        loss, _ = policy_loss(exp.algorithm.loss, logp, logp, adv, mask)
        assert float(loss) == pytest.approx(float((-3.0 * adv * logp).mean()), rel=1e-6)
    finally:
        policy_losses.unregister("user_loss")
        sys.modules.pop("user_losses", None)
