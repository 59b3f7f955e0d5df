"""Start a job's process for one attempt on one node, and stop it.

One launcher process per node and attempt (the torchrun model): `RANK` is the node's rank in
the job (nodes ordered as the grant lists their GPUs), `WORLD_SIZE` the number of nodes,
`LOCAL_RANK` 0; the process may itself be `torchrun --nnodes=$WORLD_SIZE --node_rank=$RANK
--nproc_per_node=$GPUSCHED_NPROC_PER_NODE ...`. `CUDA_VISIBLE_DEVICES` holds the GPUs' indices
with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, the order NVML numbers them in (the UUIDs are in
`GPUSCHED_GPU_UUIDS`). The process leads its own session, so that stopping it stops every
process it started. A job with an empty command gets a placeholder that holds its GPUs
without any OS process (simulated clusters).

The command runs under a small `sh` that writes its exit status to a file in the control
directory, so that a restarted daemon (which is not the parent) still learns how an adopted
process ended. The job runs in its working directory as its configured user, with a clean
environment (`ENV_ALLOW`), and its control, log and checkpoint directories are 0700 and its own.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

from gpusched.core.mig import slice_uuid
from gpusched.job import env as E
from gpusched.readmodel import attempt_text

from . import container, secrets
from .backends import VIRTUAL_PID_BASE
from .cgroups import JobCgroup
from .procs import JobGroup

#: Variables of the daemon's environment a job inherits (names, or prefixes ending in `_`);
#: everything else is dropped. HOME, USER and LOGNAME are the job user's. The node's tuning of
#: the numeric libraries (threads, the BLAS kernel: `OPENBLAS_CORETYPE` changes a job's last
#: bits) passes, so a job computes what the same program computes in the node's shell.
ENV_ALLOW = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "LD_LIBRARY_PATH", "PYTHONPATH",
             "LC_", "CUDA_", "NCCL_", "NVIDIA_", "OMP_", "OPENBLAS_", "MKL_", "GOTO_")
#: The exit status of the job's command, written by the wrapper (control dir).
EXIT_FILE = "exit-status"
#: Exit code reported when an adopted process ended while no daemon watched and left no status.
UNKNOWN_EXIT = -1
_WRAPPER = ('trap : TERM INT HUP; "$@"; rc=$?; '
            'printf "%s\\n" "$rc" > "$GPUSCHED_CONTROL_DIR/.exit-status.tmp" && '
            'mv -f "$GPUSCHED_CONTROL_DIR/.exit-status.tmp" "$GPUSCHED_CONTROL_DIR/exit-status"; exit $rc')
#: The same for a container run, as root outside the container: the status goes to a file of the
#: daemon's own (named first), never into the job's directory, where the job could plant a link.
_CONTAINER_WRAPPER = ('trap : TERM INT HUP; out=$1; shift; "$@"; rc=$?; '
                      'printf "%s\\n" "$rc" > "$out.tmp" && mv -f "$out.tmp" "$out"; exit $rc')
#: Writes its pid into every cgroup.procs file named first (the count, then the files), then runs the rest.
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n - 1)); done; exec "$@"'

#: Placeholder jobs read these from `spec.env`: run this long then exit with this code, and
#: answer a checkpoint request after this delay ("never": do not answer).
SIM_DURATION = "GPUSCHED_SIM_DURATION_S"
SIM_EXIT_CODE = "GPUSCHED_SIM_EXIT_CODE"
SIM_CHECKPOINT = "GPUSCHED_SIM_CHECKPOINT_S"


def master_port(job_id: str, attempt: int) -> int:
    """Deterministic per job and attempt, so that every node computes the same one."""
    return 29500 + zlib.crc32(f"{job_id}:{attempt}".encode()) % 10000


@dataclass(frozen=True)
class Launch:
    job_id: str
    attempt: int
    node: str
    node_rank: int
    num_nodes: int
    gpus: tuple[int, ...]  # local indices
    gpu_ids: tuple[str, ...]
    gpu_uuids: tuple[str, ...]
    master_addr: str
    command: tuple[str, ...]
    env: Mapping[str, str]
    checkpoint_dir: Path
    control_dir: Path
    log_path: Path
    resume_from: str | None = None
    resume_step: int | None = None
    cwd: str | None = None
    generation: int = 0
    checkpoint_mode: str = "rank0"
    user: str | None = None  # run as this user (None: the daemon's own)
    resume_sha256: str = ""
    #: The checkpoint before `resume_from` (path, step, sha256): the SDK's fallback.
    resume_previous: tuple[str, int, str] | None = None
    #: Variable -> file on this node (`spec.secret_env`): read at launch, never logged.
    secret_env: Mapping[str, str] = field(default_factory=dict)
    uid: int | None = None  # the job's credentials (users.UserMap); None: the daemon's own
    gid: int | None = None
    home: str | None = None
    cgroup: dict | None = None  # cgroups.JobCgroup.to_json() of the run, if it has one
    devices: tuple[str, ...] = ()  # device nodes of its GPUs
    #: Where the daemon may create and chown a checkpoint dir: nowhere else.
    checkpoint_roots: tuple[str, ...] = ()
    image: str | None = None  # spec.image: the run is a podman container (`container`)
    containers_dir: str | None = None  # podman's configuration and storage for this daemon
    #: A fractional job's share of its one GPU and that GPU's memory (MiB): the MPS limits.
    gpu_share: float | None = None
    gpu_memory_mb: int = 0
    #: A MIG job's slices of its one GPU (indices into its geometry) and their MIG device UUIDs:
    #: CUDA sees only them (`CUDA_VISIBLE_DEVICES=MIG-...`), its cgroup opens only their devices.
    mig_slices: tuple[int, ...] = ()
    mig_uuids: tuple[str, ...] = ()

    def to_json(self) -> dict:
        d = asdict(self)
        return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

    @classmethod
    def from_json(cls, d: dict) -> Launch:
        kinds = {f.name: f.type for f in fields(cls)}
        out = {}
        for k, v in d.items():
            if k not in kinds:
                continue
            if k in ("checkpoint_dir", "control_dir", "log_path"):
                v = Path(v)
            elif isinstance(v, list):
                v = tuple(v)
            out[k] = v
        return cls(**out)


def share_of(job, gpu_memory_mb: list[int]) -> dict:
    """The Launch fields of a fractional job (none for a whole-GPU job)."""
    if not job.spec.shared or not job.gpus:
        return {}
    return {"gpu_share": job.share, "gpu_memory_mb": gpu_memory_mb[0] if gpu_memory_mb else 0}


def slices_of(job, state) -> dict:
    """The Launch fields of a MIG job: its slices and their MIG UUIDs (none for other jobs)."""
    if not job.spec.sliced or not job.gpus or job.gpus[0] not in state.gpus:
        return {}
    uuid = state.gpus[job.gpus[0]].uuid
    return {"mig_slices": tuple(job.slices), "mig_uuids": tuple(slice_uuid(uuid, s) for s in job.slices)}


def share_env(launch: Launch) -> dict[str, str]:
    """A fractional job's CUDA MPS limits (docs/gpu-sharing.md): its share of the GPU's memory
    (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, device 0 of its CUDA_VISIBLE_DEVICES) and of its SMs
    (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`). Soft isolation: MPS enforces them where an MPS
    control daemon serves the GPU; a job outside MPS is trusted to read GPUSCHED_GPU_MEMORY_MB."""
    if launch.gpu_share is None:
        return {}
    out = {E.GPU_SHARE: f"{launch.gpu_share:g}",
           "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(max(1, min(100, round(launch.gpu_share * 100))))}
    if launch.gpu_memory_mb > 0:
        mb = max(1, int(launch.gpu_share * launch.gpu_memory_mb))
        out[E.GPU_MEMORY_MB] = str(mb)
        out["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={mb}M"
    return out


def allowed(name: str) -> bool:
    return any(name == a or (a.endswith("_") and name.startswith(a)) for a in ENV_ALLOW)


def job_env(launch: Launch, base: Mapping[str, str]) -> dict[str, str]:
    """The job's environment: the allowed part of the daemon's, then the spec's, then the
    scheduler's (which win)."""
    out = {k: v for k, v in base.items() if allowed(k) and not k.startswith("GPUSCHED_")}
    out.setdefault("PATH", os.defpath)
    out["PYTHONUNBUFFERED"] = "1"
    home = launch.home if launch.uid is not None else _home(launch.user)
    if launch.uid is not None and home is None:
        home = str(launch.control_dir)  # a dynamic uid has no home: its own control dir
    if home is not None:
        out["HOME"] = home
    if launch.user:
        out["USER"] = out["LOGNAME"] = launch.user
    out.update(launch.env)
    out.update({
        "CUDA_VISIBLE_DEVICES": ",".join(launch.mig_uuids or [str(i) for i in launch.gpus]),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "MASTER_ADDR": launch.master_addr,
        "MASTER_PORT": str(master_port(launch.job_id, launch.attempt)),
        "WORLD_SIZE": str(launch.num_nodes),
        "RANK": str(launch.node_rank),
        "LOCAL_RANK": "0",
        E.JOB_ID: launch.job_id,
        E.ATTEMPT: str(launch.attempt),
        E.NODE: launch.node,
        E.NODE_RANK: str(launch.node_rank),
        E.NNODES: str(launch.num_nodes),
        E.NPROC_PER_NODE: str(len(launch.gpus)),
        E.GPUS: ",".join(launch.gpu_ids),
        E.GPU_UUIDS: ",".join(launch.gpu_uuids),
        E.CHECKPOINT_DIR: str(launch.checkpoint_dir),
        E.CONTROL_DIR: str(launch.control_dir),
        E.CHECKPOINT_MODE: launch.checkpoint_mode,
        E.GENERATION: str(launch.generation),
        E.GPU_DEVICES: ",".join(launch.devices),
    })
    out.update(share_env(launch))
    if launch.mig_slices:
        out[E.MIG_SLICES] = ",".join(map(str, launch.mig_slices))
    if launch.resume_from:
        out[E.RESUME_FROM] = launch.resume_from
        if launch.resume_step is not None:
            out[E.RESUME_STEP] = str(launch.resume_step)
        out[E.RESUME_SHA256] = launch.resume_sha256
        if launch.resume_previous is not None:
            out[E.RESUME_PREVIOUS], step, out[E.RESUME_PREVIOUS_SHA256] = launch.resume_previous
            out[E.RESUME_PREVIOUS_STEP] = str(step)
    return out


def _home(user: str | None) -> str | None:
    try:
        return pwd.getpwnam(user).pw_dir if user else pwd.getpwuid(os.getuid()).pw_dir
    except (KeyError, OSError):
        return None


def _ids(launch: Launch) -> tuple[int, int] | None:
    """(uid, gid) to switch to, or None to run as the daemon's own user."""
    if launch.uid is not None:
        ids = (launch.uid, launch.gid if launch.gid is not None else launch.uid)
    elif launch.user:
        pw = pwd.getpwnam(launch.user)
        ids = (pw.pw_uid, pw.pw_gid)
    else:
        return None
    return None if ids[0] == os.geteuid() else ids


def launch_error(launch: Launch, env: Mapping[str, str]) -> str | None:
    """Why the command cannot start at all (no retry helps), or None."""
    cwd = launch.cwd
    if cwd is not None and not os.path.isdir(cwd):
        return f"working directory {cwd!r} does not exist"
    if launch.user and launch.uid is None:
        try:
            pwd.getpwnam(launch.user)
        except KeyError:
            return f"job user {launch.user!r} does not exist on this node"
    cmd = launch.command[0]
    if "/" in cmd:
        path = Path(cmd) if os.path.isabs(cmd) else Path(cwd or os.getcwd()) / cmd
    else:
        found = shutil.which(cmd, path=env.get("PATH", os.defpath))
        if found is None:
            return f"command {cmd!r} not found in PATH {env.get('PATH', os.defpath)!r}"
        path = Path(found)
    if not path.exists():
        return f"command {cmd!r} not found ({path} does not exist)"
    if path.is_dir():
        return f"command {cmd!r} is a directory"
    if not path.stat().st_mode & 0o111 or not os.access(path, os.X_OK):
        return f"command {cmd!r} is not executable"
    return None


def exit_status_file(launch: Launch) -> Path:
    """Where the wrapper writes the exit status: the control dir (the wrapper runs as the job's
    user), or beside the log for a container run (its wrapper runs as root)."""
    if launch.image:
        return launch.log_path.with_name(launch.log_path.name + ".exit")
    return launch.control_dir / EXIT_FILE


def read_exit_status(control: Path, name: str = EXIT_FILE) -> int:
    """The wrapper's exit status file: a job-writable directory, so a few bytes of a regular
    file only, never through a symlink."""
    fd = os.open(control / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if (os.fstat(fd).st_mode & 0o170000) != 0o100000:
            raise ValueError("not a regular file")
        return int(os.read(fd, 32).strip())
    finally:
        os.close(fd)


def _open_log(path: Path) -> int:
    """The job's log, appended to by the daemon: never through a symlink or a hard link the
    job's user may have planted in its log directory."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    st = os.fstat(fd)
    if (st.st_mode & 0o170000) != 0o100000 or st.st_nlink != 1:
        os.close(fd)
        raise OSError(f"{path} is not a plain file")
    return fd


def own_dir(path: Path, ids: tuple[int, int] | None) -> None:
    """Make `path` a 0700 directory of the job's user (its parents the daemon's, traversable)."""
    if path.is_symlink():
        raise OSError(f"{path} is a symlink")
    for parent in reversed(path.parents):
        if not parent.exists():
            parent.mkdir(mode=0o711)
    path.mkdir(exist_ok=True)
    os.chmod(path, 0o700)
    if ids is not None:
        os.chown(path, *ids)


def daemon_dir(path: Path) -> None:
    """A 0700 directory of the daemon's own (the job's log directory: the daemon writes it)."""
    if path.is_symlink():
        raise OSError(f"{path} is a symlink")
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def under(path: str | os.PathLike, roots: Sequence[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in map(os.path.realpath, roots))


def prepare_checkpoint_dir(launch: Launch, ids: tuple[int, int] | None) -> None:
    """Create the job's checkpoint dir, 0700 and its own; only under the node's checkpoint
    roots (OSError elsewhere: the daemon never creates or chowns a path outside them). Entries a
    previous attempt left under another dynamic uid are handed over (never through a link)."""
    path = launch.checkpoint_dir
    if launch.checkpoint_roots and not under(path, launch.checkpoint_roots):
        raise OSError(f"checkpoint_dir {path} is outside this node's checkpoint roots "
                      f"({', '.join(launch.checkpoint_roots)}): the node creates and hands over directories only "
                      "there")
    existed = path.exists()
    own_dir(path, ids)
    if ids is None or not existed:
        return
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            entry = os.path.join(top, name)
            st = os.lstat(entry)
            if st.st_uid != ids[0] and (stat.S_ISDIR(st.st_mode) or st.st_nlink == 1):
                os.lchown(entry, *ids)


def unreachable(path: Path, uid: int, gids: set[int]) -> str | None:
    """The first existing ancestor of `path` (or itself) that `uid` may not enter, described."""
    for p in [*reversed(Path(path).parents), Path(path)]:
        try:
            st = os.stat(p)
        except OSError:
            return None  # created by the daemon, with the job's access
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid in gids else 0o001
        if not st.st_mode & bit:
            return f"{p} (mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}, gid {st.st_gid})"
    return None


def job_groups(launch: Launch, ids: tuple[int, int]) -> set[int]:
    try:
        return set(os.getgrouplist(launch.user, ids[1])) if launch.user and launch.home is not None else {ids[1]}
    except (KeyError, OSError):
        return {ids[1]}


def reach_error(launch: Launch, ids: tuple[int, int] | None) -> str | None:
    """Why the job's user cannot reach its working, control or checkpoint directory (precise)."""
    if ids is None:
        return None
    gids = job_groups(launch, ids)
    for what, path in (("working directory", launch.cwd), ("control directory", launch.control_dir),
                       ("checkpoint directory", launch.checkpoint_dir)):
        if path is None:
            continue
        blocked = unreachable(Path(path), ids[0], gids)
        if blocked:
            return f"the job's user (uid {ids[0]}) cannot reach its {what} {path}: {blocked}"
    return None


#: The job's own /proc: a mount namespace of its own (a slave of the host's, so mounts the host
#: makes later still reach the job) with procfs mounted `hidepid=2`, so that the job sees only
#: its own uid's processes: no other tenant's command line, environment or pid. The job stays in
#: the host's pid namespace, so its pids, the SDK's `sdk-<pid>` signalling and the daemon's
#: signals are unchanged. A mount that fails leaves the host's /proc, saying so in the job's log.
_HIDE_PROC = ('mount -t proc -o hidepid=2 proc /proc || '
              'echo "--- gpusched: /proc is not hidden from this job (mount failed)" >&2; exec "$@"')


@functools.cache
def proc_hidable() -> bool:
    """Root, Linux >= 5.8 (each procfs mount has its own options there: on older kernels
    `hidepid` on a new mount would apply to the host's /proc as well), and a mount namespace this
    daemon may make (tried once: a container without CAP_SYS_ADMIN may not)."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    if os.geteuid() != 0 or (major, minor) < (5, 8) or shutil.which("unshare") is None:
        return False
    try:
        probe = ["unshare", "--mount", "--propagation", "slave", "--", "true"]
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def command_argv(launch: Launch, ids: tuple[int, int] | None, env_fd: int = -1) -> list[str]:
    """The job's argv: join its cgroup (as root, before anything of the job runs), its own /proc
    (`_HIDE_PROC`, for a job of another uid), drop to the job's credentials (`setpriv`, no new
    privileges), then the exit-status wrapper. A container run's wrapper runs podman as root:
    podman itself switches to the job's uid (`--user`), and the container has its own /proc."""
    argv = ["/bin/sh", "-c", _WRAPPER, "gpusched-job", *launch.command]
    if launch.image:
        argv = ["/bin/sh", "-c", _CONTAINER_WRAPPER, "gpusched-job", str(exit_status_file(launch)),
                *container.run_argv(launch, ids, job_groups(launch, ids) if ids else set(), env_fd)]
    elif ids is not None:
        groups = ["--init-groups"] if launch.user and launch.home is not None else ["--clear-groups"]
        argv = ["setpriv", f"--reuid={ids[0]}", f"--regid={ids[1]}", *groups, "--no-new-privs", "--", *argv]
        if proc_hidable():
            argv = ["unshare", "--mount", "--propagation", "slave", "--", "/bin/sh", "-c", _HIDE_PROC,
                    "gpusched-proc", *argv]
    if launch.cgroup is not None:
        procs = JobCgroup.from_json(launch.cgroup).procs_files
        argv = ["/bin/sh", "-c", _JOIN, "gpusched-join", str(len(procs)), *procs, *argv]
    return argv


def resume_and_secrets(job) -> dict:
    """The Launch fields that come from the fold's job beyond the basics: the checkpoint's
    checksum, the one before it (the SDK's fallback), and the secret files to read."""
    ck, prev = job.checkpoint, job.previous_checkpoint
    return {
        "resume_sha256": ck.sha256 if ck is not None else "",
        "resume_previous": (prev.path, prev.step, prev.sha256) if ck is not None and prev is not None else None,
        "secret_env": dict(job.spec.secret_env),
    }


class JobProcess:
    """A started OS process (the wrapper leading its own session), confined to its group."""

    virtual: Literal[False] = False  # the tag that tells the process kinds apart (`RunProcess`)

    def __init__(self, launch: Launch, base_env: Mapping[str, str]):
        ids = _ids(launch)
        own_dir(launch.control_dir, ids)
        daemon_dir(launch.log_path.parent)
        prepare_checkpoint_dir(launch, ids)
        self.launch = launch
        self.spawn_error: str | None = None
        self.group: JobGroup | None = None
        self.cgroup = JobCgroup.from_json(launch.cgroup) if launch.cgroup is not None else None
        env = job_env(launch, base_env if not launch.image else {})  # the host's PATH is not the image's
        if launch.image and "PATH" not in launch.env:
            del env["PATH"]
        with open(_open_log(launch.log_path), "ab") as out:
            out.write(f"--- gpusched: {launch.job_id} {attempt_text(launch.attempt, launch.generation)} on {launch.node} "
                      f"rank {launch.node_rank}/{launch.num_nodes} gpus {list(launch.gpus)}\n".encode())
            out.flush()
            os.fchmod(out.fileno(), 0o600)
            self.spawn_error = (container.launch_error(launch) if launch.image
                                else launch_error(launch, env) or reach_error(launch, ids))
            if self.spawn_error is None and launch.secret_env:
                try:  # read only what the job's own user may read
                    reader = (ids[0], job_groups(launch, ids)) if ids else (os.geteuid(), set(os.getgroups()))
                    env = {**env, **secrets.read_secret_env(launch.secret_env, reader=reader)}
                except secrets.SecretError as err:
                    self.spawn_error = str(err)
            self.popen: subprocess.Popen | None = None
            if self.spawn_error is None:
                self.popen = self._spawn(launch, ids, env, out)
            if self.spawn_error is not None:
                out.write(f"--- gpusched: launch error: {self.spawn_error}\n".encode())
        self.pid = self.popen.pid if self.popen is not None else 0
        if self.popen is not None:
            self.group = JobGroup.of(self.pid, launch.job_id, launch.attempt, self.cgroup)

    def _spawn(self, launch: Launch, ids: tuple[int, int] | None, env: dict[str, str], out) -> subprocess.Popen | None:
        """Start the wrapper (a container run: podman, its environment in an in-memory file)."""
        fds: tuple[int, ...] = ()
        try:
            if launch.image:  # podman's own environment; the job's goes through the file
                fds = (container.env_file(container.image_env(launch, env)),)
                argv, cwd = command_argv(launch, ids, fds[0]), None
                env = container.configure(Path(str(launch.containers_dir)))
            else:
                argv, cwd = command_argv(launch, ids), launch.cwd
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, cwd=cwd, pass_fds=fds)
        except (OSError, ValueError) as err:
            self.spawn_error = f"cannot start {launch.command[0]!r}: {err}"
            return None
        finally:
            for fd in fds:
                os.close(fd)

    def poll(self) -> int | None:
        if self.popen is None:
            return 127
        return self.popen.poll()

    def signal_group(self, sig: int) -> None:
        if self.popen is None or self.group is None:
            return
        if self.group.cgroup is None and self.popen.poll() is None:  # our unreaped child: its pid (= group id) cannot be reused
            try:
                os.killpg(self.group.pgid, sig)
                return
            except (ProcessLookupError, PermissionError):
                pass
        self.group.signal(sig)

    def signal_pids(self, pids: list[int], sig: int) -> list[int]:
        """Only members of the job's own process group, never another pid a job wrote down."""
        return _signal_pids(self.launch, self.group, pids, sig) if self.group is not None else []

    def kill_stragglers(self) -> None:
        """After the leader exits, nothing it started may outlive it."""
        if self.group is not None:
            self.group.signal(signal.SIGKILL)


class AdoptedProcess:
    """A job process started by an earlier daemon on this node, proven ours by its recorded
    pid, process group, start time and boot id. Its exit status comes from the wrapper's file."""

    virtual: Literal[False] = False
    spawn_error = None

    def __init__(self, launch: Launch, group: JobGroup):
        self.launch = launch
        self.group = group
        self.pid = group.pid

    def poll(self) -> int | None:
        if self.group.leader_alive():
            return None
        try:
            path = exit_status_file(self.launch)
            return read_exit_status(path.parent, path.name)
        except (OSError, ValueError):
            return UNKNOWN_EXIT

    def signal_group(self, sig: int) -> None:
        self.group.signal(sig)

    def signal_pids(self, pids: list[int], sig: int) -> list[int]:
        return _signal_pids(self.launch, self.group, pids, sig)

    def kill_stragglers(self) -> None:
        self.group.signal(signal.SIGKILL)


def _signal_pids(launch: Launch, group: JobGroup, pids: list[int], sig: int) -> list[int]:
    """Signal the pids a job wrote down that are its own; a container's are in its namespace."""
    if launch.image:
        pids = container.host_pids(pids, group.members())
    return group.signal_pids(pids, sig)


_virtual_pids = itertools.count(VIRTUAL_PID_BASE)


class VirtualProcess:
    """A placeholder that holds the job's GPUs without an OS process: exits after
    GPUSCHED_SIM_DURATION_S (if set in the spec's env) with GPUSCHED_SIM_EXIT_CODE (default 0)."""

    virtual: Literal[True] = True
    spawn_error = None

    def __init__(self, launch: Launch, now: float | None = None):
        self.launch = launch
        self.pid = next(_virtual_pids)
        self.started = time.monotonic() if now is None else now
        self.started_wall = time.time() - (time.monotonic() - self.started)
        duration = launch.env.get(SIM_DURATION)
        self.ends_at = self.started + float(duration) if duration else None
        self.exit_code = int(launch.env.get(SIM_EXIT_CODE, "0") or 0)
        self._signalled: int | None = None
        ck = launch.env.get(SIM_CHECKPOINT, "1.0")
        self.checkpoint_after: float | None = None if ck == "never" else float(ck)

    def poll(self) -> int | None:
        if self._signalled is not None:
            return -self._signalled
        if self.ends_at is not None and time.monotonic() >= self.ends_at:
            return self.exit_code
        return None

    def signal_group(self, sig: int) -> None:
        if self._signalled is None and self.poll() is None:
            self._signalled = sig

    def signal_pids(self, pids: list[int], sig: int) -> list[int]:
        return []

    def kill_stragglers(self) -> None:
        pass


def start(launch: Launch, base_env: Mapping[str, str] | None = None) -> JobProcess | VirtualProcess:
    if not launch.command:
        return VirtualProcess(launch)
    return JobProcess(launch, os.environ if base_env is None else base_env)


def adopt(record: dict) -> JobProcess | AdoptedProcess | VirtualProcess | None:
    """Rebuild a run from its state file, or None when it cannot be proven to still run."""
    launch = Launch.from_json(record["launch"])
    if record.get("virtual"):
        started = time.monotonic() - max(0.0, time.time() - float(record["started_wall"]))
        return VirtualProcess(launch, now=started)
    group = JobGroup.from_record(record)
    return AdoptedProcess(launch, group) if group.leader_alive() else None


def record(proc: JobProcess | AdoptedProcess | VirtualProcess) -> dict:
    """What a restarted daemon needs to prove and adopt this run (see `adopt`)."""
    out: dict = {"launch": proc.launch.to_json(), "virtual": proc.virtual}
    if proc.virtual:
        out["started_wall"] = proc.started_wall
    else:
        g = proc.group
        # A JobProcess has no group only when nothing was spawned (`spawn_error`: `JobStarter.start`
        # raises, nothing is recorded) or /proc has no stat for its own unreaped child (never on Linux).
        assert g is not None, "a recorded run's process has a proven group"
        out.update(pid=g.pid, pgid=g.pgid, start_ticks=g.start_ticks, boot=g.boot)
    return out


def stop_recorded(work_dir: Path, grace_s: float = 10.0) -> int:
    """Stop every run whose state file under `work_dir` still proves a live process (SIGTERM,
    SIGKILL after `grace_s`): what `up --fresh` does before it deletes the work dir, since no
    daemon could adopt those runs afterwards. Returns how many runs it stopped."""
    groups = []
    for path in sorted(Path(work_dir, "runs").glob("*/*.json")):
        try:
            proc = adopt(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(proc, AdoptedProcess):
            proc.group.signal(signal.SIGTERM)
            groups.append(proc.group)
    deadline = time.monotonic() + grace_s
    while any(g.alive() for g in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    for group in groups:
        group.signal(signal.SIGKILL)
    return len(groups)


__all__ = ["AdoptedProcess", "Launch", "JobProcess", "VirtualProcess", "adopt", "job_env", "launch_error",
           "master_port", "record", "start", "stop_recorded"]
