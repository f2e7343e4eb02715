"""The records the controller persists (JetStream KV, ``marduk.store.state``) and restores from.

Plain data: the policy decides, these hold what it decided. JSON on disk (msgspec), so a record
written by one controller version is read by the next (fields are only ever added, with
defaults).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from marduk.wire.protocol import (
    Command,
    ControllerEvent,
    HealthState,
    Membership,
    Registration,
    WorkerRef,
)


class EpochKey(NamedTuple):
    """A restart scope: one replica, or the whole job (``replica`` None)."""

    job: str
    replica: str | None

    def __str__(self) -> str:
        return f"{self.job}/{self.replica or '*'}"


class WorkerRecord(msgspec.Struct, kw_only=True):
    registration: Registration
    registered_at: float
    updated_at: float
    applied_epoch: int = 0
    # Taken out of its job's membership (why): never a member or a spare again; its agent is
    # told to exit 71 (``Command.retired``). A new process under the same name starts afresh.
    retired: str = ""


class GrowRecord(msgspec.Struct, kw_only=True):
    """A grow of a job waiting for its checkpoint (marduk/core/grow_policy.py): the
    ``checkpoint`` command it sent (``epoch``), when, and the workers it takes in. Persisted
    with the epoch, so a new leader finishes it rather than starting it over."""

    epoch: int
    started_at: float
    joining: list[WorkerRef] = []


class PoolClaim(msgspec.Struct, kw_only=True, frozen=True):
    """A spare of ``pool`` (registered as worker ``replica``/``worker`` of the job named like the
    pool) that a job took (marduk/core/pools.py): kept on that job's epoch record, written ahead
    with the membership that gives it ranks, so a new leader neither loses the claim nor gives
    the spare to a second job."""

    pool: str
    replica: str
    worker: int = 0
    claimed_at: float = 0.0


class JobShape(msgspec.Struct, kw_only=True, frozen=True):
    """What a job's own workers (its non-spares) said of it: ``--nnodes`` MIN:MAX, local ranks
    and devices per node, and the pool it draws spares from. Kept on the job's epoch record
    when it is held below MIN, so it can form again from its pool's spares with none of its own
    workers left (marduk/core/pools.py)."""

    min_nodes: int
    max_nodes: int
    nproc: int
    devices: int
    pool: str | None = None


class MergedFailure(msgspec.Struct, kw_only=True, frozen=True):
    """A failure of ``device`` merged into the scope's restart in flight (``event_id``, the
    event that said it), which made its command's ``revision``. A worker on the device whose
    incarnation started at a lower revision is not covered by the restart (``AckRules``)."""

    device: str
    revision: int
    event_id: str = ""


class EpochRecord(msgspec.Struct, kw_only=True):
    job: str
    replica: str | None
    epoch: int = 0
    issued_at: float = 0.0
    command: Command | None = None
    # How many of its epochs were a ``checkpoint`` command (a grow's, a preemption notice's):
    # no trainer restarts for one, so status counts restarts as the epoch less these.
    checkpoints: int = 0
    # Epochs up to the ceiling may be issued without a write: the ceiling is persisted before
    # any command above the previous one goes out, and a restored controller issues above it.
    # Epochs must only increase; gaps are harmless.
    ceiling: int = 0
    # A job whose ranks the controller assigns: the membership in force (set by the restart
    # that began it). Written ahead with the epoch, so a new leader starts from it.
    membership: Membership | None = None
    # A grow waiting for the checkpoint it asked for; void once another command follows.
    grow: GrowRecord | None = None
    # Spares of pools this job claimed and still holds (scope ``job`` only).
    claims: list[PoolClaim] = []
    # The job's last membership change (an event of ``fleet.RESIZE_EVENTS``, for status) and
    # when its size last changed (formed, shrank, held, grew: a grow waits the resize interval
    # after it; a held job's join timeout counts from it). Written with the membership they
    # changed (no write of their own), so a new leader goes on from them. Wall-clock times, as
    # every time here: comparable across controllers up to their clocks' skew.
    last_change: ControllerEvent | None = None
    resized_at: float = 0.0
    # A job held below MIN: its shape as its own workers gave it, written ahead with the hold.
    shape: JobShape | None = None
    # The failures merged into the current command since it was issued, the latest of each
    # device (at most the command's devices): persisted with it, so a new leader knows which
    # failures an ack at an older revision did not cover. Cleared by every new epoch.
    merged: list[MergedFailure] = []


class DeviceRecord(msgspec.Struct, kw_only=True):
    device: str
    state: HealthState = "healthy"
    reason: str = ""
    since: float = 0.0
    failures: list[float] = []  # times of restarts this device caused, inside the window
    # Flap damping: times the device went (back) to failed, inside the flap window. Unlike
    # ``failures``, a healthy event does not clear them: a device that keeps recovering and
    # failing again is quarantined.
    flips: list[float] = []
    quarantined: bool = False  # by the policy (flapping); only an operator's undrain clears it
    drained: bool = False  # by an operator (marduk monitor drain)
    out_reason: str = ""  # why it is out of service
