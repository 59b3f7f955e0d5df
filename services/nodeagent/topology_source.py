"""Where a node daemon learns its rack and block: from its Kubernetes Node's labels, so that one
DaemonSet serves every node pool (the downward API cannot read node labels; the API can).

    topo = await from_kubernetes("gpu-17", rack_label="topology.gpusched.io/rack")
    topo.rack, topo.block   # from the labels; see `from_labels` for the mapping

It reads `GET /api/v1/nodes/NAME` with the pod's service-account token: the RBAC it needs is
`get` on `nodes` (the chart's and deploy/k8s's nodeagent ClusterRole), nothing else.

On bare metal (`from_host`), the rack is the top-of-rack switch the host is cabled to, as LLDP
(lldpd's `lldpctl -f json`) names it: a fact of the host, not a setting to keep in step.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from gpusched.kube import KubeApi, KubeError

ZONE_LABEL = "topology.kubernetes.io/zone"
RACK_LABEL = "topology.gpusched.io/rack"


class TopologyUnavailable(Exception):
    """The node's topology could not be read (the daemon exits with this one line)."""


@dataclass(frozen=True)
class Topology:
    rack: str
    block: str | None


def from_labels(labels: dict[str, str], rack_label: str = RACK_LABEL, block_label: str = ZONE_LABEL,
                default_rack: str = "rack0") -> Topology:
    """The rack is the `rack_label` label; the block is the `block_label` one (the zone). A node
    with no rack label is a rack of its zone's own (block none), and with neither label
    `default_rack`: a coarse topology rather than a refusal to start."""
    rack, block = labels.get(rack_label, "").strip(), labels.get(block_label, "").strip()
    if rack:
        return Topology(rack=rack, block=block or None)
    return Topology(rack=block or default_rack, block=None)


async def node_labels(node: str, api: str | None = None, token_file: Path | None = None,
                      ca_file: Path | None = None, timeout_s: float = 10.0) -> dict[str, str]:
    """The labels of Node `node`, read with the service-account token."""
    try:
        kube = KubeApi(api, token_file, ca_file, timeout_s)
        doc = await kube.call("GET", f"/api/v1/nodes/{node}")
    except KubeError as err:
        if err.status == 403:
            raise TopologyUnavailable(f"{err}: it needs `get` on `nodes` (the chart's nodeagent ClusterRole)") from None
        raise TopologyUnavailable(str(err)) from None
    if doc is None:
        raise TopologyUnavailable(f"GET {kube.api}/api/v1/nodes/{node}: HTTP 404 (no such Node)")
    labels = (doc.get("metadata") or {}).get("labels") or {}
    return {str(k): str(v) for k, v in labels.items()}


async def from_kubernetes(node: str, rack_label: str = RACK_LABEL, block_label: str = ZONE_LABEL,
                          **api_options) -> Topology:
    return from_labels(await node_labels(node, **api_options), rack_label, block_label)


def from_lldp(output: str) -> Topology | None:
    """The rack from `lldpctl -f json`: the neighbour switch's name on the first interface that
    has one (None: no LLDP neighbour)."""
    try:
        interfaces = (json.loads(output).get("lldp") or {}).get("interface") or {}
    except (ValueError, AttributeError):
        return None
    if isinstance(interfaces, dict):  # one interface: an object; several: a list of one-key objects
        interfaces = [interfaces]
    found: dict[str, str] = {}
    for item in interfaces:
        for name, info in (item or {}).items():
            chassis = (info or {}).get("chassis") or {}
            names = [k for k, v in chassis.items() if isinstance(v, dict)] if isinstance(chassis, dict) else []
            if names:
                found.setdefault(name, names[0])
    return Topology(rack=found[min(found)], block=None) if found else None


async def from_host(command: tuple[str, ...] = ("lldpctl", "-f", "json"), timeout_s: float = 10.0) -> Topology:
    """The rack from this host's LLDP neighbour (lldpd must run)."""
    try:
        proc = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except FileNotFoundError:
        raise TopologyUnavailable(f"{command[0]} not found: install lldpd, or give --rack/--block") from None
    except TimeoutError:
        raise TopologyUnavailable(f"{' '.join(command)} did not answer in {timeout_s:g} s") from None
    topo = from_lldp(out.decode(errors="replace")) if proc.returncode == 0 else None
    if topo is None:
        why = err.decode(errors="replace").strip()[:200] or "no LLDP neighbour seen"
        raise TopologyUnavailable(f"{' '.join(command)}: {why}: give --rack/--block")
    return topo


__all__ = ["from_host", "from_lldp", "Topology", "TopologyUnavailable", "from_labels", "from_kubernetes", "node_labels", "RACK_LABEL",
           "ZONE_LABEL"]
