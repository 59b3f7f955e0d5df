"""Network hosts on one machine: a Linux network namespace per host, each with its own private
address on one bridge, and partitions as nft packet drops between them.

Layout: a switch namespace `gs-lab-<tag>-sw` holds the bridge `br0`; each host `H` is a
namespace `gs-lab-<tag>-H` whose `eth0` (a veth pair, the other end on the bridge) has an
address in `10.231.<n>.0/24`. Nothing is added to the machine's own namespace: the bridge,
veths and nft tables all live inside namespaces the lab made, so deleting them removes every
link and rule. `/etc/netns/<ns>/hosts` names the hosts (what `ip netns exec` mounts on
/etc/hosts), so deploy/'s configs run with their own names (`nats-0.nats`).

`tag` carries the owner's pid: `cleanup_stale()` (run by every `Lab.up`) removes the namespaces
of labs whose owner is gone, killing the processes in them first; a reaper process (`python -m
gpusched.lab.netns --reap TAG`) removes the lab when its owner dies, even by SIGKILL.

What drops cannot model: latency, jitter, bandwidth limits, reordering (netem is not available
in this kernel); a cut here is total and instant for the addresses named.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "gs-lab-"
TABLE = "gs_lab"
NETNS_ETC = Path("/etc/netns")


def _run(*cmd: str, check: bool = True) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def available() -> str:
    """'' when this machine can run a lab, else why not."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/install-system-deps.sh)"
    return ""


def namespaces() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.startswith(PREFIX)]


def _owner(ns: str) -> int | None:
    tag = ns[len(PREFIX):].split("-")[0]
    return int(tag) if tag.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(ns: str) -> None:
    """Kill every process in the namespace, then delete it (its links and rules go with it)."""
    for _ in range(3):
        pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).split()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    _run("ip", "netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def remove_tag(tag: str) -> None:
    for ns in namespaces():
        if ns.startswith(f"{PREFIX}{tag}-"):
            remove(ns)
    for d in NETNS_ETC.glob(f"{PREFIX}{tag}-*") if NETNS_ETC.exists() else []:
        shutil.rmtree(d, ignore_errors=True)


def cleanup_stale() -> list[str]:
    """Remove the namespaces of labs whose owner process is gone; returns their names."""
    gone = [ns for ns in namespaces() if (pid := _owner(ns)) is None or not _alive(pid)]
    for ns in gone:
        remove(ns)
    return gone


class Lab:
    """The hosts of one lab. `add_host` them, `write_hosts()`, then `popen` processes in them."""

    def __init__(self, subnet: int = 231):
        self.tag = str(os.getpid())
        self.subnet = subnet
        self.hosts: dict[str, str] = {}  # host -> address
        self.aliases: dict[str, list[str]] = {}
        self.switch = f"{PREFIX}{self.tag}-sw"
        self._reaper: subprocess.Popen | None = None

    def ns(self, host: str) -> str:
        return f"{PREFIX}{self.tag}-{host}"

    def up(self) -> Lab:
        cleanup_stale()
        remove_tag(self.tag)
        self._reaper = subprocess.Popen([sys.executable, "-m", "gpusched.lab.netns", "--reap", self.tag],
                                        stdin=subprocess.PIPE, start_new_session=True)
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        return self

    def add_host(self, host: str, aliases: tuple[str, ...] = ()) -> str:
        i = len(self.hosts)
        ns, addr = self.ns(host), f"10.{self.subnet}.0.{10 + i}"
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", self.switch, "link", "add", f"h{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        _run("ip", "-n", self.switch, "link", "set", f"h{i}", "master", "br0", "up")
        _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        self._nft(host, f"add table inet {TABLE}")
        for chain, hook in (("in", "input"), ("out", "output")):
            self._nft(host, f"add chain inet {TABLE} {chain} {{ type filter hook {hook} priority 0 ; policy accept ; }}")
        self.hosts[host], self.aliases[host] = addr, list(aliases)
        return addr

    def write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost"] + [f"{a} {h} {' '.join(self.aliases[h])}".rstrip() for h, a in self.hosts.items()]
        for host in self.hosts:
            d = NETNS_ETC / self.ns(host)
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text("\n".join(lines) + "\n")

    def _nft(self, host: str, rule: str) -> None:
        _run("ip", "netns", "exec", self.ns(host), "nft", rule)

    # --- faults ---------------------------------------------------------------------------

    def cut(self, a: str, b: str, one_way: bool = False) -> None:
        """Drop packets from `a` to `b` (and, unless `one_way`, from `b` to `a`)."""
        self._nft(a, f"add rule inet {TABLE} out ip daddr {self.hosts[b]} drop")
        self._nft(b, f"add rule inet {TABLE} in ip saddr {self.hosts[a]} drop")
        if not one_way:
            self.cut(b, a, one_way=True)

    def isolate(self, host: str, from_hosts: list[str] | None = None) -> None:
        """Cut `host` off from every other host (or from `from_hosts` only)."""
        for other in from_hosts if from_hosts is not None else [h for h in self.hosts if h != host]:
            self.cut(host, other)

    def heal(self) -> None:
        for host in self.hosts:
            self._nft(host, f"flush table inet {TABLE}")

    def rules(self) -> int:
        return sum(_run("ip", "netns", "exec", self.ns(h), "nft", "list", "table", "inet", TABLE).count(" drop")
                   for h in self.hosts)

    # --- processes ------------------------------------------------------------------------

    def popen(self, host: str, cmd: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns(host), *cmd], **kw)

    def run(self, host: str, cmd: list[str], timeout: float = 10) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns(host), *cmd], capture_output=True, text=True,
                              timeout=timeout)

    def pids(self, host: str) -> list[int]:
        """The processes in a host (the OS's census, `ps` per host)."""
        return [int(p) for p in _run("ip", "netns", "pids", self.ns(host), check=False).split()]

    def down(self) -> None:
        remove_tag(self.tag)
        if self._reaper is not None and self._reaper.poll() is None:
            self._reaper.kill()
            self._reaper.wait()


def _reap(tag: str) -> None:
    """Wait for the owner to close our stdin (it exits, or is killed), then remove its lab."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.stdin.buffer.read()
    remove_tag(tag)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--reap", required=True)
    _reap(parser.parse_args().reap)
