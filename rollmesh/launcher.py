"""`rollmesh launch CLUSTER_TOML`: validate the cluster and its experiment, show the plan.

Starting the roles (locally and over SSH), supervision and the status hub are not built yet
(issue 6): today this command validates both files, logs the resolved configuration and prints
the placement, then says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

from rollmesh.config import ConfigError, load_cluster, to_dict
from rollmesh.log import configure_logging


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollmesh launch")
    p.add_argument("cluster", help="cluster file (launch/*.toml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a cluster or experiment key, e.g. staleness.max_staleness=0")
    p.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    args = p.parse_args(argv)
    log = configure_logging("launcher", stream=sys.stderr)
    try:
        cluster = load_cluster(args.cluster, overrides=args.overrides)
    except ConfigError as e:
        print(f"rollmesh launch: {e}", file=sys.stderr)
        return 2
    log.info("config", cluster=to_dict(cluster), experiment=to_dict(cluster.experiment_config))
    print(f"cluster {cluster.name}: experiment {cluster.experiment}")
    for proc in cluster.processes():
        host = cluster.hosts[proc.host]
        gpus = f" gpus={list(proc.gpus)}" if proc.gpus else ""
        print(f"  {proc.name:18s} on {proc.host} ({host.address}) port {proc.port}{gpus}")
    if args.dry_run:
        return 0
    print("rollmesh launch: starting the roles is not built yet (issue 6); the configuration "
          "above is valid.", file=sys.stderr)
    return 2
