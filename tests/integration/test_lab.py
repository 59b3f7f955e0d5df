"""The lab's hosts are removed even when its owner dies by SIGKILL (a reaper process), so no
namespace, link, rule or hosts file is left behind. The drills are in test_lab_stack.py."""

from __future__ import annotations

import os
import sys
import time

import pytest

from gpusched.lab import netns

pytestmark = pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "lab available")


def test_a_killed_owner_leaves_nothing(tmp_path):
    """The reaper removes a lab whose owner died by SIGKILL; the next start cleans up too."""
    import signal
    import subprocess

    code = ("from gpusched.lab import netns; import time; lab = netns.Lab().up(); lab.add_host('x'); "
            "lab.write_hosts(); lab.popen('x', ['sleep', '60']); print(lab.tag, flush=True); time.sleep(60)")
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    tag = owner.stdout.readline().strip()
    assert any(ns.startswith(f"{netns.PREFIX}{tag}-") for ns in netns.namespaces())
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 10
    while any(ns.startswith(f"{netns.PREFIX}{tag}-") for ns in netns.namespaces()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(ns.startswith(f"{netns.PREFIX}{tag}-") for ns in netns.namespaces())
    assert not list(netns.NETNS_ETC.glob(f"{netns.PREFIX}{tag}-*"))
