"""Entry points of the node daemon: one real node (`run_nodeagent`), many simulated nodes in
one process (`run_simulated_nodes`), and `main(argv)` for `gpusched service run nodeagent`."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from pathlib import Path

import msgspec
import structlog

from gpusched.core.limits import size_mb
from gpusched.core.model import NvlinkLayout, nvlink_domains
from gpusched.core.pools import parse_gpu_types, sim_memory_mb

from .agent_config import AgentConfig, default_work_dir
from .backends import BackendUnavailable, NvmlBackend, SimBackend
from .host import NodeHost
from .topology_source import TopologyUnavailable, from_host, from_kubernetes
from .users import DEFAULT_UID_RANGE, parse_uid_range

log = structlog.get_logger()


def host_address() -> str:
    """This host's address as other nodes reach it (MASTER_ADDR of jobs whose rank 0 is here)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def sim_node_names(count: int, prefix: str = "node") -> list[str]:
    width = max(2, len(str(count - 1)))
    return [f"{prefix}{i:0{width}d}" for i in range(count)]


async def _serve_until(host: NodeHost, stop: asyncio.Event | None, ready: asyncio.Event | None,
                       keep_jobs: bool = False) -> None:
    """Serve a started host until `stop` is set, then stop it (and its jobs, unless
    `keep_jobs`: then the next daemon on the same work dir adopts them)."""
    if ready is not None:
        ready.set()
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await host.stop(kill_jobs=not keep_jobs)


async def run_nodeagent(
    nats_url: str | None = None, *, node: str | None = None, backend: str = "nvml", rack: str = "rack0",
    block: str | None = None, address: str = "", gpus: int = 8, nvlink: NvlinkLayout = "all",
    work_dir: str | os.PathLike | None = None, checkpoint_root: str | os.PathLike | None = None,
    log_dir: str | os.PathLike | None = None, heartbeat_s: float = 5.0, kill_grace_s: float = 10.0,
    stop: asyncio.Event | None = None, ready: asyncio.Event | None = None, job_user: str | None = None,
    team_users: dict[str, str] | None = None, keep_jobs: bool = False, labels: dict[str, str] | None = None,
    confinement: dict | None = None, resources: dict | None = None, mig: bool = False,
) -> None:
    """One node daemon until `stop` is set. `backend="nvml"` reads this host's GPUs (`gpus` and
    `nvlink` only shape a `backend="sim"` node; "auto": NVML if a driver answers, else sim)."""
    node = node or socket.gethostname()
    backend = resolve_backend(backend)
    gpu_backend = NvmlBackend() if backend == "nvml" else SimBackend(node, gpus, nvlink, mig=mig)
    host = await NodeHost.open(nats_url, heartbeat_s=heartbeat_s)
    host.add(AgentConfig(node=node, rack=rack, block=block or None, address=address or host_address(),
                         nvlink=nvlink if backend == "sim" else "custom",
                         work_dir=Path(work_dir) if work_dir else default_work_dir(), kill_grace_s=kill_grace_s,
                         checkpoint_root=Path(checkpoint_root) if checkpoint_root else None,
                         log_dir=Path(log_dir) if log_dir else None, labels=dict(labels or {}),
                         **job_users(job_user, team_users), **(confinement or {}), **(resources or {})),
             gpu_backend)
    await host.start()
    await _serve_until(host, stop, ready, keep_jobs)


