"""Run a job in an OCI container (`spec.image`): rootful podman with the runc runtime.

The job's processes stay inside its own cgroup: the podman client joins it (the launcher's
`_JOIN`), conmon stays there (`--cgroups no-conmon`), and the container's cgroup is made under it
(`--cgroup-parent <run>`, relative, so under the job's cgroup of every v1 controller it joined:
runc resolves it against its own; in the hierarchies the job has no directory in, cpuset or
blkio, it lands under the daemon's own cgroup, and `remove_run_cgroups` removes it). The job's
memory, CPU, pids and device limits hold for the container as a parent's limits hold for a
child, and kill, signal and adoption by the cgroup see the container's processes. runc adds its own default device rules to every container
(`RUNC_DEVICES`); a v1 child may hold no rule its parent lacks, so an image job's cgroup allows
those too (mknod only, and the tun device every runc container has).

The rest of the confinement is the same as for a job on the host: the job's uid and gid
(`--user`, `users.UserMap`), no capabilities and no new privileges; only the granted GPUs enter,
by CDI name `nvidia.com/gpu=<UUID>` (the name NVIDIA's `nvidia-ctk cdi generate
--device-name-strategy=uuid` gives them); the checkpoint and control directories are bind-mounted
at the same paths; the network is the host's, so ranks on several nodes meet at MASTER_ADDR. A
tiny init (`--init`, catatonit) is the container's pid 1, so the job's command takes SIGTERM as
it does on the host (a pid 1 without a handler would ignore it until the SIGKILL). The environment goes through an in-memory file (`--env-file /dev/fd/N`): never on a command
line, where every local user could read it, and never in podman's own environment.

Podman's configuration is the daemon's own, under `<work>/containers` (`CONTAINERS_CONF`,
`CONTAINERS_STORAGE_CONF` in podman's environment; /etc is not touched). Podman 4.3 reads CDI
specs only from /etc/cdi and /var/run/cdi: the spec for simulated GPUs goes to /var/run/cdi
(the directory for generated specs), one file per node daemon.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from gpusched.core.mig import slice_uuid
from gpusched.job import env as E

from .devices import GpuDevice

if TYPE_CHECKING:
    from .launcher import Launch

PODMAN = "podman"
#: Device rules runc adds to every container (its `AllowedDevices` beyond cgroups.BASE_DEVICES).
RUNC_DEVICES = ("c *:* m", "b *:* m", "c 10:200 rwm")
CDI_DIR = Path("/var/run/cdi")
CDI_KIND = "nvidia.com/gpu"
CDI_PREFIX = "gpusched-"
#: The daemon's own variables podman may see: where to find programs, and how to reach a registry.
ENGINE_ENV = ("PATH", "HOME", "LANG", "TZ", "TMPDIR", "REGISTRY_AUTH_FILE", "HTTP_PROXY", "HTTPS_PROXY",
              "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def available(podman: str = PODMAN) -> bool:
    return shutil.which(podman) is not None


def configure(root: Path) -> dict[str, str]:
    """Write podman's configuration for this daemon under `root` (once); podman's environment.

    runc, not crun (crun refuses a cgroup v1 hybrid host); cgroupfs (the job's cgroup is made
    by the daemon, not systemd); file locks and a private tmp dir, so that daemons with separate
    roots on one host never share podman's lock table; no default ulimits (podman's defaults
    exceed what an unprivileged sandbox may set); no pids limit of its own (the job's cgroup
    holds one)."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    conf, storage = root / "containers.conf", root / "storage.conf"
    wanted = {
        conf: ("[containers]\ndefault_ulimits = []\npids_limit = 0\n\n"
               "[engine]\nruntime = \"runc\"\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"none\"\n"
               f"lock_type = \"file\"\ntmp_dir = \"{root / 'tmp'}\"\n"),
        storage: (f"[storage]\ndriver = \"overlay\"\ngraphroot = \"{root / 'storage'}\"\n"
                  f"runroot = \"{root / 'run'}\"\n"),
    }
    for path, text in wanted.items():
        if not path.exists() or path.read_text() != text:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)
    env = {k: v for k, v in os.environ.items() if k in ENGINE_ENV}
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env.update(CONTAINERS_CONF=str(conf), CONTAINERS_STORAGE_CONF=str(storage))
    return env


