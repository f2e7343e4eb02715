"""The policy's vocabulary: its settings, its refusals and the outcomes the shell carries out.

Pure data (no I/O). ``marduk.core.policy`` and the rule sets it is made of return these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from marduk.core.drmap import WorkerKey
from marduk.core.records import DeviceRecord, EpochKey, EpochRecord, WorkerRecord
from marduk.wire.protocol import (
    Action,
    Command,
    CommandKind,
    ControllerEvent,
    HealthReply,
    Registration,
    Report,
    Scope,
)


class PolicyError(Exception):
    """A request the policy refuses; ``code`` is stable, the message is one clear line."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Knobs of the restart policy (mapped from CLI options and MARDUK_* variables)."""

    pending_timeout_s: float = 60.0
    """A restart not confirmed by every worker within this long stops coalescing new events."""
    restart_on_degraded: bool = False
    """Restart replicas on ``degraded`` events too (default: record and report only)."""
    device_max_failures: int = 3
    """Restarts one device may cause within the window before replicas get ``fail``."""
    device_failure_window_s: float = 3600.0
    """The window of the device failure budget."""
    dedup_capacity: int = 10_000
    """How many recent event ids are remembered to drop repeated events."""
    epoch_block: int = 100
    """Epochs reserved per write-ahead (see ``EpochRecord.ceiling``)."""
    worker_ttl_s: float = 15.0
    """A worker that has not renewed its registration for this long is ``stale``."""
    worker_expiry_s: float = 600.0
    """A worker silent for this long is removed from the map (with a ``worker_expired`` event)."""
    epoch_retention_s: float = 86_400.0
    """A scope (replica, or job) with no worker for this long has its epoch record deleted."""
    resend_interval_s: float = 1.0
    """Commands of scopes whose live workers have not all confirmed are resent this often."""
    flap_limit: int = 3
    """A device that goes (back) to failed more often than this within the flap window is
    quarantined: its replicas get ``fail``; only an operator's ``undrain`` brings it back."""
    flap_window_s: float = 3600.0
    """The window of flap damping."""
    join_timeout_s: float = 30.0
    """A job whose ranks the controller assigns (``--nnodes MIN:MAX``) forms its first
    membership once MAX workers registered, or MIN did and this long has passed since."""
    resize_interval_s: float = 60.0
    """At most one resize (grow, shrink, hold, forming) of such a job per this long: a grow
    waits for it; a shrink forced by a lost member never does (docs/decisions.md #17)."""
    grow_checkpoint_timeout_s: float = 120.0
    """A grow waits this long at most for every member to confirm the checkpoint it asked for
    (``checkpointed``), then restarts with the larger membership anyway."""
    grow_settle_s: float = 30.0
    """A worker joins a job below MAX only once it has been live this long without going stale
    in between (a worker that flaps never does); keep it above ``worker_ttl_s``."""
    exclusive_devices: bool | None = None
    """Refuse a registration claiming a device a live worker of another job holds on another
    host (``device_claimed``). None: on when the controller runs with auth (identities bound
    to jobs make the first claim trustworthy), off without (anyone may say anything, and
    pods of different jobs may time-slice one GPU); the controller resolves it."""

    @property
    def renew_interval_s(self) -> float:
        """How often agents renew: three renewals fit in one TTL, so one lost one is harmless."""
        return self.worker_ttl_s / 3


@dataclass(slots=True)
class Outcome:
    """What the shell does, in order: persist ``write_ahead``, publish the commands, persist the
    other records, publish the events."""

    commands: list[Command] = field(default_factory=list)
    events: list[ControllerEvent] = field(default_factory=list)
    # Must be durable before the commands are published (epoch ceilings).
    write_ahead: list[EpochRecord] = field(default_factory=list)
    put_workers: list[WorkerRecord] = field(default_factory=list)
    deleted_workers: list[WorkerKey] = field(default_factory=list)
    put_epochs: list[EpochRecord] = field(default_factory=list)
    deleted_epochs: list[EpochKey] = field(default_factory=list)
    put_devices: list[DeviceRecord] = field(default_factory=list)
    deleted_devices: list[str] = field(default_factory=list)
    # Health events handled (for dedup across restarts); persisted after the commands go out.
    handled: list[HealthReply] = field(default_factory=list)
    # Commands sent again (same epoch): a merged device, or a worker that has not confirmed.
    resent: list[Command] = field(default_factory=list)
    # ``peer_failed`` notices to the other replicas of jobs whose replicas the commands restart
    # or fail (marduk.core.notices): published after the commands, never resent.
    notices: list[Command] = field(default_factory=list)


@dataclass(slots=True)
class Registered:
    outcome: Outcome
    result: str  # "new" | "updated" | "unchanged"
    epoch: int
    command: Command | None
    renew_interval: float = 0.0
    unusable: list[str] = field(default_factory=list)  # devices out of service
    claimed_by: str | None = None  # a pool spare a job claimed: it registers there now


@dataclass(slots=True)
class ReportResult:
    outcome: Outcome
    actions: list[Action]


@dataclass(slots=True)
class HealthResult:
    outcome: Outcome
    reply: HealthReply


@dataclass(slots=True)
class DrainResult:
    outcome: Outcome
    devices: list[str]
    actions: list[Action]
    conflicts: list[str] = field(default_factory=list)  # by host: devices other hosts claim


def scope_order(key: EpochKey) -> tuple[str, str]:
    return (key.job, key.replica or "")


def worker_key(reg: Registration) -> WorkerKey:
    return WorkerKey(reg.job, reg.replica, reg.worker)


def epoch_key_for(job: str, replica: str, scope: Scope) -> EpochKey:
    return EpochKey(job, None) if scope == "job" else EpochKey(job, replica)


def event_at(
    where: WorkerKey | EpochKey | Registration, kind: str, now: float, **fields: Any
) -> ControllerEvent:
    """An event about a worker (its job, replica and worker) or a scope (its job, and its
    replica unless it is job-wide); ``fields``: the event's others (``worker`` for a scope's)."""
    if not isinstance(where, EpochKey):
        fields["worker"] = where.worker
    return ControllerEvent(kind=kind, ts=now, job=where.job, replica=where.replica, **fields)


def action_of(ekey: EpochKey, kind: CommandKind, epoch: int, coalesced: bool = False) -> Action:
    """What a decision did to a scope, as the caller is answered (``coalesced``: joined the
    command in flight at ``epoch`` instead of a new one)."""
    return Action(job=ekey.job, replica=ekey.replica, kind=kind, epoch=epoch, coalesced=coalesced)


def worker_event(kind: str, key: WorkerKey, r: Report, now: float) -> ControllerEvent:
    """The event of a supervisor's report about its trainer."""
    parts = []
    if r.exit_code is not None:
        parts.append(f"exit code {r.exit_code}")
    if r.signal:
        parts.append(f"signal {r.signal}")
    if r.step is not None:
        parts.append(f"last step {r.step}")
    if r.failure_class:
        parts.append(f"{r.failure_class} ({r.action or '?'})")
    if r.summary:
        parts.append(r.summary)
    detail = "; ".join(parts)
    if r.lines:
        detail += " | " + " | ".join(r.lines[-3:])
    return ControllerEvent(
        kind=kind,
        ts=now,
        job=key.job,
        replica=key.replica,
        worker=key.worker,
        epoch=r.epoch,
        detail=detail[:4000],
    )
