"""`gpusched` command line: each subcommand lives in its own module with a `register(sub)`."""

from __future__ import annotations

import argparse
import importlib
import sys

#: Modules that add subcommands, in the order `--help` lists them.
COMMAND_MODULES = (
    "gpusched.cli.stack",  # up, service run
    "gpusched.cli.client",  # submit, cancel, quota, drain
    "gpusched.cli.views",  # jobs, show, nodes, teams, queue
    "gpusched.cli.logs",  # logs
    "gpusched.cli.demo",  # demo (the chaos scene)
    "gpusched.cli.replay",  # replay (audit), schemas
    "gpusched.cli.sim",  # sim (trace simulation)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpusched", description="Event-sourced GPU cluster scheduler")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # a command group not built yet; the rest still works
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
