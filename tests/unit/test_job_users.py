"""Identity -> Unix user on a node (services/nodeagent/users.py) and `submit --mem` sizes."""

from __future__ import annotations

import pwd

import pytest

from gpusched.cli.commands import memory_mb
from gpusched.services.nodeagent.users import NoJobUser, UserMap, parse_uid_range


def _free(uid: int) -> str | None:
    return None


def test_dynamic_uids_are_per_job_stable_and_never_shared():
    users = UserMap(uid_range=(64000, 8), privileged=True)
    first = users.resolve("", "t", "job-a", _free)
    assert first.how == "dynamic" and 64000 <= first.uid < 64008 and first.gid == first.uid
    assert users.resolve("", "t", "job-a", _free).uid == first.uid  # stable per job
    held = {first.uid: "job-a"}
    other = users.resolve("", "t", "job-b", held.get)
    assert other.uid != first.uid  # another job never gets a held uid
    full = {u: f"j{u}" for u in range(64000, 64008)}
    with pytest.raises(NoJobUser, match="every uid"):
        users.resolve("", "t", "job-c", full.get)


def test_submitter_account_then_team_account_and_never_root():
    root = pwd.getpwuid(0).pw_name
    users = UserMap(team_users={"ml": root}, uid_range=(64000, 8), privileged=True)
    assert users.resolve(root, "x", "j", _free).how == "dynamic"  # uid 0 < 1000: never the submitter's
    with pytest.raises(NoJobUser, match="root"):
        users.resolve("", "ml", "j", _free)
    assert UserMap(privileged=False, uid_range=(64000, 8)).resolve("", "t", "j", _free).how == "daemon"


def test_uid_ranges_and_memory_sizes_parse():
    assert parse_uid_range("61184-65519") == (61184, 4336) and parse_uid_range("none") is None
    for bad in ("0-5", "9-3", "x"):
        with pytest.raises(ValueError):
            parse_uid_range(bad)
    assert [memory_mb(t) for t in ("512", "512M", "16G", "1T", "2048K", "4GiB")] == [512, 512, 16384, 2**20, 2, 4096]
    with pytest.raises(SystemExit):
        memory_mb("lots")
