"""Many nodes silent at once is an outage, not a requeue storm (the reconciler's guard).

A node silent for `node_timeout_s` is lost and its jobs are requeued. But when more than
`partition_share` of all nodes, or more than `partition_rack_share` of one rack (at least
`partition_min_nodes`), went silent within one timeout, what failed is most likely the network
between them and the control plane (a rack switch, a stalled host simulating many nodes), and
their jobs probably still run. Requeueing them would start second copies and count the work
lost. So the reconciler declares the partition instead (`PartitionDeclared`, naming the
nodes): no `NodeLost` for them, their jobs kept, no new work on them. It ends per node when its
heartbeats return (`PartitionEnded`), or when an admin confirms the nodes gone (`gpusched
partition confirm`: `PartitionEnded(lost=True)`, and the fold requeues their jobs then).

Like Kubernetes' node lifecycle controller, which stops evicting pods in a zone whose nodes are
mostly NotReady ("full disruption"). A node counts as silent from `node_timeout_s / 2` without
a heartbeat, so nodes that went quiet together but cross the timeout a tick apart are counted
together; a partition already declared takes in nodes that go silent while it lasts.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gpusched.core import events as ev
from gpusched.core.state import ClusterState


def silent_s(state: ClusterState, obs: Any, name: str, now: float) -> float:
    """How long a node has been silent. A (re-)registration counts as a sign of life: a node that
    just came back is not declared lost again for heartbeats it missed while it was away."""
    return now - max(obs.received.get(name, obs.started_at), state.nodes[name].registered_at)


def _heard_again(obs: Any, name: str, now: float, within: float) -> bool:
    """A heartbeat really arrived lately (not only a reconciler that just started). Declared
    nodes were silent `within` or longer, so a heartbeat this recent came after the declaration."""
    at = obs.received.get(name)
    return at is not None and now - at < within


def _outage(state: ClusterState, silent: set[str], cfg: Any) -> set[str]:
    """The silent nodes that make an outage: all of them when more than the share of the
    cluster's nodes is silent, else those of the racks where more than the rack share is."""
    live = [n for n, node in state.nodes.items() if not node.lost]
    if len(silent) >= cfg.partition_min_nodes and len(silent) > cfg.partition_share * len(live):
        return set(silent)
    racks: dict[str, list[str]] = defaultdict(list)
    for n in live:
        racks[state.nodes[n].rack].append(n)
    out: set[str] = set()
    for members in racks.values():
        quiet = [n for n in members if n in silent]
        if len(quiet) >= cfg.partition_min_nodes and len(quiet) > cfg.partition_rack_share * len(members):
            out.update(quiet)
    return out


def decide(state: ClusterState, obs: Any, now: float, cfg: Any, out: Any) -> set[str]:
    """Append partition facts to `out.events`; return the nodes held in a partition now (the
    reconciler neither loses them nor requeues their jobs)."""
    held = {n for n, node in state.nodes.items() if node.partitioned and not node.lost}
    suspect_s = cfg.node_timeout_s / 2
    back = sorted(n for n in held if _heard_again(obs, n, now, suspect_s))
    if back:
        out.events.append(ev.PartitionEnded(at=now, nodes=back, reason="heartbeats returned"))
    held -= set(back)
    silent = {n for n, node in state.nodes.items()
              if not node.lost and n not in held and n not in back and silent_s(state, obs, n, now) >= suspect_s}
    if not any(silent_s(state, obs, n, now) >= cfg.node_timeout_s for n in silent):
        return held
    group = silent if held else _outage(state, silent, cfg)
    if group:
        live = sum(1 for node in state.nodes.values() if not node.lost)
        out.events.append(ev.PartitionDeclared(
            at=now, nodes=sorted(group),
            reason=f"{len(group) + len(held)} of {live} nodes silent within {cfg.node_timeout_s:g}s: "
                   "an outage between them and the control plane; their jobs are kept, not requeued"))
    return held | group
