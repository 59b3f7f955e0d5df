"""`gpusched` command line: each subcommand lives in its own module with a `register(sub)`.

Errors read as one line on stderr (`gpusched CMD: ...`), never a traceback unless `--debug`
(or GPUSCHED_DEBUG=1). Exit codes: 0 ok, 1 refused or a check failed, 2 bad usage or a server
that cannot be reached (the line names the address tried and how to fix it), 4 another
distribution installs the `gpusched` package too (`cli.ownership`), 130 interrupted.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys

#: argparse translates each of its own words (a parser's "options", each "-h" help: about a
#: hundred at every start, one per stand-in command) with gettext, which looks for a catalogue
#: on disk at every call (65 us each on this machine: half of building the parser). A process's
#: translation of a word does not change, so each is looked up once.
argparse._ = functools.cache(argparse._)  # type: ignore[attr-defined]

#: Modules that add subcommands, in the order `--help` lists them.
COMMAND_MODULES = (
    "gpusched.cli.stack",  # up, service run
    "gpusched.cli.commands",  # submit, cancel, quota, drain
    "gpusched.cli.listings",  # jobs, show, nodes, teams, queue
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
    """The installed distribution's version, read from its dist-info (importlib.metadata costs
    tens of milliseconds to import: every call would pay them)."""
    from gpusched.cli.ownership import our_version

    return our_version() or "unknown (not installed)"


class _Version(argparse.Action):
    """`--version`: the version is looked up only when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"gpusched {version()}")
        parser.exit()


#: Each command: the module that registers it and its line in `--help`, so that `--version`,
#: `--help` and one command import only what they need (tests/unit/test_cli_fast.py checks this
#: table against the modules' own registration). A module not named here is always imported.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("gpusched.cli.stack", "start NATS, Redis, every service and simulated nodes on this machine"),
    "service": ("gpusched.cli.stack", "run one service (the form deploy files use)"),
    "submit": ("gpusched.cli.commands", "submit a job: gpusched submit --team T --gpus N -- COMMAND..."),
    "cancel": ("gpusched.cli.commands", "cancel a pending or running job, or every task of a job array by its id "
                                      "(a tenant: its own team's only)"),
    "quota": ("gpusched.cli.commands", "change a team's guaranteed share, weight or hard limit (only those given)"),
    "fold-settings": ("gpusched.cli.commands",
                      "admin: what every fold computes with from now on (a fact of the log): usage half-life, horizon"),
    "mig": ("gpusched.cli.commands", "admin: lay out a GPU's MIG slices (only while it is idle)"),
    "hold": ("gpusched.cli.commands", "hold a pending job: it is never placed until released (a tenant: its own team's)"),
    "release": ("gpusched.cli.commands", "release a held job: it may be placed again"),
    "update": ("gpusched.cli.commands", "change a pending job's priority class or time limit"),
    "node": ("gpusched.cli.commands", "change a node: gpusched node label NODE KEY=VALUE... (admin)"),
    "drain": ("gpusched.cli.commands", "keep new work off a node (--undo: allow it again)"),
    "restore": ("gpusched.cli.commands", "put a quarantined GPU back into service (admin)"),
    "jobs": ("gpusched.cli.listings", "list jobs with their state and the GPUs they hold"),
    "nodes": ("gpusched.cli.listings", "list nodes and their GPUs, coloured by team (-o wide: which job holds which GPU)"),
    "teams": ("gpusched.cli.listings", "list teams: GPUs held vs guaranteed share and limit"),
    "queue": ("gpusched.cli.listings", "list pending jobs in the order the policy considers them, with why"),
    "show": ("gpusched.cli.listings", "a job's history and why it is pending"),
    "history": ("gpusched.cli.history", "accounting from the log (like sacct): per job wait, run, GPU-hours, "
                                        "end state; --by day|week"),
    "logs": ("gpusched.cli.logs", "a job's stdout/stderr (per rank and attempt, from its node)"),
    "demo": ("gpusched.cli.demo", "the chaos scene: fill, kill placement, flood interactive jobs, restart; verdicts"),
    "replay": ("gpusched.cli.replay", "audit: rebuild the state from the log and verify the invariants"),
    "log": ("gpusched.cli.replay", "the raw log: export it for an offline audit"),
    "schemas": ("gpusched.cli.replay", "write (or --check) the JSON Schemas and the AsyncAPI document of the bus"),
    "sim": ("gpusched.cli.sim", "simulate a job trace under a policy (virtual clock)"),
    "stream": ("gpusched.cli.users", "admin: create the streams (deploy/; `up` does it itself)"),
    "user": ("gpusched.cli.users", "add, list or revoke the identities that may use the stack"),
    "chaos": ("gpusched.cli.chaos", "fault drills with a verdict (kills services, NATS, Redis under load)"),
    "partition": ("gpusched.cli.partition", "nodes in a declared partition; `confirm`: an admin declares them lost"),
    "lab": ("gpusched.lab.cli", "the deployed NATS cluster on separate network hosts (namespaces); fault drills"),
}


