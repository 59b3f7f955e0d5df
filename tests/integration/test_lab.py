"""The multi-host lab: three NATS servers, each on its own network host (a namespace with its
own address on a bridge), run deploy/k8s/nats-cluster.conf unchanged but for file paths, with
the certificates and users deploy/k8s/make-secrets.sh makes (TLS routes and clients, nkey
auth); readiness is deploy/k8s/nats.yaml's probe run inside each host. Drills cut packets with
nft: the meta leader cut off from its peers (a minority that its clients still reach), a
one-way cut, flapping; each healed. The lab is shared by the drills of this module and leaves
no namespace, link, rule or hosts file behind."""

from __future__ import annotations

import os
import sys
import time

import pytest

from gpusched.lab import netns
from gpusched.lab.cluster import NatsCluster, make_secrets

pytestmark = pytest.mark.skipif(bool(netns.available()), reason=netns.available() or "lab available")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    work = tmp_path_factory.mktemp("lab")
    lab = netns.Lab().up()
    cluster = NatsCluster(lab, work, make_secrets(work / "secrets", ["gpu01"]))
    try:
        cluster.add_hosts()
        lab.add_host("client")
        lab.write_hosts()
        cluster.start_all()
        cluster.formed_s = cluster.wait(lambda: all(cluster.ready(n) for n in cluster.names), 30)
        yield cluster
    finally:
        cluster.stop()
        lab.down()
    assert not [ns for ns in netns.namespaces() if ns.startswith(f"{netns.PREFIX}{lab.tag}-")]
    assert not list(netns.NETNS_ETC.glob(f"{netns.PREFIX}{lab.tag}-*"))


def server_info(lab, host: str, name: str) -> str:
    """The INFO line a NATS server sends a new TCP connection, fetched from inside `host`."""
    code = (f"import socket; s = socket.create_connection(({name!r}, 4222), 3); s.settimeout(3); "
            "print(s.recv(4096).decode())")
    done = lab.lab.run(host, [sys.executable, "-c", code], timeout=10)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_deployed_cluster_forms_across_hosts(lab):
    assert lab.formed_s < 30
    leader = lab.meta_leader("nats-0")
    assert leader in lab.names and all(lab.meta_leader(n) == leader for n in lab.names)
    for n in lab.names:
        routes = {r["remote_name"] for r in lab.monitor(n, "/routez")["routes"]}
        assert routes == set(lab.names) - {n}
        assert lab.monitor(n, "/varz")["tls_required"] is True
    # a client host reaches every server by its name, and is told TLS and authentication are required
    for n in lab.names:
        info = server_info(lab, "client", f"{n}.nats")
        assert '"tls_required":true' in info and '"auth_required":true' in info, info
    assert "incompatible key usage" not in "".join(lab.log(n) for n in lab.names)


def test_leader_cut_off_from_its_peers_is_not_ready_and_the_majority_goes_on(lab):
    leader = lab.meta_leader("nats-0")
    others = [n for n in lab.names if n != leader]
    t0 = time.monotonic()
    lab.lab.isolate(leader, others)  # the clients (host `client`) still reach it
    try:
        lab.wait(lambda: lab.meta_leader(others[0]) in others and all(lab.ready(n) for n in others), 40)
        majority_s = time.monotonic() - t0
        lab.wait(lambda: not lab.ready(leader), 40)
        minority_s = time.monotonic() - t0
        assert '"tls_required":true' in server_info(lab, "client", f"{leader}.nats")  # its clients reach it
        assert lab.lab.rules() == 8  # 2 peers x 2 directions x (out + in)
    finally:
        lab.lab.heal()
    healed_s = lab.wait(lambda: all(lab.ready(n) for n in lab.names), 40)
    print(f"\nleader cut: majority ready with a new leader {majority_s:.1f}s, minority not ready {minority_s:.1f}s, "
          f"healed {healed_s:.1f}s")


def test_one_way_cut_and_flapping_heal(lab):
    lab.lab.cut("nats-1", "nats-2", one_way=True)  # nats-1 cannot reach nats-2; nats-2 reaches nats-1
    time.sleep(2)
    lab.lab.heal()
    for _ in range(3):  # flapping: cut and heal every second
        lab.lab.isolate("nats-0")
        time.sleep(1)
        lab.lab.heal()
        time.sleep(1)
    assert lab.lab.rules() == 0
    healed_s = lab.wait(lambda: all(lab.ready(n) for n in lab.names), 40)
    leader = lab.meta_leader("nats-0")
    assert leader and all(lab.meta_leader(n) == leader for n in lab.names)
    print(f"\none-way cut + flapping: all ready {healed_s:.1f}s after the last heal")


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
