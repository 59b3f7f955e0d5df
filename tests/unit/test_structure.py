"""The shape of the code stays as the design says: small functions and classes in libs/ and
services/, no import cycle between files (a module-level or deferred import both count), and
one list of the cycle's steps.

The sizes are a prompt, not a bar to slip under: a function over 80 lines or a class over 400
raises a `SplitWarning` naming it, which asks for a split by concern (not for lines shaved to
pass); only twice that fails."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*(ROOT / "libs" / "gpusched").rglob("*.py"), *(ROOT / "services").rglob("*.py")])
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 400
#: Known exceptions, to be split: listed, so that no new one slips in (none left).
KNOWN_LONG: set[str] = set()


class SplitWarning(UserWarning):
    """A function or class has grown past the size where it usually mixes concerns."""


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[0] == "libs":
        parts = parts[1:]
    else:  # services/ is installed as gpusched.services
        parts = ["gpusched", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module(p): p for p in SOURCES}


def _sizes(kind: type) -> list[tuple[str, int]]:
    out = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind):
                if f"{path.relative_to(ROOT)} {node.name}" not in KNOWN_LONG:
                    out.append((f"{path.relative_to(ROOT)}:{node.lineno} {node.name}",
                                node.end_lineno - node.lineno + 1))
    return out


def _ask_for_splits(what: str, sizes: list[tuple[str, int]], most: int) -> list[tuple[str, int]]:
    """Warn for each over `most` lines; return those over twice that."""
    for where, n in sizes:
        if n > most:
            warnings.warn(SplitWarning(f"{where}: {n} lines ({what} over {most}): split it by concern"), stacklevel=2)
    return [(w, n) for w, n in sizes if n > 2 * most]


def test_functions_over_80_lines_ask_for_a_split():
    assert _ask_for_splits("function", _sizes((ast.FunctionDef, ast.AsyncFunctionDef)), MAX_FUNCTION_LINES) == []


def test_classes_over_400_lines_ask_for_a_split():
    assert _ask_for_splits("class", _sizes(ast.ClassDef), MAX_CLASS_LINES) == []


def test_a_long_function_is_a_warning_and_a_far_longer_one_fails():
    import pytest

    with pytest.warns(SplitWarning, match="x.py:1 f: 81 lines"):
        assert _ask_for_splits("function", [("x.py:1 f", 81), ("x.py:9 g", 80)], 80) == []
    with pytest.warns(SplitWarning):
        assert _ask_for_splits("function", [("x.py:1 f", 161)], 80) == [("x.py:1 f", 161)]


#: Functions outside a class that take `self`, to be moved into one: nats' `Client._send_publish`,
#: replaced (its `self` is the client's), and the node daemon's, until its split (`agentsplit`).
KNOWN_SELF = {"libs/gpusched/bus/fastpath.py send_publish"} | {
    f"services/nodeagent/agent.py {name}"
    for name in ("_launch_spec_for", "_watch_run", "_adopt_running", "_handle_control", "_register_node")}


def _functions_taking_self(path: Path) -> list[str]:
    """Functions of `path` not defined in a class body with a parameter named `self`."""
    tree = ast.parse(path.read_text())
    methods = {id(f) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for f in c.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(node) not in methods:
            args = node.args
            if "self" in (a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]):
                found.append(f"{path.relative_to(ROOT)} {node.name}")
    return found


def test_no_function_outside_a_class_takes_self():
    """A function pushed out of a class "for its size" but still taking `self` is the class's
    method in disguise: split the class by concern instead (the fold's reducers take `st`)."""
    found = {f for path in SOURCES for f in _functions_taking_self(path)}
    assert sorted(found - KNOWN_SELF) == []


def test_the_docs_name_the_cycles_steps_as_cycle_steps_lists_them():
    """README, `policy/__init__` and `policy/cycle` name the steps in `cycle.STEPS` order."""
    from gpusched.policy import cycle

    names = [s.name for s in cycle.STEPS]
    docs = {
        "README.md": (ROOT / "README.md").read_text(),
        "policy/__init__.py": (ROOT / "libs/gpusched/policy/__init__.py").read_text(),
        "policy/cycle.py": (ROOT / "libs/gpusched/policy/cycle.py").read_text(),
    }
    pattern = r"[ ,>-]+".join(names)
    for where, text in docs.items():
        flat = re.sub(r"\s+", " ", text)
        assert re.search(pattern, flat), f"{where} does not list the steps as cycle.STEPS: {', '.join(names)}"


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (annotation-only imports never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in ast.walk(child))
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(name: str, path: Path) -> set[str]:
    """The project modules `name` imports at run time (absolute and relative, anywhere in the
    file, deferred imports in functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and MODULES.get(t, Path()).name != "__init__.py":
                found.add(t)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_files():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: libs/ modules that still import services/, to be moved below them: the simulator's composed
#: run drives the services' own writer (`services/writer.decide_and_append`) and kinds.
KNOWN_UPWARD = {"gpusched.sim.composed"}


def test_nothing_in_libs_below_the_cli_imports_services():
    """`libs/` is a layer: the CLI may start services, nothing under it imports them."""
    upward = {name for name, path in MODULES.items()
              if path.is_relative_to(ROOT / "libs") and not name.startswith("gpusched.cli")
              and any(t.startswith("gpusched.services") for t in _imports(name, path))}
    assert upward == KNOWN_UPWARD
