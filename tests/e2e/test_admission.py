"""Admission over real NATS: malformed commands get precise errors and change nothing;
well-formed refusals are kept as `JobRejected`; a repeated request id names the same job."""

from __future__ import annotations

import asyncio
import json

import msgspec

from gpusched.bus import subjects
from gpusched.core import events as ev
from gpusched.core.model import JobSpec, TeamQuota

from .harness import harness  # noqa: F401

MALFORMED = {
    "not json": (subjects.CMD_SUBMIT, b"{nope", "malformed JSON"),
    "empty": (subjects.CMD_SUBMIT, b"", "malformed JSON"),
    "zero gpus": (subjects.CMD_SUBMIT, {"request_id": "m1", "spec": {"team": "a", "gpus": 0}},
                  "invalid SubmitJob: Expected `int` >= 1 - at `$.spec.gpus`"),
    "missing team": (subjects.CMD_SUBMIT, {"request_id": "m2", "spec": {"gpus": 2}},
                     "invalid SubmitJob: Object missing required field `team` - at `$.spec`"),
    "bad team name": (subjects.CMD_SUBMIT, {"request_id": "m3", "spec": {"team": "a b", "gpus": 1}},
                      "at `$.spec.team`"),
    "bad priority": (subjects.CMD_SUBMIT, {"request_id": "m4", "spec": {"team": "a", "gpus": 1, "priority": "urgent"}},
                     "Invalid enum value 'urgent' - at `$.spec.priority`"),
    "bad topology level": (subjects.CMD_SUBMIT,
                           {"request_id": "m5", "spec": {"team": "a", "gpus": 1, "topology": {"required": "row"}}},
                           "at `$.spec.topology.required`"),
    "unknown field": (subjects.CMD_SUBMIT, {"request_id": "m6", "spec": {"team": "a", "gpus": 1, "colour": "red"}},
                      "Object contains unknown field `colour` - at `$.spec`"),
    "no request id": (subjects.CMD_SUBMIT, {"spec": {"team": "a", "gpus": 1}}, "missing required field `request_id`"),
    "wrong type tag": (subjects.CMD_SUBMIT, {"type": "CancelJob", "request_id": "m7", "job_id": "j-1"},
                       "Invalid value 'CancelJob' - at `$.type`"),
    "negative limit": (subjects.CMD_QUOTA, {"request_id": "m8", "team": "a", "quota": {"limit": -1}},
                       "at `$.quota.limit`"),
    "zero weight": (subjects.CMD_QUOTA, {"request_id": "m9", "team": "a", "quota": {"weight": 0}},
                    "at `$.quota.weight`"),
    "drain without node": (subjects.CMD_DRAIN, {"request_id": "m10"}, "missing required field `node`"),
    "unknown subject": ("gpusched.cmd.reboot", {"request_id": "m11"}, "unknown command subject"),
}


