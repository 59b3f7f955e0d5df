"""The command line's surface: every option explains itself, completion scripts exist, the
version prints, and the library works without the optional plotting extra."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gpusched.cli.main import build_parser


def _walk(parser: argparse.ArgumentParser, path: str = "gpusched"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{path} {name}")
        else:
            yield path, action


def test_every_option_and_argument_has_help():
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in _walk(build_parser())
               if not a.help or a.help == argparse.SUPPRESS and a.option_strings != ["-h", "--help"]]
    assert missing == [], f"{len(missing)} option(s) without help: {missing}"


def test_listings_share_output_and_filter_options():
    parser = build_parser()
    for cmd in ("jobs", "queue", "history"):
        args = parser.parse_args([cmd, "--team", "a", "--user", "u", "--state", "pending", "--since", "2h",
                                  "--until", "2026-01-01", "--json", "--no-header", "-o", "wide"])
        assert (args.team, args.user, args.state, args.output) == ("a", "u", "pending", "wide")
    for cmd in ("jobs", "nodes", "teams"):
        assert parser.parse_args([cmd, "--at", "120"]).at == "120"


def _gpusched(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpusched.cli.main", *argv], capture_output=True, text=True, timeout=60)


def test_version_and_completion():
    version = _gpusched("--version")
    assert version.returncode == 0 and version.stdout.startswith("gpusched ") and "unknown" not in version.stdout
    bash = _gpusched("completion", "bash")
    assert bash.returncode == 0 and "complete" in bash.stdout and "history" in bash.stdout and "--no-header" in bash.stdout
    zsh = _gpusched("completion", "zsh")
    assert zsh.returncode == 0 and zsh.stdout.startswith("#compdef gpusched")


BLOCK_PLOTS = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('numpy', 'matplotlib'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import gpusched
skip = {'gpusched.sim.plots'}
for m in pkgutil.walk_packages(gpusched.__path__, 'gpusched.'):
    if m.name not in skip:
        importlib.import_module(m.name)
from gpusched.cli.main import main
sys.exit(main(['sim', '--limit', '5', '--out', sys.argv[1]]))
"""


def test_library_imports_without_numpy_and_matplotlib(tmp_path):
    """Without matplotlib `sim --out` still writes its CSV and JSON, and says why no plots."""
    proc = subprocess.run([sys.executable, "-c", BLOCK_PLOTS, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gpusched-cluster[sim-plots]" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["jobs.csv", "summary.json"]


def test_sim_out_plots_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")
    from gpusched.cli.main import main

    assert main(["sim", "--limit", "5", "--out", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"jobs.csv", "summary.json"} <= names and any(n.endswith(".png") for n in names)


def test_racks_and_nodes_sort_by_their_numbers():
    from gpusched.readmodel import natural_key

    assert sorted(["rack10", "rack2", "rack100", "rack1"], key=natural_key) == ["rack1", "rack2", "rack10", "rack100"]
    assert sorted(["n10/3", "n2/11", "n2/3"], key=natural_key) == ["n2/3", "n2/11", "n10/3"]
