"""Scheduling policies: pure functions over the fold. No I/O, no clock but the `now` passed in.

The contract shared by the live services and the simulator (one copy of every decision):

    cycle(state, now, config) -> list[Event]

returns, in order, the events a scheduling cycle decides: `GpusGranted` (gang starts; the
caller appends them with compare-and-set), `JobResized` (elastic grow/shrink),
`PreemptionRequested`, `GpusReleased` (overdue preemptions) and `JobPending` (only when a
job's reason changed). `naive_cycle` is the fallback of a dead placement service.

A cycle is a list of steps (`cycle.STEPS`: expire, settle, handover, unhealthy, walk,
consolidate, reclaim, grow, explain, idle; one module each in `steps/`, unhealthy in `unhealthy.py`) over one `CyclePlan` (`plan.py`): the tentative world with verbs
(grant, release, request_preemption, shrink, grow) and one `touchable(job)`. The legality rules
live once in `core/rules.py`; the typed reasons in `core/reasons.py`.

One question per module (Volcano-style plugins):

    config.py      PolicyConfig knobs and the PRESETS of the design story
    ordering.py    in which order pending jobs are considered (priority, FIFO, LAS)
    fairshare.py   which team goes next; hard limits; the fairness rule of preemption
    placer.py      the one entry point of placement: feasibility filters, weighted scorers
    placement.py   the pool and the search under it (topology-aware `place`, naive `first_free`)
    resources.py   CPUs and memory per node: the filter, what a cycle holds, jobs no node can hold
    backfill.py    the blocked head's reservation, and who may start before it
    preemption.py  whom to preempt for a blocked job
    elastic.py     how elastic jobs start small, grow and shrink
    running.py     running jobs indexed for victim search
    plan.py        the cycle's tentative world and its verbs
    steps/         the steps of a cycle, each a function of (plan, context)
    explain.py     the full picture of a pending job, read from the reasons the cycle recorded
"""
