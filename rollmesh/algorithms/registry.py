"""The registries of the training math's extension points: policy losses, advantage
estimators, reward shapings, each keyed by name (as verl's `register_policy_loss` /
`register_adv_est`).

A built-in registers itself with the decorator (`rollmesh.algorithms.builtin`); a user's own
registers the same way in their package and names the decorated object under the entry-point
group of its kind in their pyproject.toml:

    [project.entry-points."rollmesh.policy_losses"]
    my_loss = "my_package.losses:my_loss"

The config's allowed values (`algorithm.loss`, `algorithm.advantage`,
`algorithm.reward_shaping`) are `names()`: the built-ins, then the entry points' names. This
module and the built-ins' registrations import no torch (the config is checked in processes
that never load it); the math is imported when an entry is called.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Entry",
    "Registry",
    "advantage_estimators",
    "policy_losses",
    "register_advantage_estimator",
    "register_policy_loss",
    "register_reward_shaping",
    "reward_shapings",
]

# The module whose import registers the built-ins (through the decorators below).
_BUILTIN_MODULE = "rollmesh.algorithms.builtin"


@dataclass(frozen=True)
class Entry:
    """One registered function: its name, the function, the dataclass of its own parameters
    (`config`, or None: it takes none) and what its kind declares about it (`info`)."""

    name: str
    fn: Callable[..., Any]
    config: type | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def make_config(self, algorithm: Any = None, **overrides: Any) -> Any:
        """The entry's config: each field from the flat `algorithm` table (AlgorithmConfig; the
        field's metadata `key` names the flat key where it differs from the field's name; a
        field the table lacks keeps its default), then `overrides` by field name. None when
        the entry takes no config (and no overrides)."""
        if self.config is None:
            if overrides:
                raise TypeError(f"{self.name!r} takes no parameters, got "
                                f"{', '.join(sorted(overrides))}")
            return None
        names = {f.name for f in dataclasses.fields(self.config) if f.init}
        unknown = set(overrides) - names
        if unknown:
            raise TypeError(f"{self.name!r}: unknown parameter(s) {', '.join(sorted(unknown))} "
                            f"(it takes {', '.join(sorted(names)) or 'none'})")
        values = {}
        if algorithm is not None:
            for f in dataclasses.fields(self.config):
                key = f.metadata.get("key", f.name)
                if f.init and hasattr(algorithm, key):
                    values[f.name] = getattr(algorithm, key)
        return self.config(**{**values, **overrides})


class Registry:
    """Functions of one kind by name: the built-ins (registered when `_BUILTIN_MODULE` is
    imported) and those of the entry-point group `group`, loaded on first use."""

    def __init__(self, kind: str, group: str) -> None:
        self.kind = kind
        self.group = group
        self._entries: dict[str, Entry] = {}
        self._loaded = False

    def register(self, name: str, *, config: type | None = None,
                 **info: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register the function as `name` (a name registered twice is an error)."""
        if config is not None and not dataclasses.is_dataclass(config):
            raise TypeError(f"{self.kind} {name!r}: config must be a dataclass, got {config!r}")

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            known = self._entries.get(name)
            if known is not None and known.fn is not fn:
                raise ValueError(f"{self.kind} {name!r} is registered already ({known.fn!r})")
            self._entries[name] = Entry(name, fn, config, dict(info))
            return fn

        return decorate

    def unregister(self, name: str) -> None:
        """Forget `name` (tests that register their own)."""
        self._entries.pop(name, None)

    def _builtins(self) -> None:
        if not self._loaded:
            self._loaded = True
            importlib.import_module(_BUILTIN_MODULE)

    def _entry_points(self) -> list[importlib.metadata.EntryPoint]:
        return list(importlib.metadata.entry_points(group=self.group))

    def names(self) -> list[str]:
        """Every registered name, without loading an entry point: those registered in this
        process (the built-ins first, in their order), then the entry points' names."""
        self._builtins()
        names = list(self._entries)
        names += sorted({ep.name for ep in self._entry_points()} - set(names))
        return names

    def get(self, name: str) -> Entry:
        """The entry registered as `name`; an entry point of that name is loaded (its module's
        decorator registers it; an undecorated function is registered as it is)."""
        self._builtins()
        if name not in self._entries:
            for ep in self._entry_points():
                if ep.name == name:
                    fn = ep.load()
                    if name not in self._entries:  # undecorated, or decorated under another name
                        known = [e for e in self._entries.values() if e.fn is fn]
                        self._entries[name] = (dataclasses.replace(known[0], name=name) if known
                                               else Entry(name, fn))
                    break
        if name not in self._entries:
            raise ValueError(f"{self.kind}: expected one of "
                             f"{', '.join(map(repr, self.names()))}, got {name!r}")
        return self._entries[name]


policy_losses = Registry("policy loss", "rollmesh.policy_losses")
advantage_estimators = Registry("advantage", "rollmesh.advantage_estimators")
reward_shapings = Registry("reward shaping", "rollmesh.reward_shapings")


def register_policy_loss(name: str, *, config: type | None = None,
                         needs_behaviour: bool = False) -> Callable[..., Any]:
    """Register `fn(inputs: LossInputs, config) -> (loss, metrics)` as policy loss `name`.

    `config`: the dataclass of the loss's own parameters (built from the flat `[algorithm]`
    keys of the same names, or the field metadata `key`); `needs_behaviour`: it reads
    `inputs.behaviour_logprobs` (the engine's), so `algorithm.old_logprobs = "bypass"` is
    refused with it."""
    return policy_losses.register(name, config=config, needs_behaviour=needs_behaviour)


def register_advantage_estimator(name: str, *, outcome: bool = False,
                                 critic: bool = False) -> Callable[..., Any]:
    """Register `fn(*, mask, rewards, group_index, token_rewards, values, kl, kl_coef, gamma,
    lam, whiten, bootstrap) -> (advantages, returns or None)` as advantage estimator `name`.

    `outcome`: it takes one reward per sequence and compares it within its group (a KL penalty
    in the reward is summed over each sequence first; data.group_size must be >= 2);
    `critic`: it needs the critic's values (the trainer trains a critic, algorithm.critic_lr
    is required) and returns the critic's targets."""
    return advantage_estimators.register(name, outcome=outcome, critic=critic)


def register_reward_shaping(name: str, *, config: type | None = None) -> Callable[..., Any]:
    """Register `fn(rewards [B], lengths [B], config) -> rewards [B]` as reward shaping `name`
    (`config` as for register_policy_loss)."""
    return reward_shapings.register(name, config=config)
