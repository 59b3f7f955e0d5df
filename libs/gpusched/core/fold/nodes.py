"""Nodes and their GPUs: registered (with the CPUs and memory they offer), labeled, drained
or given maintenance windows, partitioned, lost; GPUs quarantined and restored, stray
processes found and reclaimed; and whether placement works at all (degraded, recovered).

Functions of the state (`st`): each changes what may be placed where, so each refreshes the
GPUs it touches (`holdings.refresh`); a lost node ends its fence and requeues its jobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import events as ev
from .. import rules
from ..model import gpu_id
from ..topology import Gpu, Node
from .fence import end_live
from .holdings import refresh
from .jobs import requeue

if TYPE_CHECKING:
    from ..state import ClusterState


def on_registered(st: ClusterState, e: ev.NodeRegistered) -> None:
    """A node registers (`_register`) with the CPUs and memory it offers: a restarted agent may
    offer other amounts (`--cpus`, `--mem`); one that declares none keeps the last."""
    _register(st, e)
    node = st.nodes[e.node]
    if e.cpus or e.memory_mb:
        node.cpus, node.memory_mb = e.cpus, e.memory_mb
        # counted afresh from the jobs holding its GPUs (a state restored from before the count)
        holders = [st.jobs[h] for h in dict.fromkeys(st.gpus[g].holder for g in node.gpus) if h in st.jobs]
        node.cpus_used = round(sum(j.spec.cpus or 0.0 for j in holders), 6)
        node.memory_used_mb = sum(j.spec.memory_mb or 0 for j in holders)


def _register(st: ClusterState, e: ev.NodeRegistered) -> None:
    old = st.nodes.get(e.node)
    st.label_changes += 1
    if old is not None:
        old.registered_at = max(old.registered_at, e.at)
        if e.labels:  # the agent's labels fill in; an admin's `NodeLabeled` keeps winning
            old.labels = {**e.labels, **old.labels}
        if old.lost:
            old.lost = False
            for g in old.gpus:
                refresh(st, g)
        return  # re-registration after a restart keeps what the log already knows
    ids = [gpu_id(e.node, g.index) for g in e.gpus]
    st.nodes[e.node] = Node(e.node, e.rack, e.block, ids, e.address, e.nvlink, e.at, free={},
                            labels=dict(e.labels))
    for gid, info in zip(ids, e.gpus):
        st.gpus[gid] = Gpu(gid, e.node, info.index, info.uuid, info.model, info.memory_mb, info.nvlink_domain,
                           mig=info.mig)
        refresh(st, gid)


def on_labeled(st: ClusterState, e: ev.NodeLabeled) -> None:
    node = st.nodes.get(e.node)
    if node is not None:
        labels = {**node.labels, **e.labels}
        for k in e.remove:
            labels.pop(k, None)
        node.labels = labels
        st.label_changes += 1


def on_lost(st: ClusterState, e: ev.NodeLost) -> None:
    node = st.nodes.get(e.node)
    if node is None:
        return
    node.lost = True
    for job_id in list(st.node_live.get(e.node, {})):  # fenced: the node kills them on return
        end_live(st, st.jobs[job_id], lambda x: x.node == e.node)
    victims: dict[str, None] = {}
    for g in node.gpus:
        for holder in st.gpus[g].holders:
            victims[holder] = None
        refresh(st, g)
    for job_id in victims:
        job = st.jobs[job_id]
        job.lost_gpu_s += rules.work_since_checkpoint(job, e.at)
        requeue(st, job, e.at, f"requeued: node {e.node} lost")


def on_partition(st: ClusterState, e: ev.PartitionDeclared | ev.PartitionEnded) -> None:
    """Declared: the nodes take no new work, their jobs stay. Ended: usable again, or lost."""
    declared = isinstance(e, ev.PartitionDeclared)
    for name in e.nodes:
        node = st.nodes.get(name)
        if node is None or node.lost or node.partitioned == declared:
            continue
        node.partitioned = declared
        for g in node.gpus:
            refresh(st, g)
        if isinstance(e, ev.PartitionEnded) and e.lost:
            on_lost(st, ev.NodeLost(at=e.at, node=name, reason=e.reason))


def on_drained(st: ClusterState, e: ev.NodeDrained) -> None:
    node = st.nodes.get(e.node)
    if node is None:
        return
    if e.until is not None:  # a window: the policy keeps jobs off it by the clock, no event ends it
        kept = [w for w in st.windows.get(e.node, []) if w[1] > e.at]
        st.windows[e.node] = sorted(kept + [(e.at if e.start is None else e.start, e.until)])
        return
    node.drained = e.drain
    if not e.drain:
        st.windows.pop(e.node, None)
    for g in node.gpus:
        refresh(st, g)


def on_quarantined(st: ClusterState, e: ev.GpuQuarantined) -> None:
    if e.gpu in st.gpus:
        st.gpus[e.gpu].quarantined = e.reason
        refresh(st, e.gpu)


def on_restored(st: ClusterState, e: ev.GpuRestored) -> None:
    if e.gpu in st.gpus:
        st.gpus[e.gpu].quarantined = None
        refresh(st, e.gpu)


def on_zombie(st: ClusterState, e: ev.ZombieDetected) -> None:
    if e.gpu in st.gpus:
        st.gpus[e.gpu].zombie_pids = list(e.pids)
        refresh(st, e.gpu)


def on_zombie_reclaimed(st: ClusterState, e: ev.ZombieReclaimed) -> None:
    if e.gpu in st.gpus:
        st.gpus[e.gpu].zombie_pids = None
        refresh(st, e.gpu)


def on_degraded(st: ClusterState, e: ev.PlacementDegraded) -> None:
    st.placement_degraded = True


def on_recovered(st: ClusterState, e: ev.PlacementRecovered) -> None:
    st.placement_degraded = False
