"""Packaging: the installed command refuses to run beside another distribution that owns the
`gpusched` package (with a line saying what to do), pyproject.toml carries its metadata, and
docs/man/gpusched.1 is the parser's page."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gpusched.cli.main import build_parser, version
from gpusched.cli.manpage import render

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _foreign_dist(where: Path, top_level: bool) -> None:
    """A distribution `gpusched 9.9` that installs the package `gpusched`, as pip leaves it."""
    info = where / "gpusched-9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gpusched\nVersion: 9.9\n")
    if top_level:
        (info / "top_level.txt").write_text("gpusched\n")
    (info / "RECORD").write_text("gpusched/__init__.py,,\ngpusched-9.9.dist-info/METADATA,,\n")


@pytest.mark.parametrize("top_level", [True, False], ids=["top_level.txt", "RECORD only"])
def test_the_command_refuses_beside_another_gpusched(tmp_path, top_level):
    _foreign_dist(tmp_path, top_level)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for command in ("gpusched", "gpusched-cluster"):
        run = subprocess.run([str(BIN / command), "--version"], env=env, capture_output=True, text=True, timeout=60)
        assert run.returncode == 4, run
        assert "gpusched 9.9 also installs the Python package `gpusched`" in run.stderr
        assert "pip uninstall gpusched" in run.stderr and "Traceback" not in run.stderr
        assert run.stderr.count("\n") == 1


def test_the_command_runs_when_the_package_is_ours_alone():
    for command in ("gpusched", "gpusched-cluster"):
        run = subprocess.run([str(BIN / command), "--version"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == f"gpusched {version()}"


def test_pyproject_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639), not a table
    assert not any(c.startswith("License ::") for c in project["classifiers"])  # PEP 639 forbids both
    assert {"Homepage", "Source", "Issues", "Documentation"} <= set(project["urls"])
    assert all(u.startswith("https://") for u in project["urls"].values())
    assert project["scripts"]["gpusched"] == project["scripts"]["gpusched-cluster"]
    from importlib.metadata import metadata

    installed = metadata("gpusched-cluster")
    assert installed["License-Expression"] == "Apache-2.0"
    assert "Topic :: System :: Distributed Computing" in installed.get_all("Classifier")


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in {id(c): c for c in action.choices.values()}.values():
                yield from _all_parsers(child)


def test_the_man_page_is_the_parsers():
    page = (ROOT / "docs" / "man" / "gpusched.1").read_text()
    assert page == render(build_parser(), version()), "run: python scripts/gen-manpage.py"
    text = page.replace("\\-", "-")
    parsers = list(_all_parsers(build_parser()))
    assert len(parsers) > 30
    for parser in parsers[1:]:
        assert f".SS {parser.prog}\n" in text, parser.prog
        for action in parser._actions:
            for flag in action.option_strings:
                assert re.search(rf"\\fB{re.escape(flag)}\\fR", text), f"{parser.prog} {flag}"


def test_the_man_page_formats_without_warnings():
    groff = shutil.which("groff")
    if groff is None:
        pytest.skip("groff is not installed (apt-get install groff-base): the page's roff is not checked")
    run = subprocess.run([groff, "-man", "-Tutf8", "-ww", "-z", str(ROOT / "docs" / "man" / "gpusched.1")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "", run.stderr
