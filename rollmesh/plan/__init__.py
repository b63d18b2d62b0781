"""The launch plan's two tables: the roles and how the launcher starts each
(`plan.roles.ROLE_TABLE`: entry point, single process, restart, start order, named ports), and
each role's settings (`plan.settings`: one dataclass per role, what its `main` parses).

The names below are the package's API: import them from `rollmesh.plan`.
"""

from rollmesh.plan.roles import ROLE, ROLE_TABLE, ROLES, SINGLETON_ROLES, START_ORDER, RoleSpec
from rollmesh.plan.settings import (
    AgentWorkerSettings,
    MessageQueueSettings,
    RewardWorkerSettings,
    RolloutSettings,
    SynchronizerSettings,
    TrainerSettings,
)

__all__ = [
    "ROLE",
    "ROLES",
    "ROLE_TABLE",
    "SINGLETON_ROLES",
    "START_ORDER",
    "AgentWorkerSettings",
    "MessageQueueSettings",
    "RewardWorkerSettings",
    "RoleSpec",
    "RolloutSettings",
    "SynchronizerSettings",
    "TrainerSettings",
]
