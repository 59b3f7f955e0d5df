"""Issue 9 against live services: the 1 MB submit that made the server close admission's
connection (161 later commands went unanswered), hostile specs that were admitted and stuck in
`starting`, and a service that must end (to be restarted) rather than stay deaf."""

from __future__ import annotations

import asyncio
import json
import signal
import time

from gpusched.bus import subjects
from gpusched.core import limits as L

from .harness import harness  # noqa: F401

RUN = {"team": "a", "gpus": 1, "command": ["python", "train.py"]}


async def _send(h, subject: str, body: dict | bytes) -> dict:
    data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
    return json.loads(await h.client.request_raw(subject, data, timeout=10))


async def test_one_megabyte_submit_is_refused_and_admission_keeps_answering(harness):
    h = harness
    h.start("admission")
    await h.ready("admission")
    before = await h.log.last_seq()
    # Just under the server's max_payload as a message: the event with headers would exceed it.
    blob = "x" * (h.log.nc.max_payload - 4096)
    big = await _send(h, subjects.CMD_SUBMIT, {"type": "SubmitJob", "request_id": "big", "spec": {**RUN, "name": blob}})
    assert big["ok"] is False and "bytes; at most" in big["error"]
    env = {f"K{i}": "v" * L.MAX_ENV_VALUE_CHARS for i in range(100)}  # each entry valid, the sum not
    many = await _send(h, subjects.CMD_SUBMIT, {"type": "SubmitJob", "request_id": "many", "spec": {**RUN, "env": env}})
    assert many["ok"] is False and "bytes" in many["error"]
    # ... and the next 20 commands are all answered: admission is not deaf.
    for i in range(20):
        reply = await _send(h, subjects.CMD_SUBMIT, {"type": "SubmitJob", "request_id": f"ok{i}", "spec": RUN})
        assert reply["ok"] is True, reply
    assert h.procs["admission"].poll() is None
    await h.sync()
    submitted = [e for s, e in h.records if s > before and e.kind == "JobSubmitted"]
    assert len(submitted) == 20


async def test_hostile_specs_from_the_issue_are_refused_live(harness):
    h = harness
    h.start("admission")
    await h.ready("admission")
    before = await h.log.last_seq()
    hostile = {
        "nul-arg": {**RUN, "command": ["python", "a\x00b"]},
        "eq-key": {**RUN, "env": {"A=B": "1"}},
        "nul-value": {**RUN, "env": {"A": "1\x002"}},
        "sim-abc": {**RUN, "env": {"GPUSCHED_SIM_DURATION_S": "abc"}},
        "ckpt-proc": {**RUN, "checkpoint_dir": "/proc/self"},
        "tiny-limit": {**RUN, "time_limit_s": 1e-300},
        "huge-limit": {**RUN, "time_limit_s": 1e308},
        "restarts": {**RUN, "max_restarts": 10**18},
        "team-dot": {**RUN, "team": "."},
        "team-dotdot": {**RUN, "team": ".."},
        "team-a.b": {**RUN, "team": "a.b"},
        "team-null": {**RUN, "team": "null"},
    }
    for name, spec in hostile.items():
        reply = await _send(h, subjects.CMD_SUBMIT, {"type": "SubmitJob", "request_id": name, "spec": spec})
        assert reply["ok"] is False and reply["error"].startswith("invalid SubmitJob"), (name, reply)
    for quota in ({"guaranteed": 2**64}, {"weight": 1e-300}):
        reply = await _send(h, subjects.CMD_QUOTA, {"type": "SetTeamQuota", "request_id": "q", "team": "a",
                                                    "quota": quota})
        assert reply["ok"] is False and "$.quota" in reply["error"]
    assert await h.log.last_seq() == before  # nothing appended


async def test_a_service_whose_stream_is_deleted_exits_nonzero(harness):
    """A lost stream used to leave the follower waiting forever; now the process ends with
    code 3 so that its supervisor restarts it (and the restart recreates the stream)."""
    h = harness
    proc = h.start("admission")
    await h.ready("admission")
    await h.log.js.delete_stream(subjects.STREAM)
    deadline = time.monotonic() + 20
    while proc.poll() is None:
        assert time.monotonic() < deadline, "admission stayed up without its stream"
        await asyncio.sleep(0.1)
    assert proc.returncode == 3, h.service_log("admission")[-2000:]
    assert "service_fatal" in h.service_log("admission")
    h.procs.pop("admission")


async def test_sigterm_with_nats_down_ends_the_service(harness, nats_server):
    """With NATS unreachable a drain waits forever: the shell's grace ends the process anyway."""
    h = harness
    proc = h.start("admission")
    await h.ready("admission")
    nats_server.proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while proc.poll() is None:
            assert time.monotonic() < deadline, "admission ignored SIGTERM with NATS down"
            await asyncio.sleep(0.1)
    finally:
        nats_server.proc.send_signal(signal.SIGCONT)
    h.procs.pop("admission")
