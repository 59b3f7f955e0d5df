"""Which Unix user runs a job: tenants never share a uid, and no job runs as root.

A root daemon maps the submitting identity to a user the way a site does (first match wins):

1. the submitter's own account, when this node has one with a uid of at least
   `min_account_uid` (Slurm's model: the job runs as the user who asked for it);
2. the team's service account (`--team-user TEAM=USER`);
3. `--job-user USER` (one account for every other job: only for single-tenant nodes);
4. a per-job dynamic uid from `uid_range` (systemd's `DynamicUser`): a uid no account has and
   no other job on this host holds while it runs; stable per job id where it can be, so that a
   requeued attempt finds its own checkpoints.

A daemon that is not root cannot switch users: its jobs run as itself (development, tests); so
does one given none of 2-4 (the node daemon's command line always sets a uid range when root).
"""

from __future__ import annotations

import os
import pwd
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

#: systemd's range for DynamicUser (61184-65519): no distribution allocates accounts there.
DEFAULT_UID_RANGE = (61184, 4336)
#: Accounts below this are system accounts: a submitter named like one ("daemon", "bin") never maps to it.
MIN_ACCOUNT_UID = 1000


class NoJobUser(ValueError):
    """No unprivileged user can be found for a job; the message says why."""


@dataclass(frozen=True)
class JobUser:
    """The identity one job's processes run with on this node."""

    uid: int
    gid: int
    name: str  # the account name, or "gpusched-<uid>" for a dynamic uid
    home: str | None
    how: str  # "account" | "team" | "job-user" | "dynamic" | "daemon"

    @property
    def switch(self) -> bool:
        """The daemon must change credentials to run the job (it is not the daemon's own uid)."""
        return self.uid != os.geteuid()


def daemon_user() -> JobUser:
    pw = _pw(os.geteuid())
    return JobUser(os.geteuid(), os.getegid(), pw.pw_name if pw else str(os.geteuid()), pw.pw_dir if pw else None,
                   "daemon")


def _pw(uid: int):
    try:
        return pwd.getpwuid(uid)
    except KeyError:
        return None


def _account(name: str, how: str) -> JobUser:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise NoJobUser(f"job user {name!r} does not exist on this node") from None
    if pw.pw_uid == 0:
        raise NoJobUser(f"job user {name!r} is root: jobs never run as root")
    return JobUser(pw.pw_uid, pw.pw_gid, pw.pw_name, pw.pw_dir, how)


@dataclass
class UserMap:
    """The node's mapping from (submitter, team, job) to a Unix user (see the module doc)."""

    job_user: str | None = None
    team_users: dict[str, str] = field(default_factory=dict)
    submitter_accounts: bool = True
    min_account_uid: int = MIN_ACCOUNT_UID
    #: (first uid, count) of dynamic uids; None: no dynamic uids (a job without an account fails).
    uid_range: tuple[int, int] | None = None
    #: Whether this daemon may switch users at all (root); tests may force it off.
    privileged: bool = field(default_factory=lambda: os.geteuid() == 0)

    def resolve(self, submitter: str, team: str, job_id: str, taken: Callable[[int], str | None]) -> JobUser:
        """The user job `job_id` runs as. `taken(uid)` names the job holding a dynamic uid on
        this host (None: free)."""
        if not self.privileged:
            return daemon_user()
        if self.submitter_accounts and submitter:
            try:
                pw = pwd.getpwnam(submitter)
            except KeyError:
                pw = None
            if pw is not None and pw.pw_uid >= self.min_account_uid and pw.pw_uid != 65534:
                return JobUser(pw.pw_uid, pw.pw_gid, pw.pw_name, pw.pw_dir, "account")
        if team in self.team_users:
            return _account(self.team_users[team], "team")
        if self.job_user:
            return _account(self.job_user, "job-user")
        if self.uid_range is None:  # nothing configured (an embedded daemon, a test): as before
            return daemon_user()
        return self._dynamic(job_id, taken)

    def _dynamic(self, job_id: str, taken: Callable[[int], str | None]) -> JobUser:
        first, count = self.uid_range  # type: ignore[misc]
        start = zlib.crc32(job_id.encode()) % count
        for k in range(count):
            uid = first + (start + k) % count
            holder = taken(uid)
            if holder not in (None, job_id) or _pw(uid) is not None:
                continue
            return JobUser(uid, uid, f"gpusched-{uid}", None, "dynamic")
        raise NoJobUser(f"every uid of the dynamic range {first}-{first + count - 1} is held by a running job")


def parse_uid_range(text: str) -> tuple[int, int] | None:
    """`FIRST-LAST` (inclusive) -> (first, count); "none" -> None."""
    if text.strip().lower() == "none":
        return None
    first_s, sep, last_s = text.partition("-")
    try:
        first, last = int(first_s), int(last_s)
    except ValueError:
        raise ValueError(f"uid range {text!r} is not FIRST-LAST (or none)") from None
    if not sep or not 0 < first <= last < 2**31 - 1:
        raise ValueError(f"uid range {text!r}: need 0 < FIRST <= LAST")
    return first, last - first + 1


__all__ = ["DEFAULT_UID_RANGE", "JobUser", "NoJobUser", "UserMap", "daemon_user", "parse_uid_range"]