async def start_simulated_nodes(
    nats_url: str | None = None, count: int = 4, gpus_per_node: int = 8, nodes_per_rack: int = 4,
    nvlink: NvlinkLayout = "all", *, racks_per_block: int | None = None, prefix: str = "node",
    work_dir: str | os.PathLike | None = None, checkpoint_root: str | os.PathLike | None = None,
    heartbeat_s: float = 2.0, kill_grace_s: float = 5.0, poll_s: float = 0.2, address: str = "127.0.0.1",
    job_user: str | None = None, team_users: dict[str, str] | None = None, labels: dict[str, str] | None = None,
    confinement: dict | None = None, resources: dict | None = None, models: list[str] | None = None,
    mig: bool = False,
) -> NodeHost:
    """Start `count` simulated nodes sharing one connection and one fold; returns the started
    host (call `await host.stop()`). Nodes are `<prefix>00..`, racks `rack00..` of
    `nodes_per_rack` nodes, blocks `block00..` of `racks_per_block` racks when given; `models`:
    each node's GPU model in order (`--gpu-types 2:H100,2:A100`), else the default sim model."""
    nvlink_domains(nvlink, gpus_per_node)  # fail early on a bad layout
    root = Path(work_dir) if work_dir else default_work_dir()
    host = await NodeHost.open(nats_url, heartbeat_s=heartbeat_s, poll_s=poll_s)
    for i, name in enumerate(sim_node_names(count, prefix)):
        rack_i = i // max(1, nodes_per_rack)
        host.add(AgentConfig(node=name, rack=f"rack{rack_i:02d}",
                             block=f"block{rack_i // racks_per_block:02d}" if racks_per_block else None,
                             address=address, nvlink=nvlink, work_dir=root, kill_grace_s=kill_grace_s,
                             checkpoint_root=Path(checkpoint_root) if checkpoint_root else None,
                             labels=dict(labels or {}),
                             **job_users(job_user, team_users), **(confinement or {}), **(resources or {})),
                 SimBackend(name, gpus_per_node, nvlink, mig=mig, **_sim_model(models, i)))
    await host.start()
    return host


def _sim_model(models: list[str] | None, i: int) -> dict:
    """The SimBackend model and memory of the i-th simulated node (its default without models)."""
    if not models:
        return {}
    return {"model": models[i], "memory_mb": sim_memory_mb(models[i])}


async def run_simulated_nodes(
    nats_url: str | None = None, count: int = 4, gpus_per_node: int = 8, nodes_per_rack: int = 4,
    nvlink: NvlinkLayout = "all", *, stop: asyncio.Event | None = None, ready: asyncio.Event | None = None,
    keep_jobs: bool = False, **kwargs,
) -> None:
    """`start_simulated_nodes` until `stop` is set (what `gpusched up` runs)."""
    host = await start_simulated_nodes(nats_url, count, gpus_per_node, nodes_per_rack, nvlink, **kwargs)
    await _serve_until(host, stop, ready, keep_jobs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The daemon's options (`--nats`, `--log-level` come from `shell.common_arguments`)."""
    parser.add_argument("--backend", choices=("auto", "nvml", "sim"), default="auto",
                        help="GPUs through NVML, simulated ones, or auto: NVML when a driver answers, else sim")
    parser.add_argument("--node", default=None, help="node name (default: the host name; sim: the prefix)")
    parser.add_argument("--rack", default="rack0")
    parser.add_argument("--block", default=None)
    parser.add_argument("--address", default="", help="address other nodes reach this one at (MASTER_ADDR)")
    parser.add_argument("--count", type=int, default=1, help="sim: number of simulated nodes in this process")
    parser.add_argument("--gpus", type=int, default=8, help="sim: GPUs per node")
    parser.add_argument("--gpu-types", default=None, metavar="COUNT:MODEL,...",
                        help="sim: each node's GPU model, e.g. 2:H100,2:A100 (sets --count; docs/gpu-pools.md)")
    parser.add_argument("--nvlink", choices=("all", "pairs", "quads", "none"), default="all", help="sim: NVLink layout")
    parser.add_argument("--mig", action="store_true", default=False,
                        help="sim: A100/H100 GPUs in MIG mode, offering their published profiles (docs/gpu-sharing.md#mig-slices)")
    parser.add_argument("--nodes-per-rack", type=int, default=4, help="sim: nodes per rack")
    parser.add_argument("--work-dir", default=None, help="logs, control dirs, default checkpoints "
                        "(default: $GPUSCHED_WORK_DIR or ~/.local/state/gpusched)")
    parser.add_argument("--checkpoint-root", default=None,
                        help="default checkpoint dirs <root>/<job> for jobs without one (a shared file system)")
    parser.add_argument("--log-dir", default=None, help="job logs <log-dir>/<job>/<attempt>-<node>.log")
    parser.add_argument("--job-user", default=None,
                        help="run every job without its own account or team user as this one user (single-tenant "
                             "nodes only: tenants would share its uid; default: a dynamic uid per job)")
    parser.add_argument("--team-user", action="append", default=[], metavar="TEAM=USER",
                        help="run this team's jobs as its service account USER (when the submitter has no account "
                             "here); repeatable")
    parser.add_argument("--uid-range", default=None, metavar="FIRST-LAST",
                        help="dynamic uids for jobs with no account and no team user, one per running job "
                             f"(default when root: {DEFAULT_UID_RANGE[0]}-{sum(DEFAULT_UID_RANGE) - 1}, systemd's "
                             "DynamicUser range; 'none': such jobs run as the daemon's user, never as root)")
    parser.add_argument("--no-submitter-accounts", action="store_true",
                        help="never run a job as the submitter's own account, even when this node has one")
    parser.add_argument("--cgroups", choices=("auto", "on", "off"), default="auto",
                        help="a cgroup per job (limits, GPU device allow-list, kill by cgroup); auto: when root "
                             "on a cgroup v1 or v2 host")
    parser.add_argument("--cgroup-parent", default="gpusched",
                        help="jobs' cgroups are <parent>/<run> (v1: under the daemon's own cgroup of each controller; "
                             "v2: under /sys/fs/cgroup, a delegated cgroup with no processes)")
    parser.add_argument("--job-pids-max", type=int, default=8192, help="at most this many processes per job")
    parser.add_argument("--containers-dir", default=None, metavar="DIR",
                        help="podman's configuration and image storage for --image jobs (default <work-dir>/containers)")
    parser.add_argument("--checkpoint-roots", action="append", default=[], metavar="DIR",
                        help="directories (besides --checkpoint-root) under which a job may name its checkpoint_dir; "
                             "anywhere else is refused (repeatable)")
    parser.add_argument("--keep-jobs", action="store_true",
                        help="on stop, leave job processes running for the next daemon on this work dir to adopt "
                             "(a restart or upgrade that no job notices); default: stop them")
    parser.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                        help="a label this node announces at registration, matched by jobs' --constraint "
                             "(repeatable; an admin's `gpusched label` wins over it)")
    parser.add_argument("--topology-from", choices=("flags", "kubernetes", "host"), default="flags",
                        help="where rack and block come from: --rack/--block, the Kubernetes Node's labels "
                             "(needs `get` on nodes), or the host's LLDP neighbour switch (lldpd)")
    parser.add_argument("--rack-label", default="topology.gpusched.io/rack", help="kubernetes: the Node label naming its rack")
    parser.add_argument("--block-label", default="topology.kubernetes.io/zone",
                        help="kubernetes: the Node label naming its block")
    parser.add_argument("--cpus", type=float, default=None, metavar="N",
                        help="CPUs this node offers jobs (default: the host's; nodes simulated with --count: "
                             "none; 0: not declared, placement does not count CPUs here). Less than the host's "
                             "reserves some for the system")
    parser.add_argument("--mem", default=None, metavar="SIZE",
                        help="memory this node offers jobs, like 256G (default: the host's MemTotal; nodes "
                             "simulated with --count: none; 0: not declared)")
    parser.add_argument("--heartbeat-s", type=float, default=5.0)
    parser.add_argument("--kill-grace-s", type=float, default=10.0)


