"""Roles and the event kinds each may decide: the one table behind NATS permissions (who may
publish an event's subject) and `replay --verify` (whose signature an event may carry).

A fact is trusted only if its signer's role decides that kind. Extend `EVENT_WRITERS` when an
event kind is added: a kind nobody may write cannot be appended, and a test walks every event.
"""

from __future__ import annotations

#: Services of the control plane, one identity each.
SERVICE_ROLES = ("admission", "placement", "fallback", "preemptor", "quota_ledger", "reconciler",
                 "projector", "dashboard", "api", "reader")
#: People and other systems.
PERSON_ROLES = ("admin", "tenant", "platform", "auditor")
#: One identity per GPU host.
NODE_ROLE = "node"
ROLES = SERVICE_ROLES + PERSON_ROLES + (NODE_ROLE,)

#: Event type name -> the roles that may decide (and so sign and publish) it.
EVENT_WRITERS: dict[str, frozenset[str]] = {
    "JobSubmitted": frozenset({"admission"}),
    "JobRejected": frozenset({"admission"}),
    "JobCancelled": frozenset({"admission"}),
    "JobHeld": frozenset({"admission"}),
    "JobUpdated": frozenset({"admission"}),
    "TeamQuotaSet": frozenset({"admission"}),
    "FoldSettingsSet": frozenset({"admission"}),
    "NodeDrained": frozenset({"admission"}),
    "NodeLabeled": frozenset({"admission"}),
    "JobPending": frozenset({"placement", "fallback"}),
    "GpusGranted": frozenset({"placement", "fallback"}),
    "JobResized": frozenset({"placement"}),
    "PlacementDegraded": frozenset({"fallback"}),
    "PlacementRecovered": frozenset({"placement"}),
    "PreemptionRequested": frozenset({"preemptor"}),
    "GpusReleased": frozenset({"preemptor", "reconciler", NODE_ROLE}),  # node: a process failed, requeue
    "JobFailed": frozenset({"preemptor", "reconciler", NODE_ROLE}),
    "NodeRegistered": frozenset({NODE_ROLE}),
    "JobStarted": frozenset({NODE_ROLE}),
    "ProcessesEnded": frozenset({NODE_ROLE}),
    "JobTimedOut": frozenset({"placement", "fallback", "preemptor"}),
    "JobOnUnhealthyGpu": frozenset({"reconciler"}),
    "CheckpointSaved": frozenset({NODE_ROLE}),
    "JobCompleted": frozenset({NODE_ROLE}),
    "JobIdle": frozenset({"reconciler"}),
    "JobBusy": frozenset({"reconciler"}),
    "NodeLost": frozenset({"reconciler"}),
    "PartitionDeclared": frozenset({"reconciler"}),
    "PartitionEnded": frozenset({"reconciler"}),
    "GpuQuarantined": frozenset({"reconciler"}),
    "GpuRestored": frozenset({"reconciler", "admission"}),
    "MigGeometrySet": frozenset({"admission"}),
    "ZombieDetected": frozenset({"reconciler"}),
    "ZombieReclaimed": frozenset({"reconciler"}),
    "SnapshotTaken": frozenset({"projector"}),
}


def may_write(role: str, event_type: str) -> bool:
    """Admin may state any fact (an operator's override: registering simulated nodes, repairing
    a stuck job); every such fact still carries admin's signature, so an audit can list them."""
    return role == "admin" or role in EVENT_WRITERS.get(event_type, frozenset())


def kinds_of(role: str) -> frozenset[str]:
    """The event kinds a role may append."""
    return frozenset(kind for kind, roles in EVENT_WRITERS.items() if role in roles)


def no_such_job_among(name: str, role: str, teams: list[str] | tuple[str, ...], job_id: str) -> str:
    """A job none of a tenant's or platform's teams holds, as the CLI and the HTTP API say it:
    who asks, its role, every team it reads (another team's job reads as one that does not
    exist: never which team holds it)."""
    return f"{name} (role {role}) reads team(s) {', '.join(teams)} only; no job {job_id} among them"
