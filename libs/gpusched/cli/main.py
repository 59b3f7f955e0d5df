"""`gpusched` command line: each subcommand lives in its own module with a `register(sub)`.

Errors read as one line on stderr (`gpusched CMD: ...`), never a traceback unless `--debug`
(or GPUSCHED_DEBUG=1). Exit codes: 0 ok, 1 refused or a check failed, 2 bad usage or a server
that cannot be reached (the line names the address tried and how to fix it), 4 another
distribution installs the `gpusched` package too (`cli.ownership`), 130 interrupted.
"""

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
    "gpusched.cli.history",  # history (accounting, like sacct)
    "gpusched.cli.logs",  # logs
    "gpusched.cli.demo",  # demo (the chaos scene)
    "gpusched.cli.replay",  # replay (audit), schemas
    "gpusched.cli.sim",  # sim (trace simulation)
    "gpusched.cli.users",  # user add|list|revoke
    "gpusched.cli.chaos",  # chaos (fault drills with a verdict)
    "gpusched.cli.partition",  # partition [confirm] (declared partitions)
    "gpusched.lab.cli",  # lab up|drill (the deployed NATS cluster on network namespaces)
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("gpusched-cluster")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpusched", description="Event-sourced GPU cluster scheduler")
    parser.add_argument("--version", action="version", version=f"gpusched {version()}",
                        help="print the installed version and exit")
    parser.add_argument("--debug", action="store_true", default=False,
                        help="show the traceback of an error (default: one line; also GPUSCHED_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # a command group not built yet; the rest still works
                continue
            raise
        module.register(sub)
    p = sub.add_parser("completion", help="print a shell completion script: gpusched completion bash|zsh|tcsh",
                       description="Print a completion script. bash: `gpusched completion bash > "
                                   "~/.local/share/bash-completion/completions/gpusched`; zsh: `gpusched "
                                   "completion zsh > ~/.zfunc/_gpusched` (with ~/.zfunc on $fpath).")
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"], help="the shell to complete for")
    p.set_defaults(func=_completion)
    for name, command in sub.choices.items():
        if name not in ("service", "completion"):  # services take their credentials from $GPUSCHED_CREDS
            _add_creds(command)
    return parser


def _completion(args: argparse.Namespace) -> int:
    import shtab

    sys.stdout.write(shtab.complete(build_parser(), shell=args.shell))
    return 0


def _unreachable(err: BaseException) -> str | None:
    """The one line for a server that cannot be reached, or None when `err` is something else."""
    from gpusched.bus.log import Unreachable

    if isinstance(err, Unreachable):
        return str(err)
    try:
        import redis.exceptions
    except ImportError:  # pragma: no cover
        return None
    if isinstance(err, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return f"cannot reach Redis ({err}); is `gpusched up` running? (or set --redis / GPUSCHED_REDIS_URL)"
    return None


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
    from gpusched.cli.ownership import refusal

    if (why := refusal()) is not None:  # another distribution owns `gpusched` too
        print(why, file=sys.stderr)
        return 4  # not 3: a service exits 3 when deaf (services.shell)
    args = build_parser().parse_args(argv)
    debug = bool(getattr(args, "debug", False)) or os.environ.get("GPUSCHED_DEBUG", "") not in ("", "0")
    if getattr(args, "client", False):
        from gpusched.bus.log import fail_fast

        fail_fast()
    if getattr(args, "creds", None):
        os.environ["GPUSCHED_CREDS"] = args.creds  # explicit beats the environment and the config
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the reader left: say nothing more
        return 0
    except ServerUnsuitable as err:  # one line naming both versions, never a traceback
        print(f"gpusched: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if debug or args.command == "service":  # a service's log keeps the whole story
            raise
        return _report(args.command, err)


def _report(command: str, err: Exception) -> int:
    from gpusched.cli.output import UsageError

    line = _unreachable(err)
    if line is not None:
        print(f"gpusched {command}: {line}", file=sys.stderr)
        return 2
    if isinstance(err, (UsageError, PermissionError)):  # a refusal is one line, not a traceback
        print(f"gpusched {command}: {err}", file=sys.stderr)
        return 2
    print(f"gpusched {command}: error: {type(err).__name__}: {err} (--debug shows the traceback)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
