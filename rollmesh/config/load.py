"""Reading config files: TOML from disk, `--set section.key=value` overrides, and the loaders
(`load_experiment`, `load_cluster`) with the checks that need both files or this machine (process
counts, a local model directory, local CPUs).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rollmesh.config.cluster import ClusterConfig, _placement_key, is_local_address
from rollmesh.config.experiment import ExperimentConfig
from rollmesh.config.parse import ConfigError, _Context, _join, _parse, _plural, _show
from rollmesh.runtime.cpus import parse_cpulist
from rollmesh.config.roles import ROLES

def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(path, "", "file not found") from None
    except OSError as e:
        raise ConfigError(path, "", f"cannot read ({e.strerror})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(path, "", f"invalid TOML: {e}") from None


def _parse_override(text: str) -> tuple[list[str], Any]:
    source = f"--set {text}"
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(source, "", "expected section.key=value")
    invalid = ConfigError(
        source, "", f"invalid key {key!r} (expected dotted keys, e.g. rollout.top_p)"
    )
    try:
        # TOML's own dotted-key grammar, so quoted keys ("my.host") work as in a file.
        doc: Any = tomllib.loads(f"{key} = 0")
    except tomllib.TOMLDecodeError:
        raise invalid from None
    parts = []
    while isinstance(doc, dict):
        if len(doc) != 1:  # e.g. a newline in the key made two assignments
            raise invalid
        ((name, doc),) = doc.items()
        parts.append(name)
    try:
        parsed = tomllib.loads(f"v = {raw}")
        value = parsed["v"] if parsed.keys() == {"v"} else raw
    except tomllib.TOMLDecodeError:
        value = raw  # not a TOML value: a bare string, so `--set model.path=/m/x` needs no quotes
    return parts, value


def _merge_overrides(
    data: Mapping[str, Any], overrides: Iterable[str], source: str
) -> tuple[dict[str, Any], _Context]:
    """(data with the overrides applied, a context that knows which key paths they set)."""
    merged = copy.deepcopy(dict(data))
    origins: dict[str, str] = {}
    raw: dict[str, str] = {}
    for text in overrides:
        parts, value = _parse_override(text)
        origin = f"--set {text}"
        table, path = merged, ""
        for name in parts[:-1]:
            path = _join(path, name)
            if name not in table:
                # What is missing from a table the override created is both the file's and its.
                table[name] = {}
                origins.setdefault(path, f"{source} (with {origin})")
            elif not isinstance(table[name], dict):
                raise ConfigError(
                    origin,
                    path,
                    f"cannot set a key inside {_show(table[name])} in {source} (not a table)",
                )
            table = table[name]
        table[parts[-1]] = value
        path = _join(path, parts[-1])
        origins[path] = origin
        raw[path] = text.partition("=")[2]
        # A later override of the same key wins; forget origins below it from earlier ones.
        for key in [k for k in origins if k.startswith(path + ".") and origins[k] != origin]:
            del origins[key]
    return merged, _Context(source, origins, raw)


def apply_overrides(
    data: Mapping[str, Any], overrides: Iterable[str], source: str
) -> dict[str, Any]:
    """A copy of `data` (read from `source`) with `section.key=value` overrides applied.

    The value is parsed as a TOML value (`2`, `true`, `"a"`, `[1, 2]`); anything that does not
    parse is taken as a bare string. Validation happens when the result is parsed."""
    merged, _ = _merge_overrides(data, overrides, source)
    return merged


def load_experiment(
    path: str | os.PathLike[str], overrides: Iterable[str] = ()
) -> ExperimentConfig:
    """Read, override and validate an experiment file."""
    source = os.fspath(path)
    data, ctx = _merge_overrides(_read_toml(source), overrides, source)
    return _parse(ExperimentConfig, data, ctx)


def load_cluster(path: str | os.PathLike[str], overrides: Iterable[str] = (),
                 machine_problems: list[ConfigError] | None = None) -> ClusterConfig:
    """Read and validate a cluster file and the experiment it names (`.experiment_config`).

    An override goes to the cluster file if its first key is a cluster key (name, experiment,
    run_dir, hosts, roles, ports, settings...), otherwise to the experiment (e.g.
    `staleness.max_staleness=0`).

    The checks of this machine's state (a local model directory, local CPUs) raise their
    ConfigError; given `machine_problems`, they append it there instead (`rollmesh launch
    --dry-run` plans a run for another machine and warns of them).
    """
    source = os.fspath(path)
    cluster_keys = {f.name for f in dataclasses.fields(ClusterConfig) if f.init}
    mine, theirs = [], []
    for text in overrides:
        first = _parse_override(text)[0][0]
        (mine if first in cluster_keys else theirs).append(text)
    data, ctx = _merge_overrides(_read_toml(source), mine, source)
    if "slurm" in data or data.get("hosts") == "slurm":
        from rollmesh.config.slurm import fill_cluster  # hosts and roles from the allocation

        data = fill_cluster(data, ctx, lambda: _experiment_shape(data, source, theirs))
    cluster: ClusterConfig = _parse(ClusterConfig, data, ctx)
    cluster.experiment = os.path.abspath(os.path.join(os.path.dirname(source), cluster.experiment))
    if not os.path.isfile(cluster.experiment):
        ctx.fail("experiment", f"expected an existing file, got {_show(cluster.experiment)}")
    exp = load_experiment(cluster.experiment, theirs)
    _check_against_experiment(cluster, exp, ctx, machine_problems)
    _on_this_machine(machine_problems, _check_local_cpus, cluster, ctx)
    cluster.experiment_config = exp
    return cluster


def _on_this_machine(problems: list[ConfigError] | None, check: Callable[..., None],
                     *args: Any) -> None:
    """Run a check of this machine's state: its ConfigError is raised, or appended to
    `problems` when there is such a list."""
    if problems is None:
        check(*args)
        return
    try:
        check(*args)
    except ConfigError as e:
        problems.append(e)


def _check_against_experiment(cluster: ClusterConfig, exp: ExperimentConfig, ctx: _Context,
                              machine_problems: list[ConfigError] | None = None) -> None:
    """The experiment's process counts are the cluster's: they must agree."""
    for role, wanted, what in (
        ("engine", exp.engine.count, "engine.count"),
        ("trainer", exp.trainer.ranks, "trainer.ranks"),
    ):
        placed = sum(p.count for p in getattr(cluster.roles, role))
        if placed != wanted:
            ctx.fail(
                f"roles.{role}",
                f"expected {_plural(wanted, 'process')} in all ({what} in "
                f"{cluster.experiment}), got {placed}",
            )
    _on_this_machine(machine_problems, _check_local_model, cluster, exp)
    capacity = cluster.settings.message_queue.capacity_groups
    if capacity is not None and capacity < exp.rollout.batch_groups:
        ctx.fail("settings.message_queue.capacity_groups",
                 f"expected at least rollout.batch_groups ({exp.rollout.batch_groups} in "
                 f"{cluster.experiment}: the trainer takes a batch whole), got {capacity}")
    if cluster.share_gpus and exp.sync.backend != "gloo":
        # 'auto' would pick nccl for a CUDA trainer
        ctx.fail("share_gpus", f"expected sync.backend = 'gloo' in {cluster.experiment} "
                               f"(NCCL refuses two ranks on one GPU), got {exp.sync.backend!r}")
    if cluster.colocate:
        _check_colocated(ctx, cluster, exp)
    if exp.engine.kind == "sglang":
        placements = cluster.roles.engine
        for i, p in enumerate(placements):
            if len(p.gpus) != p.count * exp.engine.tp_size:
                ctx.fail(
                    f"roles.{_placement_key('engine', i, len(placements))}.gpus",
                    f"expected {_plural(p.count * exp.engine.tp_size, 'GPU id')} (count x "
                    f"engine.tp_size: SGLang runs on GPUs), got {_show(p.gpus)}",
                )


def _check_local_cpus(cluster: ClusterConfig, ctx: _Context) -> None:
    """`cpus` on a host that is this machine (and `launcher_cpus`, unless the launcher runs in a
    Slurm allocation) must name CPUs it has, now; SSH hosts and Slurm nodes are checked by each
    process as it starts (rollmesh.runtime.cpus)."""
    from rollmesh.runtime.cpus import available_cpus, missing_problem, supported

    checks: list[tuple[str, str, str]] = []  # key, where, cpulist
    if cluster.launcher_cpus is not None and cluster.slurm is None:
        checks.append(("launcher_cpus", "this machine", cluster.launcher_cpus))
    for role in ROLES:
        placements = getattr(cluster.roles, role)
        for i, p in enumerate(placements):
            host = cluster.hosts[p.host]
            local = host.launch == "local" or (host.launch == "auto"
                                               and is_local_address(host.address))
            if p.cpus is None or not local:
                continue
            key = f"roles.{_placement_key(role, i, len(placements))}.cpus"
            where = f"host {p.host!r} ({host.address}, this machine)"
            if isinstance(p.cpus, list):
                checks += [(f"{key}[{j}]", where, text) for j, text in enumerate(p.cpus)]
            else:
                checks.append((key, where, p.cpus))
    if not checks:
        return
    if not supported():
        ctx.fail(checks[0][0], "CPU placement needs Linux (sched_setaffinity)")
    available = available_cpus()
    for key, where, text in checks:
        problem = missing_problem(parse_cpulist(text), available, where)
        if problem:
            ctx.fail(key, f"{problem}, got {_show(text)}")


def _check_local_model(cluster: ClusterConfig, exp: ExperimentConfig) -> None:
    """A model directory that an engine or trainer on this machine would load must exist now,
    not fail in the engine's log after the launch (remote hosts are not checked from here)."""
    path = exp.model.path
    if path == "tiny" or path.startswith("tiny:"):
        return
    for role in ("engine", "trainer"):
        for p in getattr(cluster.roles, role):
            host = cluster.hosts[p.host]
            local = host.launch in ("local", "slurm") or (  # slurm: a shared filesystem
                host.launch == "auto" and is_local_address(host.address)
            )
            full = os.path.join(host.workdir or ".", os.path.expanduser(path))
            if local and not os.path.isdir(full):
                raise ConfigError(
                    cluster.experiment,
                    "model.path",
                    f"expected 'tiny', 'tiny:<spec>' or an existing model directory (the {role} "
                    f"runs on host {p.host!r}, "
                    f"{'a Slurm node: a shared filesystem' if host.launch == 'slurm' else 'this machine'}"
                    f"), got {_show(path)}" + (
                        f": it is the warm-start's output, run `rollmesh sft "
                        f"{cluster.experiment}` first" if exp.sft.init else ""),
                )