def _command_of(argv: list[str]) -> str | None:
    """The command `argv` names ("": none, so only the top-level help or --version), or None
    when it names one the table does not know (then every module is imported)."""
    words = [a for a in argv if not a.startswith("-")]
    if not words:
        return ""
    return words[0] if words[0] in COMMANDS or words[0] == "completion" else None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser (`command` None), or one that imports only the module of `command`
    ("": none), the other commands standing in by their help line."""
    parser = argparse.ArgumentParser(prog="gpusched", description="Event-sourced GPU cluster scheduler")
    parser.add_argument("--version", action=_Version, help="print the installed version and exit")
    parser.add_argument("--debug", action="store_true", default=False,
                        help="show the traceback of an error (default: one line; also GPUSCHED_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    known = {module for module, _ in COMMANDS.values()}
    wanted = [m for m in COMMAND_MODULES if command is None or m not in known
              or (command in COMMANDS and COMMANDS[command][0] == m)]
    for name in wanted:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # a command group not built yet; the rest still works
                continue
            raise
        module.register(sub)
    for name, (_, help_) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_, add_help=False)
    p = sub.add_parser("completion", help="print a shell completion script: gpusched completion bash|zsh|tcsh",
                       description="Print a completion script. bash: `gpusched completion bash > "
                                   "~/.local/share/bash-completion/completions/gpusched`; zsh: `gpusched "
                                   "completion zsh > ~/.zfunc/_gpusched` (with ~/.zfunc on $fpath).")
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"], help="the shell to complete for")
    p.set_defaults(func=_completion)
    for name, command_parser in sub.choices.items():
        if name not in ("service", "completion"):  # services take their credentials from $GPUSCHED_CREDS
            _add_creds(command_parser)
    return parser


def _completion(args: argparse.Namespace) -> int:
    import shtab

    sys.stdout.write(shtab.complete(build_parser(), shell=args.shell))
    return 0


def _unreachable(err: BaseException) -> str | None:
    """The one line for a server that cannot be reached, or None when `err` is something else."""
    from gpusched.bus.dial import Unreachable

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
    """The command `argv` names (None: this process's arguments, and this process is the command)."""
    try:
        return _main(argv)
    finally:
        if argv is None:  # the process ends with the command: nothing after it needs the collector
            _leave_quickly()


def _leave_quickly() -> None:
    """Move every object to the collector's permanent generation, so that the interpreter's exit
    does not walk them all again (its collections at exit were a sixth of admin's `jobs` from
    Redis, 1,000 jobs: tens of ms of CPU). Objects are still freed by reference counting;
    only cycles are left to the process's end, and `atexit` runs as before."""
    import gc

    gc.freeze()


def _main(argv: list[str] | None) -> int:
    from gpusched.cli.ownership import refusal

    if (why := refusal()) is not None:  # another distribution owns `gpusched` too
        print(why, file=sys.stderr)
        return 4  # not 3: a service exits 3 when deaf (services.shell)
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(_command_of(argv)).parse_args(argv)
    debug = bool(getattr(args, "debug", False)) or os.environ.get("GPUSCHED_DEBUG", "") not in ("", "0")
    if getattr(args, "client", False):
        from gpusched.bus.dial import fail_fast

        fail_fast()
    # `--creds` travels in `args` to each connection (explicit beats $GPUSCHED_CREDS and the client
    # config, `bus.dial.creds_file`); never into the environment, which outlives the command
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the reader left: say nothing more
        return 0
    except Exception as err:
        from gpusched.bus.dial import ServerUnsuitable  # here, not above: `--version` stays quick

        if isinstance(err, ServerUnsuitable):  # one line naming both versions, never a traceback
            print(f"gpusched: {err}", file=sys.stderr)
            return 2
        if debug or args.command == "service":  # a service's log keeps the whole story
            raise
        return _report(args.command, err, getattr(args, "creds", None))


def _violation(err: BaseException, creds: str | None = None) -> str | None:
    """The one line for a request the server refused by its permissions (it answers none, so
    the client only times out: the violation is what the connection's error callback heard),
    naming the subject and the caller's role; None when the server said no such thing."""
    from gpusched.bus import dial

    said = [e for e in (*dial._last_error, err) if "permissions violation" in str(e).lower()]
    if not said:
        return None
    who = "this connection"
    path = dial.creds_file(creds)
    if path:
        try:
            ident = dial.load_identity(path)
            who = f"{ident.name} (role {ident.role}" + (f", teams {', '.join(ident.teams)})" if ident.teams else ")")
        except Exception:  # noqa: BLE001 - the violation is the news, the name only helps
            who = f"the identity in {path}"
    text = str(said[0]).removeprefix("nats: ").strip("'")
    return f"permission denied: {who} may not do this: the server says {text}"


def _report(command: str, err: Exception, creds: str | None = None) -> int:
    from gpusched.cli.output import UsageError

    denied = _violation(err, creds)
    if denied is not None:
        print(f"gpusched {command}: {denied}", file=sys.stderr)
        return 1
    line = _unreachable(err)
    if line is not None:
        print(f"gpusched {command}: {line}", file=sys.stderr)
        return 2
    code = getattr(err, "exit_code", None)
    if code is not None:  # a refusal of its own kind (cli.scoped: a read outside one's teams)
        print(f"gpusched {command}: {err}", file=sys.stderr)
        return int(code)
    if isinstance(err, (UsageError, PermissionError)):  # a refusal is one line, not a traceback
        print(f"gpusched {command}: {err}", file=sys.stderr)
        return 2
    print(f"gpusched {command}: error: {type(err).__name__}: {err} (--debug shows the traceback)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
