"""A tiny scenario builder for policy tests: a whole small cluster built by applying events."""

from __future__ import annotations

from gpusched.core import events as ev
from gpusched.core.model import GpuInfo, JobSpec, TeamQuota, TopologyConstraint, nvlink_domains
from gpusched.core.state import ClusterState, stale_live
from gpusched.policy.config import PRESETS, PolicyConfig
from gpusched.policy.cycle import cycle

#: `full` with entitlements second by second and a reservation for every blocked head at once (as
#: the preset is; pinned should fairness over a horizon become its default): the mechanisms the older
#: tests pin down (tests/unit/test_policy_horizon.py tests the horizon).
FULL_INSTANT = PRESETS["full"].replace(fair_owed_after_s=None, reserve_after_s=None)


def pinned(name: str) -> PolicyConfig:
    """A preset by name, `full` as `FULL_INSTANT`."""
    return FULL_INSTANT if name == "full" else PRESETS[name]


class Scenario:
    """`Scenario(racks=2, nodes=2, gpus=8)`: racks r0.. of nodes r0n0.., GPUs "r0n0/0".."""

    def __init__(self, racks: int = 1, nodes: int = 2, gpus: int = 8, nvlink: str = "all",
                 blocks: int | None = None, half_life_s: float | None = None) -> None:
        self.state = ClusterState(half_life_s=half_life_s)
        self.now = 0.0
        for r in range(racks):
            block = None if blocks is None else f"b{r % blocks}"
            for n in range(nodes):
                self.node(f"r{r}n{n}", f"r{r}", gpus, nvlink, block)

    def apply(self, *events: ev.Event) -> None:
        for e in events:
            self.state.apply(e)

    def node(self, name: str, rack: str, gpus: int = 8, nvlink: str = "all", block: str | None = None,
             model: str = "unknown") -> None:
        doms = nvlink_domains(nvlink, gpus)
        infos = [GpuInfo(index=i, uuid=f"{name}-{i}", nvlink_domain=doms[i], model=model) for i in range(gpus)]
        self.apply(ev.NodeRegistered(at=self.now, node=name, rack=rack, gpus=infos, block=block, nvlink=nvlink))

    def team(self, name: str, guaranteed: int = 0, weight: float = 1.0, limit: int | None = None) -> None:
        self.apply(ev.TeamQuotaSet(at=self.now, team=name, quota=TeamQuota(guaranteed=guaranteed, weight=weight,
                                                                          limit=limit)))

    def submit(self, job_id: str, gpus: int = 1, team: str = "a", at: float | None = None,
               required: str = "cluster", **spec) -> None:
        at = self.now if at is None else at
        self.now = max(self.now, at)
        topo = TopologyConstraint(required=required)
        self.apply(ev.JobSubmitted(at=at, job_id=job_id, spec=JobSpec(team=team, gpus=gpus, topology=topo, **spec)))

    def run(self, job_id: str, gpus: list[str], at: float | None = None, backfill: bool = False,
            **spec) -> None:
        """Submit (if new) and start a job on exactly these GPUs."""
        at = self.now if at is None else at
        if job_id not in self.state.jobs:
            self.submit(job_id, gpus=spec.pop("size", len(gpus)), at=at, **spec)
        job = self.state.jobs[job_id]
        self.apply(ev.GpusGranted(at=at, job_id=job_id, attempt=job.attempt + 1, gpus=gpus,
                                  level=self.state.span(gpus), backfill=backfill))
        for x in stale_live(job):  # the earlier attempt's processes are gone (the fence)
            self.apply(ev.ProcessesEnded(at=at, job_id=job_id, attempt=x.attempt, node=x.node, generation=x.generation))
        for node in dict.fromkeys(g.split("/")[0] for g in gpus):
            self.apply(ev.JobStarted(at=at, job_id=job_id, attempt=job.attempt, node=node))

    def preempt(self, job_id: str, for_job: str, at: float) -> None:
        """A past preemption of a running job for `for_job`: asked and released at `at`."""
        self.apply(ev.PreemptionRequested(at=at, job_id=job_id, for_job=for_job, reason=f"preempted for {for_job}",
                                          deadline=at),
                   ev.GpusReleased(at=at, job_id=job_id, reason="preempted"))

    def checkpoint(self, job_id: str, at: float) -> None:
        job = self.state.jobs[job_id]
        self.apply(ev.CheckpointSaved(at=at, job_id=job_id, attempt=job.attempt, path="ck", step=1))

    def finish(self, job_id: str, at: float) -> None:
        job = self.state.jobs[job_id]
        self.apply(ev.JobCompleted(at=at, job_id=job_id, attempt=job.attempt))

    def cycle(self, config: PolicyConfig | str = "full", now: float | None = None) -> list[ev.Event]:
        """Run one cycle, apply its events, and return them."""
        if isinstance(config, str):
            config = PRESETS[config]
        now = self.now if now is None else now
        self.now = max(self.now, now)
        out = cycle(self.state, now, config)
        self.apply(*out)
        return out


def gpus(node: str, *idx: int) -> list[str]:
    return [f"{node}/{i}" for i in idx]


def grants(events) -> dict[str, list[str]]:
    return {e.job_id: e.gpus for e in events if isinstance(e, ev.GpusGranted)}


def kinds(events) -> list[str]:
    return [type(e).__name__ for e in events]


def submit_one(st: ClusterState, job_id: str, at: float = 1.0, team: str = "a", **spec) -> None:
    """A one-GPU job (unless `spec` says otherwise) submitted straight into the fold."""
    st.apply(ev.JobSubmitted(at=at, job_id=job_id, spec=JobSpec(**{"team": team, "gpus": 1, **spec})))


def run_full_cycle(st: ClusterState, now: float) -> list[ev.GpusGranted]:
    """One `full` cycle applied to the fold, which must stay legal; its grants."""
    events = cycle(st, now, PRESETS["full"])
    for e in events:
        st.apply(e)
    assert st.violations() == []
    return [e for e in events if isinstance(e, ev.GpusGranted)]