async def test_malformed_commands_are_refused_precisely_and_change_nothing(harness):
    h = harness
    h.start("admission")
    await h.ready("admission")
    await h.nodes(2, 8)
    before = await h.log.last_seq()
    for name, (subject, payload, expected) in MALFORMED.items():
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        reply = json.loads(await h.client.request_raw(subject, data))
        assert reply["ok"] is False, name
        assert expected in reply["error"], f"{name}: {reply['error']}"
    assert await h.log.last_seq() == before  # nothing appended for malformed messages

    # Well-formed but refused: a precise reason, kept for audit as JobRejected, nothing else.
    refusals = {
        "too big for the cluster": (JobSpec(team="a", gpus=17), "the cluster has 16 GPUs; the job needs 17"),
        "min above gang": (JobSpec(team="a", gpus=2, min_gpus=4), "spec.min_gpus (4) exceeds spec.gpus (2)"),
        "nvlink too small": (JobSpec(team="a", gpus=9, topology={"required": "node"}),
                             "the largest node has 8 GPUs; the job needs 9"),
        "preferred wider than required": (JobSpec(team="a", gpus=2, topology={"required": "node", "preferred": "rack"}),
                                          "spec.topology.preferred (rack) is wider than spec.topology.required (node)"),
    }
    for name, (spec, expected) in refusals.items():
        reply = await h.client.submit(msgspec.convert(msgspec.to_builtins(spec), JobSpec))
        assert not reply.ok and expected in reply.error, f"{name}: {reply.error}"
    # limits: a team's hard limit bounds the gang it may ask for
    assert (await h.client.set_quota("capped", TeamQuota(guaranteed=0, limit=2))).ok
    reply = await h.client.submit(JobSpec(team="capped", gpus=4))
    assert reply.error == "team 'capped' has a limit of 2 GPUs; the job needs 4"
    assert not (await h.client.set_quota("a", TeamQuota(guaranteed=5, limit=2))).ok
    assert (await h.client.cancel("j-00000000")).error == "unknown job 'j-00000000'"
    assert (await h.client.drain("node-x")).error == "unknown node 'node-x'"

    state = await h.sync()
    appended = [e for s, e in h.records if s > before]
    assert [e.kind for e in appended] == ["JobRejected"] * 4 + ["TeamQuotaSet", "JobRejected"]
    assert not state.jobs


async def test_submit_is_idempotent_and_cancel_refuses_finished_jobs(harness):
    h = harness
    h.start("admission")
    await h.ready("admission")
    first = await h.client.submit(JobSpec(team="a", gpus=1), request_id="req-1")
    again = await h.client.submit(JobSpec(team="a", gpus=1), request_id="req-1")
    assert first.ok and again.ok and again.duplicate and again.job_id == first.job_id
    assert first.job_id.startswith("j-") and len(first.job_id) == 10
    cancelled = await h.client.cancel(first.job_id)
    assert cancelled.ok
    await h.wait_for("cancel", lambda s: s.jobs.get(first.job_id) and s.jobs[first.job_id].state == "cancelled")
    refused = await h.client.cancel(first.job_id)
    assert not refused.ok and "already cancelled" in refused.error
    # strictness is opt-in: unknown teams are created with default terms
    assert (await h.client.submit(JobSpec(team="new-team", gpus=1))).ok


async def test_strict_teams_refuse_teams_without_quota(harness):
    h = harness
    h.start("admission", strict_teams=True)
    await h.ready("admission")
    reply = await h.client.submit(JobSpec(team="ghost", gpus=1))
    assert not reply.ok and "unknown team 'ghost'" in reply.error
    assert (await h.client.set_quota("ghost", TeamQuota(guaranteed=1))).ok
    await h.wait_for("quota", lambda s: "ghost" in s.teams)
    for _ in range(40):  # admission's fold learns of the quota a moment later
        reply = await h.client.submit(JobSpec(team="ghost", gpus=1))
        if reply.ok:
            break
        await asyncio.sleep(0.05)
    assert reply.ok, reply.error


async def test_fold_settings_are_a_fact_every_fold_reads(harness):  # noqa: F811
    """Admin's `gpusched fold-settings` becomes one `FoldSettingsSet` in the log; the harness's
    own fold (as every service's) applies it, and a fresh replay reads the same."""
    from gpusched.core.model import FoldSettings
    from gpusched.store import fold_log

    harness.start("admission")
    await harness.ready("admission")
    reply = await harness.client.set_fold_settings(FoldSettings(half_life_s=2 * 86400.0, forget_after_s=None),
                                                   reason="e2e")
    assert reply.ok and reply.seq is not None, reply
    await harness.wait_for("the settings folded", lambda s: s.half_life_s == 2 * 86400.0 and s.forget_after_s is None)
    replayed = await fold_log(harness.log)
    assert (replayed.half_life_s, replayed.forget_after_s) == (2 * 86400.0, None)
    assert [e.reason for e in harness.events(ev.FoldSettingsSet)] == ["e2e"]
