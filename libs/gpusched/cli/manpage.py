"""`gpusched.1`, the man page, rendered from the argparse parser so it cannot drift from `--help`.

    python scripts/gen-manpage.py            # writes docs/man/gpusched.1
    python scripts/gen-manpage.py --check    # exit 1 when the checked-in page differs
    man -l docs/man/gpusched.1

Every command and sub-action gets a section (usage, description, options), in `--help` order.
"""

from __future__ import annotations

import argparse

SEE_ALSO = "nats-server(8), redis-server(1), systemd.exec(5)"
ENVIRONMENT = [
    ("GPUSCHED_NATS_URL", "the NATS server (tls://HOST:4222 in a deployment)"),
    ("GPUSCHED_CREDS", "this process's identity, an nkey seed file (the --creds option wins)"),
    ("GPUSCHED_CA", "the CA bundle that signs the NATS server's certificate"),
    ("GPUSCHED_REDIS_URL", "the Redis that holds the read models"),
    ("GPUSCHED_REDIS_PASSWORD_FILE", "a service's Redis password: a file of mode 0600, or /dev/fd/N"),
    ("GPUSCHED_METRICS_ADDR", "the address of a service's --metrics-port server (default 127.0.0.1)"),
    ("GPUSCHED_DASHBOARD_HOSTS", "more Host names the dashboard answers to, comma-separated"),
    ("GPUSCHED_DEBUG", "1: show the traceback of an error"),
]
EXIT_STATUS = [
    ("0", "success"), ("1", "refused, or a check failed"),
    ("2", "bad usage, or a server that cannot be reached (the line says which and how to fix it)"),
    ("4", "another distribution installs the Python package gpusched too"), ("130", "interrupted"),
]


def roff(text: str) -> str:
    """Text safe in a roff line: backslashes escaped, hyphens as minus signs, no leading control."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line[:1] in (".", "'") else line for line in text.splitlines())


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    return " ".join(parser._get_formatter()._expand_help(action).split())


def _flags(action: argparse.Action) -> str:
    meta = ""
    if action.nargs != 0:
        meta = " \\fI" + roff(argparse.HelpFormatter("x")._format_args(action, action.dest.upper())) + "\\fR"
    metavar = " ".join(action.metavar) if isinstance(action.metavar, tuple) else action.metavar
    names = action.option_strings or [metavar or action.dest]
    return ", ".join(f"\\fB{roff(n)}\\fR" for n in names) + meta


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line, unwrapped (the terminal's width must not change the page): man fills it."""
    words = parser.format_usage().split()
    return roff(" ".join(words[1:] if words[:1] == ["usage:"] else words))


def _options(parser: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        out += [".TP", _flags(action), roff(_help(parser, action)) or "\\&"]
    return out


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line help) of each direct subcommand, aliases once."""
    found: list[tuple[str, argparse.ArgumentParser, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, child in action.choices.items():
                if id(child) not in seen:
                    seen.add(id(child))
                    found.append((name, child, helps.get(name, "")))
    return found


def _sections(parser: argparse.ArgumentParser) -> list[str]:
    out: list[str] = []
    for _name, child, summary in _subcommands(parser):
        out += [".SS " + roff(child.prog), roff(summary) if summary else "", ".PP", _usage(child)]
        if child.description and child.description != summary:
            out += [".PP", roff(" ".join(child.description.split()))]
        out += _options(child)
        out += _sections(child)
    return [line for line in out if line != ""]


def render(parser: argparse.ArgumentParser, version: str) -> str:
    """The whole page as roff (man(7) macros)."""
    name = parser.prog
    lines = [f'.TH {name.upper()} 1 "" "{roff(name)} {roff(version)}" "User Commands"',
             ".\\\" Generated from the argparse parser by scripts/gen-manpage.py: do not edit.",
             ".SH NAME", f"{roff(name)} \\- {roff(parser.description or '')}",
             ".SH SYNOPSIS", _usage(parser),
             ".SH DESCRIPTION",
             roff("An event-sourced GPU cluster scheduler over NATS JetStream. Each COMMAND below has its "
                  "own options; `gpusched COMMAND --help` prints the same text."),
             ".SH OPTIONS", *_options(parser),
             ".SH COMMANDS", *_sections(parser),
             ".SH ENVIRONMENT"]
    for var, what in ENVIRONMENT:
        lines += [".TP", f"\\fB{roff(var)}\\fR", roff(what)]
    lines.append(".SH EXIT STATUS")
    for code, what in EXIT_STATUS:
        lines += [".TP", f"\\fB{code}\\fR", roff(what)]
    lines += [".SH SEE ALSO", roff(SEE_ALSO)]
    return "\n".join(lines) + "\n"


__all__ = ["render", "roff"]
