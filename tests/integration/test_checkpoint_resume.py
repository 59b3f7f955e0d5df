"""Checkpoint, don't restart: a training job preempted twice, through the real node daemon and
the real log, ends with exactly the weights of a run that was never interrupted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from gpusched.core import events as ev
from gpusched.core.model import JobSpec

from .node_helpers import PY, Cluster, reference_weights, train_spec, wait_gone

STEPS = 150


async def preempt(c: Cluster, job_id: str, for_job: str) -> ev.CheckpointSaved:
    """Play the preemptor: ask for a checkpoint, wait for it, release the GPUs."""
    attempt = c.state.jobs[job_id].attempt
    asked = time.time()  # before the append: the job may answer before the append returns
    await c.append(ev.PreemptionRequested(at=asked, job_id=job_id, for_job=for_job, reason="test",
                                          deadline=asked + 10))
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
        await c.wait(lambda s: "starting at step" in (tmp_path / "work" / "logs" / "train" / "1-n0.log").read_text(),
                     "its training loop started")
        await asyncio.sleep(1.0)  # let it train a while
        first = await preempt(c, "train", "urgent")
        assert first.path.startswith(str(ckdir)) and first.step > 0
        # second attempt on the other node: resumes from the first checkpoint
        await c.grant("train", ["n1/2", "n1/3"])
        await c.wait(lambda s: s.jobs["train"].state == "running", "second attempt running")
        await c.wait(lambda s: "starting at step" in (tmp_path / "work" / "logs" / "train" / "2-n1.log").read_text(),
                     "its training loop started")
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


RANKED = """
import json, os, time
ctl, rank = os.environ["GPUSCHED_CONTROL_DIR"], int(os.environ["RANK"])
print("resume", os.environ.get("GPUSCHED_RESUME_STEP"), os.environ.get("GPUSCHED_RESUME_FROM"), flush=True)
done = None
while True:  # the control-dir protocol, no SDK: rank 1 saves slowly
    try:
        req = json.load(open(os.path.join(ctl, "checkpoint-request.json")))["id"]
    except (OSError, ValueError):
        req = None
    if req is not None and req != done:
        time.sleep(1.5 if rank == 1 else 0.0)
        path = os.path.join(os.environ["GPUSCHED_CHECKPOINT_DIR"], "step100-rank%d" % rank)
        open(path, "w").write("weights")
        with open(os.path.join(ctl, ".ack"), "w") as f:
            json.dump({"path": path, "step": 100, "request": req}, f)
        os.replace(os.path.join(ctl, ".ack"), os.path.join(ctl, "ack-100.json"))
        done = req
    time.sleep(0.05)
