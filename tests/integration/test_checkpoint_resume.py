"""Checkpoint, don't restart: a training job preempted twice, through the real node daemon and
the real log, ends with exactly the weights of a run that was never interrupted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gpusched.core import events as ev
from gpusched.core.model import JobSpec

from .node_helpers import Cluster, reference_weights, train_spec, wait_gone

STEPS = 80


async def preempt(c: Cluster, job_id: str, for_job: str) -> ev.CheckpointSaved:
    """Play the preemptor: ask for a checkpoint, wait for it, release the GPUs."""
    attempt = c.state.jobs[job_id].attempt
    await c.append(ev.PreemptionRequested(at=time.time(), job_id=job_id, for_job=for_job, reason="test",
                                          deadline=time.time() + 10))
    asked = time.time()
    ckpt = await c.wait(lambda s: (k := s.jobs[job_id].checkpoint) is not None and k.attempt == attempt
                        and k.at >= asked and k, "checkpoint after the request")
    await c.append(ev.GpusReleased(at=time.time(), job_id=job_id, reason="preempted"))
    return ckpt


async def test_preempted_twice_resumes_to_identical_weights(nats_url, tmp_path: Path):
    ckdir = tmp_path / "ckpt"
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["n0", "n1"], gpus=4)
        await c.submit("train", train_spec(ckdir, steps=STEPS, every=0, step_time=0.03))
        await c.submit("urgent", JobSpec(team="t", gpus=1))  # the job the preemptions serve
        await c.grant("train", ["n0/0", "n0/1"])
        await c.wait(lambda s: s.jobs["train"].state == "running", "first attempt running")
        await asyncio.sleep(1.0)  # let it train a while
        first = await preempt(c, "train", "urgent")
        assert first.path.startswith(str(ckdir)) and first.step > 0
        # second attempt on the other node: resumes from the first checkpoint
        await c.grant("train", ["n1/2", "n1/3"])
        await c.wait(lambda s: s.jobs["train"].state == "running", "second attempt running")
        await asyncio.sleep(0.8)
        second = await preempt(c, "train", "urgent")
        assert second.step > first.step
        await c.grant("train", ["n0/2", "n0/3"])
        job = await c.wait(lambda s: s.jobs["train"].state in ("completed", "failed") and s.jobs["train"], "done",
                           timeout=30)
        assert job.state == "completed", job.end_reason
        assert job.attempt == 3 and job.preemptions == 2
        state = await c.refold()
        assert state.violations() == []
        starts = c.events(ev.JobStarted, "train")
        assert [(e.attempt, e.node) for e in starts] == [(1, "n0"), (2, "n1"), (3, "n0")]
        for e in starts[:2]:
            await wait_gone(e.pids[0], timeout=5)
        log2 = (tmp_path / "work" / "logs" / "train" / "2-n1.log").read_text()
        assert f"starting at step {first.step} (resume_from={first.path})" in log2
        log3 = (tmp_path / "work" / "logs" / "train" / "3-n0.log").read_text()
        assert f"starting at step {second.step}" in log3
    assert (ckdir / "final.npy").read_bytes() == reference_weights(tmp_path, STEPS)