def name_of(launch: Launch) -> str:
    """The container's name: one per run (job, attempt, node, launch), so a leftover is found."""
    return _NAME_UNSAFE.sub("_", f"gpusched-{launch.job_id}-{launch.control_dir.name}")[:200]


def image_env(launch: Launch, env: Mapping[str, str]) -> dict[str, str]:
    """The job's environment as seen inside its container: CUDA numbers the GPUs it finds there
    from 0 (only the granted ones are there), and their device nodes are where CDI put them."""
    out = dict(env)
    out["CUDA_VISIBLE_DEVICES"] = ",".join(launch.mig_uuids or [str(k) for k in range(len(launch.gpus))])
    if launch.devices:
        out[E.GPU_DEVICES] = ",".join([f"/dev/nvidia{i}" for i in launch.gpus]
                                      + [_cap_path(i, s) for i in launch.gpus for s in launch.mig_slices])
    return out


def env_file(env: Mapping[str, str]) -> int:
    """An in-memory file holding `env` as podman's --env-file reads it (KEY=VALUE lines); its fd.
    ValueError when a value holds a newline (that format has no way to carry one)."""
    for key, value in env.items():
        if "\n" in value or "\r" in value:
            raise ValueError(f"the environment variable {key} holds a newline, which podman's --env-file "
                             "cannot carry: image jobs need single-line values")
    fd = os.memfd_create("gpusched-env")  # close-on-exec: only the podman it is passed to (pass_fds) gets it
    os.write(fd, "".join(f"{k}={v}\n" for k, v in env.items()).encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def launch_error(launch: Launch) -> str | None:
    """Why the run cannot start in a container at all (no retry helps), or None."""
    if not launch.containers_dir:
        return f"image {launch.image!r}: this node daemon has no podman configuration directory"
    for what, path in (("checkpoint directory", launch.checkpoint_dir), ("control directory", launch.control_dir)):
        if ":" in str(path) or "," in str(path):
            return f"image jobs cannot mount a {what} whose path holds ':' or ',' ({path})"
    if not available():
        return f"image {launch.image!r}: podman is not installed on this node"
    return None


def run_argv(launch: Launch, ids: tuple[int, int] | None, groups: set[int], env_fd: int) -> list[str]:
    """`podman run` for the run: as the job's uid, in its cgroup, with its GPUs and directories."""
    uid, gid = ids if ids is not None else (os.geteuid(), os.getegid())
    argv = [PODMAN, "run", "--rm", "--pull", "missing", "--init", "--name", name_of(launch), "--network", "host",
            "--log-driver", "passthrough", "--security-opt", "no-new-privileges", "--cap-drop", "all",
            "--user", f"{uid}:{gid}", "--env-file", f"/dev/fd/{env_fd}"]
    argv += [x for g in sorted(groups - {gid}) for x in ("--group-add", str(g))]
    if launch.cgroup is not None:
        argv += ["--cgroups", "no-conmon", "--cgroup-parent", name_of(launch)]
    argv += [x for u in (launch.mig_uuids or launch.gpu_uuids) if u for x in ("--device", f"{CDI_KIND}={u}")]
    for path in (launch.checkpoint_dir, launch.control_dir):
        argv += ["--volume", f"{path}:{path}"]
    if launch.cwd:
        argv += ["--workdir", launch.cwd]
    return [*argv, "--", str(launch.image), *launch.command]


def host_pids(ns_pids: list[int], members: list[int]) -> list[int]:
    """The host pids of the job's own processes that its container knows as `ns_pids` (the SDK
    writes `sdk-<pid>` from inside its pid namespace): matched by the innermost `NSpid` of each
    member of the job's cgroup, so a job can name only its own processes."""
    wanted, out = set(ns_pids), []
    for pid in members:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        ns = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if len(ns) > 1 and int(ns[-1]) in wanted:
            out.append(pid)
    return out


#: What podman's own exit codes say (docker's convention; a job exiting with one reads the same).
PODMAN_EXITS = {125: "podman could not run the image (not present and not pulled, or refused): see the job's log",
                126: "the command cannot be run in the image", 127: "the command is not in the image"}


def exit_detail(launch: Launch, rc: int) -> str:
    return f"image {launch.image}: {PODMAN_EXITS[rc]}" if launch.image and rc in PODMAN_EXITS else ""


def remove(engine_env: Mapping[str, str], name: str) -> None:
    """Remove a run's container if one is left (its podman and conmon were killed with the
    job's cgroup); in the background, never waited on."""
    try:
        subprocess.Popen([PODMAN, "rm", "--force", "--ignore", "--time", "0", name], env=dict(engine_env),
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    except OSError:
        pass


def remove_run_cgroups(launch: Launch, root: Path = Path("/sys/fs/cgroup")) -> None:
    """The run's container cgroups in the hierarchies its job's cgroup has no directory in
    (runc made them under the daemon's own cgroup there): remove them, children first, once the
    job's processes are gone (a killed podman leaves them). Only this run's: never a directory
    another run's runc may be filling."""
    name = name_of(launch)
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        _, ctrls, own = line.split(":", 2)
        top = root / (ctrls.split(",")[0].removeprefix("name=") if ctrls else "unified") / own.lstrip("/") / name
        for d, _, _ in sorted(os.walk(top), key=lambda t: -len(t[0])):
            try:
                os.rmdir(d)
            except OSError:
                pass


def _cap_path(gpu: int, s: int) -> str:
    """Where a MIG slice's capability device is inside a container."""
    return f"/dev/nvidia-caps/nvidia-cap{gpu}-{s}"


def _node(path: str, d: GpuDevice) -> dict:
    return {"path": path, "hostPath": d.path, "type": "c", "major": d.major, "minor": d.minor}


def cdi_spec(devices: Mapping[int, GpuDevice], uuids: Mapping[int, str],
             slices: Mapping[tuple[int, int], GpuDevice] = MappingProxyType({})) -> dict:
    """A CDI spec naming each GPU by its UUID, its device node at /dev/nvidia<index> inside the
    container (where NVIDIA's runtime puts it), whatever its path on the host; and each MIG
    slice by its MIG UUID: its parent GPU's node and its own capability device only."""
    whole = [{"name": uuids[i], "containerEdits": {"deviceNodes": [_node(f"/dev/nvidia{i}", d)]}}
             for i, d in sorted(devices.items()) if uuids.get(i)]
    mig = [{"name": slice_uuid(uuids[i], s), "containerEdits": {"deviceNodes": [
        _node(f"/dev/nvidia{i}", devices[i]), _node(_cap_path(i, s), d)]}}
        for (i, s), d in sorted(slices.items()) if uuids.get(i) and i in devices]
    return {"cdiVersion": "0.5.0", "kind": CDI_KIND, "containerEdits": {}, "devices": whole + mig}


def cdi_path(key: str, cdi_dir: Path = CDI_DIR) -> Path:
    """The CDI spec file of the daemon `key` names (its work dir and node)."""
    return cdi_dir / f"{CDI_PREFIX}{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def write_cdi_spec(key: str, devices: Mapping[int, GpuDevice], uuids: Mapping[int, str],
                   cdi_dir: Path = CDI_DIR, slices: Mapping[tuple[int, int], GpuDevice] = MappingProxyType({})) -> Path:
    """Write this daemon's CDI spec (`key`: its work dir and node); drop other gpusched specs
    whose device nodes are all gone (daemons that ended without removing theirs)."""
    cdi_dir.mkdir(parents=True, exist_ok=True)
    for old in cdi_dir.glob(f"{CDI_PREFIX}*.json"):
        try:
            nodes = [n["hostPath"] for d in json.loads(old.read_text())["devices"]
                     for n in d["containerEdits"]["deviceNodes"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not any(os.path.exists(n) for n in nodes):
            old.unlink(missing_ok=True)
    path = cdi_path(key, cdi_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cdi_spec(devices, uuids, slices), indent=1))
    tmp.replace(path)
    return path


__all__ = ["CDI_DIR", "CDI_KIND", "RUNC_DEVICES", "available", "cdi_path", "cdi_spec", "configure", "env_file", "exit_detail", "host_pids", "image_env", "launch_error",
           "name_of", "remove", "remove_run_cgroups", "run_argv", "write_cdi_spec"]