def _experiment_shape(data: dict[str, Any], source: str,
                      overrides: list[str]) -> tuple[int, int, int]:
    """The cluster file's experiment's engines, engine tp_size and trainer ranks (1, 1, 1 while it
    cannot be read: that is reported when the cluster's experiment is loaded)."""
    experiment = data.get("experiment")
    if isinstance(experiment, str):
        path = os.path.join(os.path.dirname(source), experiment)
        if os.path.isfile(path):
            try:
                exp = load_experiment(path, overrides)
                return exp.engine.count, exp.engine.tp_size, exp.trainer.ranks
            except ConfigError:
                pass
    return 1, 1, 1


def _check_colocated(ctx: Any, cluster: ClusterConfig, exp: ExperimentConfig) -> None:
    """`colocate = true`: the engines must be idle to give their KV back (abort pause), and the
    trainer's step and the sync after it are one turn on the device."""
    wanted = (("sync.pause_mode", exp.sync.pause_mode, "abort",
               "an engine gives its KV cache back only when idle"),
              ("sync.sync_every", exp.sync.sync_every, 1,
               "each turn on the device is one step and the sync after it"),
              ("sync.overlap", exp.sync.overlap, False,
               "nothing overlaps the step: rollout is paused while it runs"))
    for key, got, expected, why in wanted:
        if got != expected:
            ctx.fail("colocate", f"expected {key} = {expected!r} in {cluster.experiment} with "
                                 f"colocate = true ({why}), got {got!r}")
    if exp.sync.backend not in ("gloo",) and exp.sync.transport == "broadcast":
        ctx.fail("colocate", f"expected sync.backend = 'gloo' or sync.transport = 'handles' in "
                             f"{cluster.experiment} with colocate = true (NCCL refuses two ranks "
                             f"on one GPU), got sync.backend = {exp.sync.backend!r}")
