"""Refuse to run when another distribution also installs the import package `gpusched`.

The PyPI project `gpusched` (unrelated) installs a package and a command of the same name as
ours (distribution `gpusched-cluster`): with both, each overwrites the other's files, and the
command breaks in ways that explain nothing (`TypeError: 'module' object is not callable`).
We keep the names and refuse, in one line that says what to do, rather than rename the import
package (every module, every user's import and every deploy file would change). The command
`gpusched-cluster`, the distribution's own name, is the same CLI under a name nobody else has.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

OURS = "gpusched-cluster"
PACKAGE = "gpusched"


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _dist_infos() -> Iterator[Path]:
    """Every `*.dist-info` directory on sys.path, found with a directory listing: this runs at
    every CLI start, and importing importlib.metadata alone cost ~40 ms."""
    for entry in sys.path:
        try:
            listing = os.scandir(entry or ".")
        except OSError:
            continue
        with listing:
            for d in listing:
                if d.name.endswith(".dist-info"):
                    yield Path(d.path)


def _read(info: Path, name: str) -> str | None:
    try:
        return (info / name).read_text(errors="replace")
    except OSError:
        return None


def _installs_package(info: Path) -> bool:
    """Read as text, not parsed (parsing each RECORD cost ~100 ms), and searched in one go (a
    line-by-line test of numpy's and pip's RECORDs alone cost ~1.5 ms of every CLI start)."""
    top = _read(info, "top_level.txt")
    if top is not None:
        return PACKAGE in top.split()
    record = _read(info, "RECORD") or ""  # wheels without top_level.txt
    return record.startswith(PACKAGE + "/") or f"\n{PACKAGE}/" in record


def _name_version(info: Path) -> tuple[str, str]:
    """From METADATA's `Name:` and `Version:` (the directory name when it has none)."""
    fields = dict(line.split(": ", 1) for line in (_read(info, "METADATA") or "").split("\n\n")[0].splitlines()
                  if ": " in line)
    stem_name, _, stem_version = info.name.removesuffix(".dist-info").partition("-")
    return fields.get("Name", stem_name), fields.get("Version", stem_version)


def our_version() -> str | None:
    """The version of the distribution `gpusched-cluster` as installed (None: not installed)."""
    for info in _dist_infos():  # pip names the directory NAME-VERSION.dist-info: read only ours
        if _normal(info.name.partition("-")[0]) == OURS:
            name, version = _name_version(info)
            if _normal(name) == OURS:
                return version
    return None


def foreign_owners() -> list[str]:
    """`NAME VERSION` of every installed distribution other than ours that installs `gpusched`."""
    found: dict[str, str] = {}
    for info in _dist_infos():
        if not _installs_package(info):  # the cheap test first: metadata is read for owners only
            continue
        name, version = _name_version(info)
        if _normal(name) != OURS and name not in found:
            found[name] = version
    return [f"{name} {ver}" for name, ver in sorted(found.items())]


def refusal() -> str | None:
    """The line to exit with when the package is shared (None: it is ours alone)."""
    others = foreign_owners()
    if not others:
        return None
    first = others[0].split()[0]
    return (f"gpusched: the distribution {', '.join(others)} also installs the Python package `gpusched` "
            f"(this is {OURS}); the two overwrite each other's files, so this command will not run. "
            f"Fix: `pip uninstall {first}` then `pip install --force-reinstall {OURS}`, "
            f"or keep each in its own virtualenv (pipx install {OURS}).")
