"""Where a node daemon learns its rack and block: from its Kubernetes Node's labels, so that one
DaemonSet serves every node pool (the downward API cannot read node labels; the API can).

    topo = await from_kubernetes("gpu-17", rack_label="topology.gpusched.io/rack")
    topo.rack, topo.block   # from the labels; see `from_labels` for the mapping

It reads `GET /api/v1/nodes/NAME` with the pod's service-account token: the RBAC it needs is
`get` on `nodes` (deploy/helm/gpusched/templates/nodeagent-rbac.yaml), nothing else.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ZONE_LABEL = "topology.kubernetes.io/zone"
RACK_LABEL = "topology.gpusched.io/rack"
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


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


def api_server() -> str:
    """The API server as a pod sees it (the variables every pod gets)."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise TopologyUnavailable("not in a Kubernetes pod (KUBERNETES_SERVICE_HOST unset): use --rack/--block")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


async def node_labels(node: str, api: str | None = None, token_file: Path | None = None,
                      ca_file: Path | None = None, timeout_s: float = 10.0) -> dict[str, str]:
    """The labels of Node `node`, read with the service-account token."""
    api = (api or api_server()).rstrip("/")
    token_file = token_file or SA_DIR / "token"
    ca_file = ca_file if ca_file is not None else SA_DIR / "ca.crt"
    try:
        token = token_file.read_text().strip()
    except OSError as err:
        raise TopologyUnavailable(f"no service-account token ({err}): is automountServiceAccountToken off?") from None
    tls = ssl.create_default_context(cafile=str(ca_file)) if api.startswith("https") else None
    url = f"{api}/api/v1/nodes/{node}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
            async with http.get(url, headers={"Authorization": f"Bearer {token}"}, ssl=tls) as resp:
                if resp.status == 403:
                    raise TopologyUnavailable(f"GET {url}: 403 forbidden: the service account needs `get` on "
                                              "`nodes` (the chart's nodeagent ClusterRole)")
                if resp.status != 200:
                    raise TopologyUnavailable(f"GET {url}: HTTP {resp.status}")
                doc = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        raise TopologyUnavailable(f"GET {url}: {type(err).__name__}: {err}") from None
    labels = (doc.get("metadata") or {}).get("labels") or {}
    return {str(k): str(v) for k, v in labels.items()}


async def from_kubernetes(node: str, rack_label: str = RACK_LABEL, block_label: str = ZONE_LABEL,
                          **api_options) -> Topology:
    return from_labels(await node_labels(node, **api_options), rack_label, block_label)


__all__ = ["Topology", "TopologyUnavailable", "from_labels", "from_kubernetes", "node_labels", "RACK_LABEL",
           "ZONE_LABEL"]
