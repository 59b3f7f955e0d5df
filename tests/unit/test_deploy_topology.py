"""Topology from the nodes: the node daemon reads its Node's labels from the API server (a real
local HTTP server stands in for it, checking the bearer token) and maps them to rack and block."""

from __future__ import annotations

import argparse
import importlib

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpusched.services.nodeagent.topology_source import (
    RACK_LABEL,
    ZONE_LABEL,
    Topology,
    TopologyUnavailable,
    from_host,
    from_kubernetes,
    from_labels,
    from_lldp,
)

TOKEN = "sa-token-topo"
NODES = {
    "gpu-a": {"kubernetes.io/hostname": "gpu-a", ZONE_LABEL: "eu-west-1a", RACK_LABEL: "r12"},
    "gpu-b": {ZONE_LABEL: "eu-west-1b"},
    "gpu-c": {"example.com/rack": "row3-r7", ZONE_LABEL: "dc1"},
    "gpu-d": {},
}


@pytest.fixture
async def api_server(tmp_path):
    """The two things the daemon may do against the API: GET one Node, with its token."""
    seen: list[str] = []

    async def get_node(request: web.Request) -> web.Response:
        seen.append(request.path)
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "code": 403}, status=403)
        name = request.match_info["name"]
        if name not in NODES:
            return web.json_response({"kind": "Status", "code": 404}, status=404)
        return web.json_response({"kind": "Node", "metadata": {"name": name, "labels": NODES[name]}})

    app = web.Application()
    app.router.add_get("/api/v1/nodes/{name}", get_node)
    server = TestServer(app)
    await server.start_server()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    yield {"api": str(server.make_url("")), "token_file": token, "seen": seen}
    await server.close()


def test_label_mapping():
    assert from_labels(NODES["gpu-a"]) == Topology(rack="r12", block="eu-west-1a")
    assert from_labels(NODES["gpu-b"]) == Topology(rack="eu-west-1b", block=None)  # a rack per zone
    assert from_labels(NODES["gpu-c"], rack_label="example.com/rack") == Topology(rack="row3-r7", block="dc1")
    assert from_labels(NODES["gpu-d"], default_rack="rack0") == Topology(rack="rack0", block=None)


async def test_reads_the_nodes_labels_through_the_api(api_server):
    topo = await from_kubernetes("gpu-a", api=api_server["api"], token_file=api_server["token_file"])
    assert topo == Topology(rack="r12", block="eu-west-1a")
    topo = await from_kubernetes("gpu-c", "example.com/rack", api=api_server["api"],
                                 token_file=api_server["token_file"])
    assert topo == Topology(rack="row3-r7", block="dc1")
    assert api_server["seen"] == ["/api/v1/nodes/gpu-a", "/api/v1/nodes/gpu-c"]  # one GET per start, nothing else


async def test_precise_errors(api_server, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("nope")
    with pytest.raises(TopologyUnavailable, match="needs `get` on `nodes`"):
        await from_kubernetes("gpu-a", api=api_server["api"], token_file=wrong)
    with pytest.raises(TopologyUnavailable, match="HTTP 404"):
        await from_kubernetes("gpu-x", api=api_server["api"], token_file=api_server["token_file"])
    with pytest.raises(TopologyUnavailable, match="no service-account token"):
        await from_kubernetes("gpu-a", api=api_server["api"], token_file=tmp_path / "absent")


async def test_outside_a_pod_says_so(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(TopologyUnavailable, match="not in a Kubernetes pod"):
        await from_kubernetes("gpu-a")


def test_the_daemon_takes_the_options():
    parser = argparse.ArgumentParser()
    importlib.import_module("gpusched.services.nodeagent.main").add_arguments(parser)
    args = parser.parse_args(["--topology-from", "kubernetes", "--rack-label", "example.com/rack"])
    assert (args.topology_from, args.rack_label, args.block_label) == ("kubernetes", "example.com/rack", ZONE_LABEL)


LLDP_ONE = '{"lldp": {"interface": {"eth0": {"via": "LLDP", "chassis": {"tor-r12.dc1": {"id": {"type": "mac"}}}}}}}'
LLDP_TWO = ('{"lldp": {"interface": [{"ens2": {"chassis": {"tor-r07b": {"id": {}}}}},'
            ' {"ens1": {"chassis": {"tor-r07a": {"id": {}}}}}]}}')


def test_bare_metal_rack_is_the_lldp_neighbour():
    assert from_lldp(LLDP_ONE) == Topology(rack="tor-r12.dc1", block=None)
    assert from_lldp(LLDP_TWO) == Topology(rack="tor-r07a", block=None)  # the first interface by name
    assert from_lldp('{"lldp": {}}') is None and from_lldp("not json") is None


async def test_from_host_runs_the_command(tmp_path):
    lldpctl = tmp_path / "lldpctl"
    lldpctl.write_text(f"#!/bin/sh\ncat <<'END'\n{LLDP_ONE}\nEND\n")
    lldpctl.chmod(0o755)
    assert await from_host((str(lldpctl),)) == Topology(rack="tor-r12.dc1", block=None)
    with pytest.raises(TopologyUnavailable, match="not found: install lldpd"):
        await from_host((str(tmp_path / "absent"),))
    with pytest.raises(TopologyUnavailable, match="no LLDP neighbour"):
        await from_host(("true",))
