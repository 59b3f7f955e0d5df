"""`gpusched` command line: each subcommand lives in its own module with a `register(sub)`."""

from __future__ import annotations

import argparse
import importlib
import os
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
    "gpusched.cli.users",  # user add|list|revoke
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
    for name, command in sub.choices.items():
        if name != "service":  # services take their credentials from $GPUSCHED_CREDS
            _add_creds(command)
    return parser


def _add_creds(parser: argparse.ArgumentParser) -> None:
    """`--creds FILE` on every command (and sub-action): the identity to connect as."""
    sub = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if sub:
        for child in sub[0].choices.values():
            _add_creds(child)
        return
    if not any("--creds" in a.option_strings for a in parser._actions):
        parser.add_argument("--creds", default=None, metavar="FILE",
                            help="credentials (an nkey seed file; default: $GPUSCHED_CREDS, then the client config)")


def main(argv: list[str] | None = None) -> int:
    from gpusched.bus.log import ServerUnsuitable

    args = build_parser().parse_args(argv)
    if getattr(args, "creds", None):
        os.environ["GPUSCHED_CREDS"] = args.creds  # explicit beats the environment and the config
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except ServerUnsuitable as err:  # one line naming both versions, never a traceback
        print(f"gpusched: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