"""


async def test_collective_checkpoint_waits_for_every_rank(nats_url, tmp_path: Path):
    """A 2-node job with `checkpoint="all"` preempted while rank 1 saves slowly: the checkpoint
    is complete, and the policy releases the job, only once both ranks saved the same step; the
    next attempt resumes each rank from its own file of that step."""
    from gpusched.policy.config import PRESETS
    from gpusched.policy.cycle import cycle

    spec = JobSpec(team="t", gpus=2, preemptible=True, checkpoint="all", checkpoint_dir=str(tmp_path / "ck"),
                   command=[PY, "-c", RANKED])
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["k0", "k1"], gpus=2)
        await c.submit("ranked", spec)
        await c.submit("urgent", JobSpec(team="t", gpus=1))
        await c.grant("ranked", ["k0/0", "k1/0"])
        await c.wait(lambda s: len(s.jobs["ranked"].nodes_started) == 2, "both ranks running")
        asked = time.time()
        await c.append(ev.PreemptionRequested(at=asked, job_id="ranked", for_job="urgent", reason="test",
                                              deadline=asked + 30))
        await c.wait(lambda s: s.jobs["ranked"].partial, "rank 0 saved, rank 1 still saving")
        assert c.state.jobs["ranked"].checkpoint is None  # a partial save is not a checkpoint
        decided = cycle(c.state, time.time(), PRESETS["full"])
        assert not [e for e in decided if isinstance(e, ev.GpusReleased)]  # never released early
        ck = await c.wait(lambda s: s.jobs["ranked"].checkpoint, "both ranks saved")
        assert (ck.step, [Path(p).name for p in ck.paths]) == (100, ["step100-rank0", "step100-rank1"])
        decided = cycle(c.state, time.time(), PRESETS["full"])
        assert [e.reason for e in decided if isinstance(e, ev.GpusReleased)] == ["preempted"]
        await c.append(ev.GpusReleased(at=time.time(), job_id="ranked", reason="preempted"))
        await c.grant("ranked", ["k1/1", "k0/1"])  # ranks swap nodes: rank 1 is now on k0
        job = await c.wait(lambda s: len(s.jobs["ranked"].logs) == 4 and s.jobs["ranked"], "second attempt")
        await c.wait(lambda s: all("resume" in Path(r.path).read_text() for r in job.logs), "both ranks resumed")
        for ref in [r for r in job.logs if r.attempt == 2]:
            assert f"resume 100 {ck.paths[ref.rank]}" in Path(ref.path).read_text()
        await c.append(ev.JobCancelled(at=time.time(), job_id="ranked"))
        state = await c.refold()
        assert state.violations() == []


async def test_preempted_twice_and_resized_once_ends_identical(nats_url, tmp_path: Path):
    """train_numpy.py on 2 nodes (rank 0 saves): preempted twice, then shrunk to one node (a
    resize checkpoints, stops both ranks and restarts one with WORLD_SIZE=1); its final weights
    are byte-identical to an uninterrupted run."""
    ckdir = tmp_path / "ckpt"
    steps = 120
    async with Cluster(nats_url, tmp_path) as c:
        await c.start_nodes(["k0", "k1"], gpus=2, resize_grace_s=10.0)
        await c.submit("train", train_spec(ckdir, steps=steps, every=0, step_time=0.03, gpus=2, min_gpus=1))
        await c.submit("urgent", JobSpec(team="t", gpus=1))
        for gpus in (["k0/0", "k1/0"], ["k1/1", "k0/1"], ["k0/0", "k1/0"]):
            await c.grant("train", gpus)
            await c.wait(lambda s: len(s.jobs["train"].nodes_started) == 2, "both ranks running")
            await c.wait(lambda s: any("starting at step" in Path(r.path).read_text() for r in s.jobs["train"].logs
                                       if r.attempt == s.jobs["train"].attempt and r.rank == 0),
                         "rank 0 training")
            await asyncio.sleep(1.0)
            if c.state.jobs["train"].attempt < 3:
                await preempt(c, "train", "urgent")
        shrink_at = time.time()
        await c.append(ev.JobResized(at=shrink_at, job_id="train", removed=["k1/0"], reason="test shrink"))
        job = await c.wait(lambda s: s.jobs["train"].state in ("completed", "failed") and s.jobs["train"], "done",
                           timeout=60)
        assert job.state == "completed", job.end_reason
        state = await c.refold()
        assert state.violations() == []
        starts = sorted((e.attempt, e.generation, e.rank) for e in c.events(ev.JobStarted, "train"))
        assert starts == [(1, 0, 0), (1, 0, 1), (2, 0, 0), (2, 0, 1), (3, 0, 0), (3, 0, 1), (3, 1, 0)]
        resize_ck = [e for e in c.events(ev.CheckpointSaved, "train") if e.at >= shrink_at]
        assert resize_ck, "the resize restarted without a checkpoint"
        last = [r for r in state.jobs["train"].logs if (r.attempt, r.generation) == (3, 1)]
        assert f"rank 0/1 starting at step {resize_ck[0].step}" in Path(last[0].path).read_text()
    assert (ckdir / "final.npy").read_bytes() == reference_weights(tmp_path, steps)
