"""A tiny OCI image built on this machine, since no registry is reachable from it: a root file
system holding the host's own `sh`, `cat`, `sleep`, `id` and `perl` (sockets, for the ranks'
rendezvous) with their shared libraries (found by ldd), `podman import`ed into a podman storage configured the way a node daemon configures its
own (`container.configure`). Pass the fixture's directory as the agents' `containers_dir`."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from gpusched.services.nodeagent import container

PROGRAMS = ("/bin/sh", "/bin/cat", "/bin/sleep", "/usr/bin/id", "/usr/bin/perl")
TINY_IMAGE = "localhost/gpusched-test-tiny:1"


def _libraries(program: str) -> list[str]:
    out = subprocess.run(["ldd", program], capture_output=True, text=True, check=False).stdout
    return [w for line in out.splitlines() for w in line.split() if w.startswith("/")]


def rootfs_tar(programs=PROGRAMS) -> bytes:
    """A tar of the programs and the libraries they load, at their host paths."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted({p for prog in programs for p in (prog, *_libraries(prog))}):
            tar.add(os.path.realpath(path), arcname=path.lstrip("/"))
        for empty in ("tmp", "dev", "proc", "sys"):
            info = tarfile.TarInfo(empty)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if empty == "tmp" else 0o755
            tar.addfile(info)
    return buf.getvalue()


def build_image(containers_dir: Path, ref: str = TINY_IMAGE) -> str:
    env = container.configure(containers_dir)
    subprocess.run([container.PODMAN, "import", "--quiet", "-", ref], input=rootfs_tar(), env=env,
                   capture_output=True, check=True)
    return ref


def reset(containers_dir: Path) -> None:
    """Remove every container and image of this storage, then the storage itself."""
    env = container.configure(containers_dir)
    for argv in (["rm", "--all", "--force", "--time", "0"], ["rmi", "--all", "--force"]):
        subprocess.run([container.PODMAN, *argv], env=env, capture_output=True, check=False)
    overlay = containers_dir / "storage" / "overlay"
    if os.path.ismount(overlay):  # the storage driver's private mount, left when podman failed
        subprocess.run(["umount", str(overlay)], capture_output=True, check=False)
    shutil.rmtree(containers_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_image(tmp_path_factory):
    """(containers dir, image ref): the image lies in that dir's storage, ready for a node daemon."""
    missing = [p for p in (container.PODMAN, "runc", "catatonit") if shutil.which(p) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (scripts/install-system-deps.sh installs podman, runc, "
                    "uidmap and catatonit)")
    root = tmp_path_factory.mktemp("containers")
    try:
        yield root, build_image(root)
    finally:
        reset(root)
