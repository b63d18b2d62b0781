"""`python -m rollmesh.rewards serve`: a reward child process (started by RewardSandbox)."""

import argparse
import sys

from rollmesh.rewards.sandbox import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollmesh.rewards")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="answer reward requests on stdin/stdout (msgpack frames)")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    p.add_argument("--memory-limit-mb", type=int, default=None, help="address-space limit")
    p.add_argument("--contain", action="store_true",
                   help="run contained: namespaces, a private root, no capability")
    p.add_argument("--hide", action="append", default=[],
                   help="a path (the run's directory) the contained process must not see")
    args = parser.parse_args(argv)
    return serve(args.parent_pid, args.memory_limit_mb, args.contain, args.hide)


if __name__ == "__main__":
    sys.exit(main())
