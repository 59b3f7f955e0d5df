"""The Dockerfile builds with an engine: its build stage, run here as plain steps on exactly the
context .dockerignore lets through (a file the build needs but the context lacks fails here),
with the pinned setuptools, installs a `gpusched` that runs; the runtime stage's COPY sources are
in the context too. No engine runs here, so this is the closest check to `docker build`."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _instructions() -> list[tuple[int, str, str]]:
    """(stage, instruction, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    out, stage = [], -1
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        word, _, rest = line.strip().partition(" ")
        if word == "FROM":
            stage += 1
        out.append((stage, word, rest.strip()))
    return out


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path (or a folder above it) decides."""
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pattern[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatchcase(p, pattern) and p.count("/") == pattern.count("/") for p in prefixes)
        if hit:
            ignored = not keep
    return ignored


def _context(dest: Path) -> Path:
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    for name in files:
        if (ROOT / name).is_file() and not _ignored(name, patterns):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_every_copy_source_is_in_the_context(tmp_path):
    ctx = _context(tmp_path / "ctx")
    assert not (ctx / "tests").exists() and not (ctx / ".venv").exists()
    for _stage, word, args in _instructions():
        if word == "COPY" and "--from=" not in args:
            for src in args.split()[:-1]:
                assert (ctx / src).exists(), f"COPY {src}: not in the build context (.dockerignore)"


def test_the_build_stage_as_plain_steps(tmp_path):
    ctx = _context(tmp_path / "ctx")
    build = [(w, a) for s, w, a in _instructions() if s == 0]
    assert ("RUN", "python -m venv /opt/gpusched") in build
    venv, src = tmp_path / "opt" / "gpusched", tmp_path / "src"
    src.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pins = (ctx / "deploy/docker/requirements.txt").read_text()
    setuptools = re.search(r"^setuptools==\S+", pins, re.M)
    assert setuptools, "the image must pin the setuptools the project builds with"
    got = subprocess.run([str(venv / "bin/pip"), "install", "-q", "--retries", "1", "--timeout", "15",
                          setuptools.group(0)], capture_output=True, text=True, timeout=300)
    offline = ("NewConnectionError", "Failed to establish", "Temporary failure in name resolution",
               "Network is unreachable", "ProxyError")
    if got.returncode != 0 and any(sign in got.stderr for sign in offline):
        pytest.skip(f"no package index reachable for {setuptools.group(0)}: {got.stderr.strip()[-200:]}")
    assert got.returncode == 0, got.stderr
    for word, args in build:  # the project's COPYs into WORKDIR /src, then its RUN as written
        if word == "COPY" and args.split()[-1].startswith("."):
            *sources, target = args.split()
            for name in sources:
                dest = src / target / (Path(name).name if target.endswith("/") else "")
                (shutil.copytree if (ctx / name).is_dir() else shutil.copy)(ctx / name, dest)
    install = next(a for w, a in build if w == "RUN" and "--no-build-isolation ." in a)
    step = install.split("&&")[0].replace("/opt/gpusched", str(venv)).split()
    done = subprocess.run(step, cwd=src, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    # The runtime dependencies are the test environment's (the same pins): the installed command runs.
    deps = sysconfig.get_paths()["purelib"]
    ran = subprocess.run([str(venv / "bin/gpusched"), "--version"], env={"PYTHONPATH": deps, "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.startswith("gpusched 0."), ran.stderr
    assert (venv / "bin/gpusched-cluster").exists()
