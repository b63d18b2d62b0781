"""Which kind of host runs a cluster file's `[hosts.<name>]`: this machine, a machine over SSH,
or a node of a Slurm allocation (job steps)."""

from __future__ import annotations

from rollmesh.config.cluster import HostConfig, is_local_address
from rollmesh.launcher.hosts import Host, LocalHost, SshHost
from rollmesh.launcher.slurm import SlurmHost


def make_host(name: str, cfg: HostConfig, srun_options: list[str] | None = None) -> Host:
    if cfg.launch == "slurm":  # a node of the Slurm allocation: job steps (rollmesh.launcher.slurm)
        return SlurmHost(name, cfg, srun_options)
    local = cfg.launch == "local" or (cfg.launch == "auto" and is_local_address(cfg.address))
    return LocalHost(name, cfg) if local else SshHost(name, cfg)
