"""`gpusched --version`, `--help` and one command build only what they need: the table of
commands in `cli.main` is the modules' own registration, and the quick paths import no client
library (nats, aiohttp, redis, rich)."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import pytest

from gpusched.cli.main import COMMAND_MODULES, COMMANDS, build_parser


def test_the_command_table_is_what_the_modules_register():
    registered = {}
    for name in COMMAND_MODULES:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers()
        importlib.import_module(name).register(sub)
        registered |= {a.dest: (name, a.help) for a in sub._choices_actions}
    assert registered == COMMANDS


@pytest.mark.parametrize("argv", [["jobs", "--state", "running", "--json"], ["show", "j-1"],
                                  ["history", "--user", "bob"], ["user", "list"]])
def test_one_commands_parser_parses_as_the_whole_one(argv):
    lazy, full = build_parser(argv[0]).parse_args(argv), build_parser().parse_args(argv)
    assert {k: v for k, v in vars(lazy).items() if k != "func"} == {k: v for k, v in vars(full).items() if k != "func"}
    assert lazy.func.__qualname__ == full.func.__qualname__


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_the_quick_paths_import_no_client_library(argv):
    code = ("import sys, json\nfrom gpusched.cli.main import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('nats', 'aiohttp', 'redis', 'rich', 'msgspec', 'opentelemetry'))), file=sys.stderr)" % argv)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == []
    assert "gpusched" in proc.stdout


def test_a_command_run_as_the_process_leaves_without_collecting_again_and_one_called_in_process_does_not():
    """`gpusched` (main() with this process's arguments) freezes the collector when the command is
    done, so the interpreter's exit does not walk every object again; main(argv), called by a
    test or a program that goes on, leaves the collector as it was."""
    proc = subprocess.run([sys.executable, "-c", """
import gc, json, sys
from gpusched.cli.main import main
def frozen_after(call):
    try:
        call()
    except SystemExit:
        pass
    return gc.get_freeze_count() > 0
in_process = frozen_after(lambda: main(["--version"]))
sys.argv = ["gpusched", "--version"]
print(json.dumps([in_process, frozen_after(main)]), file=sys.stderr)
"""], capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == [False, True], proc.stderr


def test_argparse_looks_each_of_its_words_up_once_not_once_per_parser():
    """gettext searches the disk for a catalogue at every call, and argparse asks it for its words
    (`options`, the `-h` help, ...) once per parser: a hundred calls at every start, half of
    building the parser. Each word is now looked up once per process: the same translations."""
    proc = subprocess.run([sys.executable, "-c", """
import gettext, json, sys
calls = []
real = gettext.find
gettext.find = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
from gpusched.cli.main import build_parser
build_parser("")
build_parser("jobs")
print(json.dumps([len(calls), len(set(calls))]), file=sys.stderr)
"""], capture_output=True, text=True, timeout=60)
    looked_up, domains = json.loads(proc.stderr.strip().splitlines()[-1])
    assert domains == 1 and looked_up <= 20, looked_up  # one per distinct word, not ~100
