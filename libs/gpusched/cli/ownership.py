"""Refuse to run when another distribution also installs the import package `gpusched`.

The PyPI project `gpusched` (unrelated) installs a package and a command of the same name as
ours (distribution `gpusched-cluster`): with both, each overwrites the other's files, and the
command breaks in ways that explain nothing (`TypeError: 'module' object is not callable`).
We keep the names and refuse, in one line that says what to do, rather than rename the import
package (every module, every user's import and every deploy file would change). The command
`gpusched-cluster`, the distribution's own name, is the same CLI under a name nobody else has.
"""

from __future__ import annotations

import importlib.metadata as metadata

OURS = "gpusched-cluster"
PACKAGE = "gpusched"


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _installs_package(dist: metadata.Distribution) -> bool:
    """Read as text, not parsed: this runs at every CLI start (parsing each RECORD cost ~100 ms)."""
    top = dist.read_text("top_level.txt")
    if top is not None:
        return PACKAGE in top.split()
    record = dist.read_text("RECORD") or ""  # wheels without top_level.txt
    return any(line.startswith(PACKAGE + "/") for line in record.splitlines())


def foreign_owners() -> list[str]:
    """`NAME VERSION` of every installed distribution other than ours that installs `gpusched`."""
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        if not _installs_package(dist):  # the cheap test first: metadata is parsed for owners only
            continue
        name = dist.metadata["Name"] or ""
        if _normal(name) != OURS and name not in found:
            found[name] = dist.version
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