def job_users(job_user: str | None, team_users: dict[str, str] | None) -> dict:
    """The AgentConfig fields that say which user runs a job."""
    return {"job_user": job_user, "team_users": dict(team_users or {})}


def confinement_from_args(args: argparse.Namespace) -> dict:
    """The AgentConfig fields of `--uid-range`, `--cgroups` and the rest. A root daemon always
    has a uid range unless told 'none', and then warns: its jobs would run as root."""
    try:
        uid_range = parse_uid_range(args.uid_range) if args.uid_range else (
            DEFAULT_UID_RANGE if os.geteuid() == 0 else None)
    except ValueError as err:
        raise SystemExit(f"gpusched nodeagent: --uid-range: {err}") from None
    if uid_range is None and args.job_user is None and os.geteuid() == 0:
        log.warning("jobs_may_run_as_root", hint="jobs without an account or --team-user run as root: "
                                                 "give --uid-range or --job-user")
    return {"uid_range": uid_range, "submitter_accounts": not args.no_submitter_accounts,
            "cgroups": {"auto": None, "on": True, "off": False}[args.cgroups], "cgroup_parent": args.cgroup_parent,
            "pids_max": args.job_pids_max, "checkpoint_roots": tuple(args.checkpoint_roots),
            "containers_dir": Path(args.containers_dir) if args.containers_dir else None}


def host_resources() -> tuple[float | None, int | None]:
    """This host's CPUs (those the daemon may run on) and memory (MemTotal, MiB)."""
    try:
        cpus: float | None = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cpus = float(os.cpu_count() or 0) or None
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return cpus, mem


