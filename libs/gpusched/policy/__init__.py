"""Scheduling policies: pure functions over the fold. No I/O, no clock but the `now` passed in.

The contract shared by the live services and the simulator (one copy of every decision):

    cycle(state, now, config) -> list[Event]

returns, in order, the events a scheduling cycle decides: `GpusGranted` (gang starts; the
caller appends them with compare-and-set), `JobResized` (elastic grow/shrink),
`PreemptionRequested`, `GpusReleased` (overdue preemptions) and `JobPending` (only when a
job's reason changed). `naive_cycle` is the fallback of a dead placement service.
"""
