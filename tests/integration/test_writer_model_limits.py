"""The writer's last check before an append holds per-model limits (issue 30), on a real
JetStream: a grant decided at one view, re-checked after a compare-and-set conflict against
the fresher fold, is refused there when another writer's grant has meanwhile taken the team to
its per-model limit on that pool."""

from gpusched.bus.log import EventLog
from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec, ModelQuota, TeamQuota
from gpusched.services.placement import PLACEMENT_KINDS
from gpusched.services.runtime import FoldedLog
from gpusched.services.writer import decide_and_append


def _node(name: str, model: str) -> ev.NodeRegistered:
    return ev.NodeRegistered(at=0, node=name, rack="r0",
                             gpus=[GpuInfo(index=i, uuid=f"{name}-{i}", model=model) for i in range(4)])


async def test_a_grant_a_fresher_fold_puts_over_a_per_model_limit_is_not_appended(event_log, nats_url):
    await event_log.append(_node("h0", "NVIDIA H100 80GB HBM3"))
    await event_log.append(_node("a0", "NVIDIA A100-SXM4-80GB"))
    await event_log.append(ev.TeamQuotaSet(at=0, team="a", quota=TeamQuota(models={"H100": ModelQuota(limit=2)})))
    for job, gpu_type in (("j1", "H100"), ("j2", "H100"), ("j3", "A100")):
        await event_log.append(ev.JobSubmitted(at=1, job_id=job, spec=JobSpec(team="a", gpus=2, gpu_type=gpu_type)))
    folded = FoldedLog(await EventLog.open(nats_url, name="placer"))
    await folded.start()
    await folded.catch_up()

    # Another writer's grant of two H100s to j1 lands between this writer's decision and its append.
    append_batch = folded.log.append_batch

    async def racing(*args, **kwargs):
        folded.log.append_batch = append_batch
        await event_log.append(ev.GpusGranted(at=2, job_id="j1", attempt=1, gpus=["h0/0", "h0/1"]))
        return await append_batch(*args, **kwargs)

    folded.log.append_batch = racing  # type: ignore[method-assign]
    decided = [ev.GpusGranted(at=2, job_id="j2", attempt=1, gpus=["h0/2", "h0/3"]),
               ev.GpusGranted(at=2, job_id="j3", attempt=1, gpus=["a0/0", "a0/1"])]
    before = await event_log.last_seq()
    # at its view team a held no H100: both grants were legal when decided
    appended, conflicted = await decide_and_append(folded, lambda state, now: list(decided), PLACEMENT_KINDS,
                                                   rebase=PLACEMENT_KINDS)
    assert (appended, conflicted) == (1, False)  # the conflict was rebased: j3's grant alone landed
    stored = [e async for _, e in event_log.replay(before + 1)]
    assert [(type(e).__name__, e.job_id) for e in stored] == [("GpusGranted", "j1"), ("GpusGranted", "j3")]
    st = folded.state
    assert st.jobs["j2"].state == "pending" and st.teams["a"].pool_held == {"H100": 2, "A100": 2}
    assert st.violations() == []
    await folded.close()
