"""The `rollmesh` command: one entry point, one sub-command per way of using rollmesh."""

from __future__ import annotations

import argparse
import importlib
import sys

# Sub-commands that own their own argument parsing: name -> "module:function(argv) -> int".
_DELEGATED = {
    "engine": ("rollmesh.engine.builtin.server:main", "serve a model over the SGLang HTTP contract"),
    "role": ("rollmesh.runtime.process:role_main", "run one role process (used by the launcher)"),
    "monitor": ("rollmesh.observe.monitor:main", "watch a running run live, read-only"),
    "launch": ("rollmesh.launcher.commands:main", "start every role of a cluster file"),
    "status": ("rollmesh.launcher.commands:status_main", "show a run's processes (rollmesh status RUN)"),
    "stop": ("rollmesh.launcher.commands:stop_main", "stop a run from another terminal"),
    "sft": ("rollmesh.training.sft:main", "supervised warm-start on chat transcripts (before RL)"),
}


def _call(target: str, argv: list[str]) -> int:
    module, func = target.split(":")
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollmesh", description=__doc__)
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in _DELEGATED.items():
        sub.add_parser(name, help=help_, add_help=False)
    c = sub.add_parser("config", help="validate an experiment config and print it resolved")
    c.add_argument("path", nargs="?")
    c.add_argument("--reference", action="store_true",
                   help="print the configuration reference (markdown) instead")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pl = sub.add_parser("plot", help="draw a run's metrics to a PNG (rollmesh plot RUN)")
    pl.add_argument("run", metavar="RUN", help="a run directory or its metrics.jsonl")
    pl.add_argument("--metrics", metavar="A,B,...",
                    help="one panel per named metrics key instead of the default panels")
    pl.add_argument("-o", "--output", metavar="FILE", help="the PNG (default: RUN/plot.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATED:
        return _call(_DELEGATED[argv[0]][0], argv[1:])
    args = _parser().parse_args(argv)
    if args.version:
        from rollmesh import __version__

        print(__version__)
        return 0
    if args.command == "config":
        return _config(args)
    if args.command == "plot":
        return _plot(args)
    _parser().print_help()
    return 2


def _config(args: argparse.Namespace) -> int:
    from rollmesh.config import ConfigError, load_experiment, reference_markdown, to_toml

    if args.reference:
        print(reference_markdown())
        return 0
    if not args.path:
        print("rollmesh config: give an experiment file (or --reference)", file=sys.stderr)
        return 2
    try:
        cfg = load_experiment(args.path, overrides=args.overrides)
    except ConfigError as e:
        print(f"rollmesh: {e}", file=sys.stderr)
        return 2
    print(to_toml(cfg))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rollmesh.observe.plot import metrics_file, plot_run

    metrics = None
    if args.metrics is not None:
        metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    try:
        path = metrics_file(args.run)
        out = Path(args.output) if args.output else path.parent / "plot.png"
        panels = plot_run(path, out, metrics)
    except (OSError, ValueError) as e:
        print(f"rollmesh plot: {e}", file=sys.stderr)
        return 2
    print(out)
    print("panels: " + ", ".join(panels))
    return 0
