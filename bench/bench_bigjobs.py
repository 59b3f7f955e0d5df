"""Why node-sized gangs wait: for every pending job of a size range (default 5-8 GPUs), the
seconds it spends in each situation a cycle leaves it in, what the cluster looked like
meanwhile, how those jobs got their GPUs, and what their preemptions cost them. Measurement
only: it wraps the walk step and the simulator's event fold in this process (no decision
changes) and prints one JSON object.

    python bench/bench_bigjobs.py [--cluster 2x32x8] [--topology pack|any]
                                  [--runtime-model realistic|ideal] [--set KEY=VALUE ...]
                                  [--min-gpus 5] [--max-gpus 8]

Each cycle classifies every waiting job of the range (after the walk, before reclaim):

- `head_res_held` / `head_res_free`: it is the blocked head, the one job the reservation is for
  (its reserved set still held by running jobs, or free already);
- `behind_own_team` / `behind_other_team`: blocked while another job is the head, of its own
  team (LAS and priority order it behind one of its own) or another team's (fair share's turn);
- `not_reached`: the walk stopped before it (nothing more could start);
- `barred`: held, dependencies, limits.

A situation holds until the next cycle. Also reported:

- `job_seconds_first_wait_vs_requeued`: waiting before the first start, against waiting again
  after a preemption; `requeued_waits_by_cause`: those preemptions by cause (`las_own`,
  `priority_own`: for a job of the victim's team; `other_team`: reclaim or priority across
  teams) and the wait each one cost until the victim got GPUs again;
- `starts_of_range_jobs`: how the range's jobs got GPUs: after a preemption for them, on the
  set reserved for them as the head, elsewhere while head, or without ever being the head;
- `while_waiting_mean_free_gpus` / `..._stranded_gpus`: free GPUs while one of the range waits,
  and how many of them sit on nodes with fewer free than the job needs;
- `head_set_true_drain_mean_s` against `best_node_true_drain_mean_s`: per head cycle, how long
  its reserved set would take to free in truth (the trace's run times, no arrivals: an oracle,
  for scoring only) and how long the soonest-freeing node would;
- `head_cycles_consolidable` and `consolidation_moves_hist`: head cycles where some node could
  hold it if its running jobs (all preemptible, past `min_runtime_s`) moved to the free GPUs
  elsewhere (counts only, placement and fairness not checked), and how many jobs that takes;
- `head_set_kept_cycles` / `..._moved_cycles`: whether a head's reserved set stayed put from
  one cycle to the next; `grants_on_last_head_set_by_size`: grants on the set it had before.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

from bench_preempt_causes import run_full, scenario_parser  # the same scenario options

from gpusched.core import events as ev
from gpusched.core.model import PRIORITY_RANK
from gpusched.policy import cycle as cycle_mod
from gpusched.policy.steps import walk
from gpusched.sim import engine
from gpusched.sim.report import load_jobs


class Watch:
    """The walk's findings about the jobs of one size range, cycle by cycle."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.last_t: float | None = None
        self.last: list[tuple] = []  # (job, situation, free, stranded, head's size, requeued)
        self.seconds: Counter[str] = Counter()
        self.per_job: dict[str, Counter[str]] = defaultdict(Counter)
        self.free_s = 0.0  # free GPUs x seconds, while a job of the range waits
        self.stranded_s = 0.0
        self.wait_s = 0.0  # seconds with at least one job of the range waiting
        self.head_size_s: Counter[str] = Counter()  # size of the head while one of the range waits behind it
        self.prev_res: dict[str, set] = {}  # head -> its reserved set last cycle
        self.moved = 0
        self.kept = 0
        self.taken: Counter[str] = Counter()  # size of jobs granted GPUs of a range head's last set
        self.left: dict[str, float] = {}  # job -> its true run time (the trace's: an oracle, for scoring only)
        self.drain: list[tuple[float, float]] = []  # per head cycle: (true drain of its set, of the best node)
        self.heads: set[str] = set()
        self.consolidable: list = []  # per head cycle: (GPUs, jobs) to move to free its best node, or None
        self.starts: Counter[str] = Counter()
        self.when: Counter[str] = Counter()  # job-seconds before the first start, and after a preemption
        self.preempted_for: set[str] = set()

    def size_of(self, n: int) -> str:
        return "1" if n == 1 else "2-4" if n <= 4 else "5-8" if n <= 8 else ">8"

    def observe(self, plan, ctx) -> None:
        now = ctx.now
        self._close(now)
        st = ctx.state
        counts = plan.pool.node_counts()
        head = plan.head
        blocked = {j.job_id for j in plan.blocked}
        self.last = []
        for jid in st.pending:
            job = st.jobs[jid]
            n = job.spec.gpus
            if not (self.lo <= n <= self.hi):
                continue
            stranded = sum(k for k in counts if 0 < k < n)
            if head is not None and head.job_id == jid:
                res = plan.reservation
                sit = "head_res_free" if res is not None and res.at <= now else "head_res_held"
                self._res_stability(plan, job)
                self._score_drain(plan, ctx, job)
                self._consolidation(plan, ctx, job)
            elif jid in blocked:
                sit = "behind_own_team" if head is not None and head.team == job.team else "behind_other_team"
            elif jid in plan.reasons and type(plan.reasons[jid][0]).__name__ in ("TeamLimit", "Held",
                                                                                   "DependencyWait", "ArrayLimit"):
                sit = "barred"
            elif any(j.job_id == jid for j, _ in plan.started):
                continue
            else:
                sit = "not_reached"
            hs = self.size_of(head.spec.gpus) if head is not None and head.job_id != jid else "-"
            self.last.append((jid, sit, plan.pool.count, stranded, hs, job.attempt > 0))
        for job, gpus in plan.started:
            if self.lo <= job.spec.gpus <= self.hi:
                self.starts[self._how_started(plan, job, gpus)] += 1
        # who took GPUs of a range head's previous set
        for job, gpus in plan.started:
            for h, res in self.prev_res.items():
                if h != job.job_id and res.intersection(gpus):
                    self.taken[self.size_of(job.spec.gpus)] += 1
        self.prev_res = {h: r for h, r in self.prev_res.items() if h in st.pending}
        self.last_t = now

    def _how_started(self, plan, job, gpus) -> str:
        """How a job of the range got its GPUs: on the set reserved for it as the head, after
        preemptions for it, or on a node that happened to be free."""
        if job.job_id in plan.preempting or job.job_id in self.preempted_for:
            self.preempted_for.discard(job.job_id)
            return "after_preemption_for_it"
        before = self.prev_res.get(job.job_id)
        if before is not None:
            return "on_its_reserved_set" if set(gpus) <= before else "head_elsewhere"
        return "never_head"

    def _res_stability(self, plan, job) -> None:
        res = plan.reservation
        if res is None:
            return
        now_set = set(res.gpus)
        before = self.prev_res.get(job.job_id)
        if before is not None:
            if before == now_set:
                self.kept += 1
            else:
                self.moved += 1
        self.prev_res[job.job_id] = now_set

    def _true_left(self, job, now: float) -> float:
        return max(0.0, self.left.get(job.job_id, 0.0) - job.attained_gpu_s(now) / max(1, len(job.gpus) or 1))

    def _score_drain(self, plan, ctx, job) -> None:
        """How long the head's reserved set takes to drain in truth (no arrivals), against the
        node that would have drained soonest: what a perfect choice of node could gain."""
        res = plan.reservation
        st, now = ctx.state, ctx.now
        self.heads.add(job.job_id)
        if res is None or job.spec.gpus > 8:
            return
        per_node: dict[str, list[tuple[float, int]]] = defaultdict(list)
        for jid in st.running:
            r = st.jobs[jid]
            left = self._true_left(r, now)
            for g in r.gpus:
                per_node[st.gpus[g].node].append((left, 1))
        res_left = max((self._true_left(st.jobs[h], now) for h in res.holders), default=0.0)
        need = job.spec.gpus
        best = float("inf")
        for name, node in st.nodes.items():
            free = len(node.free)
            if free >= need:
                best = 0.0
                break
            ends = sorted(per_node.get(name, []))
            acc = free
            for left, k in ends:
                acc += k
                if acc >= need:
                    best = min(best, left)
                    break
        self.drain.append((res_left, best))

    def _consolidation(self, plan, ctx, job) -> None:
        """Could the head start now if a few running jobs moved to free GPUs elsewhere? The
        node needing the fewest moved GPUs whose holders are all preemptible and past
        `min_runtime_s`, with room for them outside it (counts only, placement not checked)."""
        st, now, need = ctx.state, ctx.now, job.spec.gpus
        counts = plan.pool.counts()
        per_node: dict[str, set[str]] = defaultdict(set)
        for jid in st.running:
            for g in st.jobs[jid].gpus:
                per_node[st.gpus[g].node].add(jid)
        best = None
        for name, free in counts.items():
            movers = [st.jobs[j] for j in per_node.get(name, ())]
            if not movers or free + sum(len(m.gpus) for m in movers) < need:
                continue
            ok = all(m.spec.preemptible and m.preemption is None and m.started_at is not None
                     and now - m.started_at >= ctx.config.min_runtime_s for m in movers)
            moved = sum(len(m.gpus) for m in movers)
            if ok and moved <= plan.pool.count - free and (best is None or moved < best[0]):
                best = (moved, len(movers))
        self.consolidable.append(best)

    def _close(self, now: float) -> None:
        if self.last_t is None:
            return
        dt = now - self.last_t
        if self.last:
            self.wait_s += dt
            _, _, free, stranded, _, _ = self.last[0]
            self.free_s += free * dt
            self.stranded_s += stranded * dt
        for jid, sit, _, _, hs, requeued in self.last:
            self.seconds[sit] += dt
            self.when[("requeued" if requeued else "first_wait")] += dt
            self.per_job[jid][sit] += dt
            if sit.startswith("behind"):
                self.head_size_s[hs] += dt


