from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec


async def test_append_and_replay_roundtrip(event_log):
    e1 = ev.NodeRegistered(at=1.0, node="n0", rack="r0", gpus=[GpuInfo(index=0, uuid="u0")])
    e2 = ev.JobSubmitted(at=2.0, job_id="j1", spec=JobSpec(team="a", gpus=1))
    s1 = await event_log.append(e1)
    s2 = await event_log.append(e2)
    got = [(seq, e) async for seq, e in event_log.replay()]
    assert got == [(s1, e1), (s2, e2)]
