"""After a restart, what the runs an earlier daemon started left: their state files
(`runs.RunRecords`), each run's process if the OS proves it is the one started, else its exit
status from the wrapper's file (`NodeAgent.adopt` decides what becomes of each)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import structlog

from . import launcher
from .launch import remove_confinement
from .runs import RunKey, RunProcess, RunRecords

log = structlog.get_logger()


def recorded_runs(records: RunRecords) -> Iterator[tuple[dict, RunKey, RunProcess | None]]:
    """Each readable state file: its record, its run, and its process if the OS proves it is
    still the one recorded (None: gone, and the file removed). An unreadable file is removed."""
    for path in records.files():
        try:
            rec = json.loads(path.read_text())
            proc = launcher.adopt(rec)
            key = (rec["launch"]["job_id"], int(rec["launch"]["attempt"]), int(rec.get("generation", 0)))
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("run_record_unreadable", file=path.name, error=str(err))
            path.unlink(missing_ok=True)
            continue
        if proc is None:
            path.unlink(missing_ok=True)
        yield rec, key, proc


def reap(rec: dict) -> int:
    """The exit status of a recorded run whose process is gone (`launcher.UNKNOWN_EXIT` if it
    left none); what its dead leader left (control dir, cgroup) is removed."""
    if rec.get("virtual"):
        return launcher.UNKNOWN_EXIT
    launch = launcher.Launch.from_json(rec["launch"])
    status = launcher.exit_status_file(launch)
    try:
        rc = launcher.read_exit_status(status.parent, status.name)
    except (OSError, ValueError):
        rc = launcher.UNKNOWN_EXIT
    shutil.rmtree(rec["launch"]["control_dir"], ignore_errors=True)
    remove_confinement(launch)
    return rc