def resources_from_args(args: argparse.Namespace, one_host: bool) -> dict:
    """The AgentConfig fields `cpus` and `memory_mb` a node registers: `--cpus`/`--mem` (0: not
    declared), else the host's for a daemon that is one node; the nodes one process simulates
    (`--count`, what `gpusched up` runs) share one host, so they declare none unless told."""
    cpus, mem = host_resources() if one_host else (None, None)
    if args.cpus is not None:
        if not 0 <= args.cpus <= 1_000_000:
            raise SystemExit(f"gpusched nodeagent: --cpus {args.cpus:g}: give 0 (not declared) to 1000000")
        cpus = args.cpus or None
    if args.mem is not None:
        try:
            mem = None if args.mem.strip() == "0" else size_mb(args.mem)
        except ValueError:
            raise SystemExit(f"gpusched nodeagent: --mem {args.mem!r} is not a size like 512M or 16G") from None
    return {"cpus": cpus, "memory_mb": mem}


def parse_team_users(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        team, sep, user = item.partition("=")
        if not sep or not team or not user:
            raise SystemExit(f"gpusched nodeagent: --team-user {item!r} is not TEAM=USER")
        out[team] = user
    return out


def parse_labels(items: list[str]) -> dict[str, str]:
    """`--label K=V` items, held to the bounds a `NodeRegistered` has (else it would be refused)."""
    from gpusched.core import limits as L

    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"gpusched nodeagent: --label {item!r} is not KEY=VALUE")
        labels[key] = value
    try:
        return msgspec.convert(labels, L.Labels)
    except msgspec.ValidationError as err:
        raise SystemExit(f"gpusched nodeagent: --label: {err}") from None


def resolve_backend(kind: str) -> str:
    if kind != "auto":
        return kind
    try:
        NvmlBackend().close()
    except BackendUnavailable as err:
        log.warning("nvml_unavailable_using_sim", reason=str(err))
        return "sim"
    return "nvml"


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    args.backend = resolve_backend(args.backend)
    source = getattr(args, "topology_from", "flags")
    if source != "flags":  # kubernetes: one DaemonSet for every node pool; host: bare metal
        topo = await (from_kubernetes(args.node or socket.gethostname(), args.rack_label, args.block_label)
                      if source == "kubernetes" else from_host())
        args.rack, args.block = topo.rack, topo.block or args.block
        log.info("topology_learned", source=source, rack=topo.rack, block=args.block)
    users = {"job_user": args.job_user, "team_users": parse_team_users(args.team_user),
             "labels": parse_labels(args.label), "confinement": confinement_from_args(args),
             "mig": bool(getattr(args, "mig", False))}
    models = parse_gpu_types(args.gpu_types) if getattr(args, "gpu_types", None) else None
    if models:
        args.count = len(models)
    many = args.backend == "sim" and (args.count > 1 or args.node is None)
    users["resources"] = resources_from_args(args, one_host=not many)
    if many:
        users["models"] = models
        await run_simulated_nodes(args.nats, args.count, args.gpus, args.nodes_per_rack, args.nvlink, stop=stop,
                                  prefix=args.node or "node", work_dir=args.work_dir, heartbeat_s=args.heartbeat_s,
                                  checkpoint_root=args.checkpoint_root, **users, keep_jobs=args.keep_jobs,
                                  kill_grace_s=args.kill_grace_s, address=args.address or "127.0.0.1")
    else:
        await run_nodeagent(args.nats, node=args.node, backend=args.backend, rack=args.rack, block=args.block,
                            address=args.address, gpus=args.gpus, nvlink=args.nvlink, work_dir=args.work_dir,
                            checkpoint_root=args.checkpoint_root, log_dir=args.log_dir,
                            heartbeat_s=args.heartbeat_s, kill_grace_s=args.kill_grace_s, stop=stop, **users,
                            keep_jobs=args.keep_jobs)


def main(argv: list[str] | None = None) -> int:
    from gpusched.services.shell import common_arguments, run

    parser = argparse.ArgumentParser(prog="gpusched-nodeagent", description="gpusched node daemon")
    common_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.gpu_types:
        try:
            parse_gpu_types(args.gpu_types)
        except ValueError as err:
            parser.error(f"--gpu-types: {err}")
    try:
        return run(serve, args, "nodeagent")
    except (BackendUnavailable, TopologyUnavailable) as err:
        print(f"gpusched nodeagent: {err}", file=sys.stderr)
        return 2
