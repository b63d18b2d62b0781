"""Typed configuration: TOML files -> validated dataclasses, and back to TOML for the logs.

This package owns the schema of the two kinds of config file and every rule about them:

- an experiment file (`configs/*.toml`) -> `ExperimentConfig`, one dataclass per component
  (model, data, rollout, staleness, algorithm, trainer, sync, engine): `experiment.py`;
- a cluster file (`launch/*.toml`) -> `ClusterConfig`: hosts, where each role runs, ports,
  and the experiment it launches (`cluster.experiment_config`): `cluster.py`;
- the roles the launcher starts (`roles.ROLE_TABLE`: entry point, single process, restart,
  start order, named ports) and each role's settings (`settings.py`: one dataclass per role,
  what its `main` parses; `tuning.py`: the cluster file's `[settings.<role>]` tables).

The schema is those dataclasses; one generic validator (`parse.py`) walks their type hints, so a
field declared there is parsed, checked and documented (its `help`) with no further code.
`load.py` reads files and `--set` overrides and checks the two files against each other and this
machine; `write.py` writes configs back out (dicts, TOML) and generates the reference. Every
error is a `ConfigError` naming the file (or the `--set` override), the dotted key path and what
was expected, e.g. `configs/x.toml: staleness.max_staleness: expected int >= 0, got -1`.

The names below are the package's API: import them from `rollmesh.config`.
"""

from rollmesh.config.cluster import (
    ROLES,
    SINGLETON_ROLES,
    ClusterConfig,
    HostConfig,
    Placement,
    PortsConfig,
    Process,
    RolesConfig,
    SlurmConfig,
    is_local_address,
)
from rollmesh.config.experiment import (
    AlgorithmConfig,
    DataConfig,
    EngineConfig,
    LoraConfig,
    ExperimentConfig,
    MetricsConfig,
    ModelConfig,
    PythonToolConfig,
    RolloutConfig,
    SftConfig,
    StalenessConfig,
    SyncConfig,
    TrainerConfig,
)
from rollmesh.config.tuning import (
    AgentWorkerTuning,
    QueueTuning,
    RewardWorkerTuning,
    SettingsConfig,
)
from rollmesh.config.load import apply_overrides, load_cluster, load_experiment
from rollmesh.config.parse import ConfigError, parse_config
from rollmesh.config.write import field_reference, reference_markdown, to_dict, to_toml
from rollmesh.config.roles import ROLE, ROLE_TABLE, START_ORDER, default_shards
from rollmesh.config.settings import (
    AgentWorkerSettings,
    MessageQueueSettings,
    RewardWorkerSettings,
    RolloutSettings,
    SynchronizerSettings,
    TrainerSettings,
    queue_addresses,
)

__all__ = [
    "ROLE",
    "default_shards",
    "queue_addresses",
    "ROLE_TABLE",
    "START_ORDER",
    "AgentWorkerSettings",
    "MessageQueueSettings",
    "RewardWorkerSettings",
    "RolloutSettings",
    "SynchronizerSettings",
    "TrainerSettings",
    "AgentWorkerTuning",
    "AlgorithmConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "ExperimentConfig",
    "HostConfig",
    "MetricsConfig",
    "ModelConfig",
    "Placement",
    "PortsConfig",
    "Process",
    "PythonToolConfig",
    "QueueTuning",
    "ROLES",
    "RewardWorkerTuning",
    "RolesConfig",
    "RolloutConfig",
    "SINGLETON_ROLES",
    "SettingsConfig",
    "SftConfig",
    "SlurmConfig",
    "StalenessConfig",
    "SyncConfig",
    "TrainerConfig",
    "apply_overrides",
    "field_reference",
    "is_local_address",
    "load_cluster",
    "load_experiment",
    "parse_config",
    "reference_markdown",
    "to_dict",
    "to_toml",
]
