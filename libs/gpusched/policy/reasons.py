"""The vocabulary of why a job waits: one builder per reason, returning (reason, blockers).

Reasons are stable strings (numbers only where they change rarely, or for the head job), so
that `JobPending` is appended when a job's situation changes, not once per cycle. Only the head
job's reason, and those of the few jobs reclaim acted for, name other jobs: a queue-wide reason
never embeds a job id (a change of head would re-explain thousands of jobs). `gpusched
show JOB` reads them back; `blockers` name the jobs (or the team limit) in the way.
"""

from __future__ import annotations

Reason = tuple[str, list[str]]


def fifo_blocked() -> Reason:
    return "queued behind earlier jobs (strict FIFO)", []


def no_room(n: int, required: str) -> Reason:
    scope = "" if required == "cluster" else f" within one {required}"
    return f"waiting for {n} free GPUs{scope}", []


def team_limit(team: str, limit: int, need: int) -> Reason:
    return f"team {team} at its limit {limit} (needs {need} more GPUs)", [f"team {team} limit {limit}"]


def would_delay(head: str | None = None) -> Reason:
    """Fits now, but only on GPUs reserved for the blocked head job. The same words for every
    job whoever the head is (`head` is ignored): a change of head must not re-explain the whole
    queue. The head's own reason names what it waits for."""
    return "would delay the GPUs reserved for the head of the queue", []


def reserved(detail: str, holders: list[str]) -> Reason:
    return f"{detail}; GPUs reserved, waiting for them to free", holders


def preempting(victims: list[str]) -> Reason:
    return f"preempted {len(victims)} job(s) for it; they checkpoint and yield", list(victims)


def yielding(holders: list[str]) -> Reason:
    """Covered by GPUs already coming free (preemptions in flight for this or other jobs)."""
    return "GPUs coming free from preempted jobs (they checkpoint and yield)", list(holders)


def no_fit(detail: str, holders: list[str]) -> Reason:
    return detail, holders