def _cause(state, victim) -> str:
    """Why a job of the range was preempted, as `bench_preempt_causes` names it (coarser)."""
    pre = victim.preemption
    if pre.cause == "idle" or pre.for_job == victim.job_id:
        return "idle_or_move"
    for_job = state.jobs.get(pre.for_job)
    if for_job is None:
        return "unknown"
    if for_job.team != victim.team:
        return "other_team"
    lower = PRIORITY_RANK[victim.spec.priority] < PRIORITY_RANK[for_job.spec.priority]
    return "priority_own" if lower else "las_own"


def main() -> None:
    p = scenario_parser()
    p.add_argument("--min-gpus", type=int, default=5)
    p.add_argument("--max-gpus", type=int, default=8)
    args = p.parse_args()
    watch = Watch(args.min_gpus, args.max_gpus)

    def watched_walk(plan, ctx) -> None:
        for jid in ctx.state.running:
            pre = ctx.state.jobs[jid].preemption
            if pre is not None and pre.for_job:
                watch.preempted_for.add(pre.for_job)
        walk.run(plan, ctx)
        watch.observe(plan, ctx)

    requeued: dict[str, tuple[str, float]] = {}  # job of the range -> (cause of its preemption, since)
    requeue_s: Counter[str] = Counter()
    requeue_n: Counter[str] = Counter()
    real_apply = engine.Simulation._apply

    def apply(self, event) -> None:
        job = self.state.jobs.get(getattr(event, "job_id", ""))
        if job is not None and args.min_gpus <= job.spec.gpus <= args.max_gpus:
            if isinstance(event, ev.GpusReleased) and event.reason == "preempted" and job.preemption is not None:
                requeued[job.job_id] = (_cause(self.state, job), event.at)
            elif isinstance(event, ev.GpusGranted) and job.job_id in requeued:
                cause, since = requeued.pop(job.job_id)
                requeue_s[cause] += event.at - since
                requeue_n[cause] += 1
        real_apply(self, event)

    engine.Simulation._apply = apply  # type: ignore[method-assign]
    cycle_mod.STEPS[:] = [s._replace(run=watched_walk) if s.run is walk.run else s for s in cycle_mod.STEPS]
    jobs, _ = load_jobs(None, None, None, None)
    watch.left = {j.job_id: j.duration_s for j in jobs}
    sim = run_full(jobs, args)
    s = sim.summary()
    n_jobs = len(watch.per_job)
    total = sum(watch.seconds.values())
    worst = sorted(watch.per_job.items(), key=lambda kv: -sum(kv[1].values()))[:5]
    print(json.dumps({
        "summary": {k: s[k] for k in ("avg_jct_s", "avg_queue_s_by_size", "preemptions", "utilization")},
        "jobs_that_waited": n_jobs,
        "job_seconds_by_situation": {k: round(v) for k, v in watch.seconds.most_common()},
        "share_by_situation": {k: round(v / total, 3) for k, v in watch.seconds.most_common()} if total else {},
        "mean_wait_per_job_s": round(total / max(1, n_jobs)),
        "behind_head_of_size_s": {k: round(v) for k, v in watch.head_size_s.most_common()},
        "while_waiting_mean_free_gpus": round(watch.free_s / watch.wait_s, 1) if watch.wait_s else None,
        "while_waiting_mean_stranded_gpus": round(watch.stranded_s / watch.wait_s, 1) if watch.wait_s else None,
        "head_set_kept_cycles": watch.kept, "head_set_moved_cycles": watch.moved,
        "grants_on_last_head_set_by_size": dict(watch.taken),
        "job_seconds_first_wait_vs_requeued": {k: round(v) for k, v in watch.when.items()},
        "requeued_waits_by_cause": {k: {"n": requeue_n[k], "mean_s": round(requeue_s[k] / requeue_n[k]),
                                        "job_s": round(requeue_s[k])} for k in requeue_n},
        "starts_of_range_jobs": dict(watch.starts),
        "head_cycles_consolidable": sum(1 for c in watch.consolidable if c is not None),
        "consolidation_moves_hist": dict(Counter(c[1] for c in watch.consolidable if c is not None)),
        "head_jobs": len(watch.heads),
        "head_cycles": len(watch.drain),
        "head_set_true_drain_mean_s": round(sum(a for a, _ in watch.drain) / max(1, len(watch.drain))),
        "best_node_true_drain_mean_s": round(sum(b for _, b in watch.drain) / max(1, len(watch.drain))),
        "longest_waits": {j: {k: round(v) for k, v in c.items()} for j, c in worst},
    }, indent=1))


if __name__ == "__main__":
    main()
