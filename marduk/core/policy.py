"""The restart policy: registrations and health events in, commands and state changes out.

Pure: no I/O, no clock (``now`` is an argument, unix seconds). The controller shell decodes
messages, calls these methods, persists the records they return and publishes the commands.

``Policy`` is a facade: it owns the state (a ``Fleet``: marduk/core/fleet.py) and the rule sets
that decide over it, each of one job and handed what it needs at construction (the ``Issuer``
of commands, another rule set where it needs its decision), and routes each input to them:
registrations (``registration``), acks (``acks``), reports (``reports``), health events
(``device_policy``), drains (``service_policy``), trainers' requests (``workload_requests``),
memberships (``membership_policy``,
``grow_policy``) and time (``tick``).

Epochs (docs/decisions.md #3). Each restart scope has a monotonically increasing epoch: the
replica for scope ``replica``, the whole job for scope ``job``. A restart bumps the epoch and
records the command that did it. While the workers of a scope have not confirmed the new epoch
(by an ack, or by registering as a fresh process), further failures for that scope are
*coalesced* into the restart already in flight, so a storm of events yields one command per
scope. A restart unconfirmed after ``pending_timeout_s`` no longer holds events back.

Delivery. A failure that joins a restart in flight is still told to every scope it
touches: the command in flight is sent again with the device merged into it (same epoch, so an
agent acts once). A worker that had already acted when the device was merged (its ack, on its
way, lists the devices it knew) is restarted again at a new epoch for it: a merge covers only a
worker that has not restarted yet. Commands of scopes still awaiting confirmation are resent by
``tick`` about once a second, so a worker that missed one (dropped message, failover) has it
soon after it can receive again. Epochs of a scope are kept when its workers leave: they never
go backwards. After ``epoch_retention_s`` with no worker the record is deleted (a worker that
returns later has the epoch it saw adopted at registration).

Liveness. Workers renew their registration every ``renew_interval`` (told in the reply); one
silent for ``worker_ttl_s`` is ``stale`` (it no longer holds a restart pending) and is removed
after ``worker_expiry_s``. Devices no worker uses are forgotten. A second live process claiming a
worker identity is refused (``duplicate_worker``).

Escalation (docs/decisions.md #6). Each device has a failure budget: past
``device_max_failures`` restarts caused by one device within ``device_failure_window_s``, the
replicas get ``fail`` instead of ``restart``: restarting on that device does not help; the pod
should go back to the scheduler. A ``healthy`` event for the device clears its history.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from marduk.core import pools, views
from marduk.core.acks import AckRules
from marduk.core.decisions import (
    DrainResult,
    HealthResult,
    Outcome,
    PolicyConfig,
    PolicyError,
    Registered,
    ReportResult,
    worker_key,
)
from marduk.core.device_policy import DeviceRules
from marduk.core.drmap import DRMap, WorkerKey
from marduk.core.fleet import Fleet, awaited, takes_part
from marduk.core.grow_policy import GrowRules
from marduk.core.issuer import Issuer
from marduk.core.job_views import JobViews
from marduk.core.membership_policy import MembershipRules
from marduk.core.pools import PoolRules
from marduk.core.records import DeviceRecord, EpochKey, EpochRecord, WorkerRecord
from marduk.core.registration import RegistrationRules
from marduk.core.reports import FAILURE_STATUSES, ReportRules
from marduk.core.scopes import Scopes
from marduk.core.service_policy import ServiceRules
from marduk.core.tick import TickRules
from marduk.core.workload_requests import WorkloadResult, WorkloadRules
from marduk.wire.protocol import (
    DeviceHealth,
    DeviceInfo,
    HealthReply,
    JobInfo,
    Registration,
    Report,
    WorkerInfo,
    WorkloadRequest,
)

__all__ = [
    "FAILURE_STATUSES",
    "HealthResult",
    "Outcome",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "Registered",
    "ReportResult",
]


class Policy:
    """Controller state and decisions. One instance per controller."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.fleet = fleet = Fleet(config or PolicyConfig())
        issuer = Issuer(fleet)
        self._grow = GrowRules(fleet, issuer)
        self._pools = PoolRules(fleet)
        self._membership = MembershipRules(fleet, issuer, self._grow, self._pools)
        self._service = ServiceRules(fleet, self._membership.issue_or_replace)
        self._devices = DeviceRules(
            fleet,
            issuer,
            self._service,
            self._membership.issue_or_replace,
            self._membership.spends_budget,
        )
        self._acks = AckRules(fleet, issuer)
        self._registration = RegistrationRules(
            fleet, self._membership, self._grow, self._service, self._pools, self._acks
        )
        self._reports = ReportRules(fleet, issuer, self._acks, self._grow)
        self._tick = TickRules(fleet, issuer, self._membership, self._grow)
        self._jobs = JobViews(fleet, issuer, self._membership, self._grow)
        self._requests = WorkloadRules(
            fleet,
            lambda devices, reason, now: self._service.drain(
                devices, "", False, reason, now, by="its trainer"
            ),
            self._devices.on_health,
        )

    # --- the state, for the shell, the store and queries ---------------------------------------

    @property
    def config(self) -> PolicyConfig:
        return self.fleet.config

    @property
    def drmap(self) -> DRMap:
        return self.fleet.drmap

    @property
    def workers(self) -> dict[WorkerKey, WorkerRecord]:
        return self.fleet.workers

    @property
    def devices(self) -> dict[str, DeviceRecord]:
        return self.fleet.devices

    @property
    def scopes(self) -> Scopes:
        return self.fleet.scopes

    @property
    def epochs(self) -> dict[EpochKey, EpochRecord]:
        """Every scope's epoch record (read it; the policy changes it through ``scopes``)."""
        return self.fleet.epochs

    @property
    def last_seen(self) -> dict[WorkerKey, float]:
        return self.fleet.last_seen

    @property
    def stale(self) -> set[WorkerKey]:
        return self.fleet.stale

    @property
    def reports(self) -> dict[WorkerKey, Report]:
        return self.fleet.reports

    # --- restore ---------------------------------------------------------------------------------

    @classmethod
    def restore(
        cls,
        config: PolicyConfig,
        workers: list[WorkerRecord],
        epochs: list[EpochRecord],
        devices: list[DeviceRecord],
        handled: Iterable[HealthReply] = (),
        now: float = 0.0,
    ) -> Policy:
        """Rebuild from persisted records. Every worker counts as seen at ``now``: renewals are
        not written, so a restored controller gives each one a full TTL to renew."""
        policy = cls.from_records(config, workers, epochs, devices)
        policy.resume(handled, now)
        return policy

    def resume(self, handled: Iterable[HealthReply], now: float) -> None:
        """Start leading with a policy built from the records (perhaps a while ago, by a hot
        standby, and untouched since): the handled events are remembered, and every worker
        counts as seen at ``now``."""
        for reply in handled:
            self._devices.remember(reply)
        fleet = self.fleet
        for key in fleet.last_seen:
            fleet.last_seen[key] = now  # in place: the order (last heard) stays
        # Vacant scopes' retention counts from now: when they were vacated was not stored.
        fleet.scopes.vacant_all({fleet.epoch_key(k) for k in fleet.workers}, now)
        self._grow.resume(now)
        self._membership.resume()

    @classmethod
    def from_records(
        cls,
        config: PolicyConfig,
        workers: list[WorkerRecord],
        epochs: list[EpochRecord],
        devices: list[DeviceRecord],
    ) -> Policy:
        """The map, epochs and devices the records describe; ``resume`` before leading."""
        policy = cls(config)
        fleet = policy.fleet
        # A claim of a pool spare written ahead but not its move (marduk/core/pools.py).
        workers, fleet.claims, fleet.unsaved_moves = pools.reconcile(workers, epochs)
        for epoch in epochs:
            # Commands up to the ceiling may have gone out after the last exact write.
            fleet.scopes.restore(epoch)
            if epoch.replica is None and epoch.last_change is not None:
                fleet.last_change[epoch.job] = epoch.last_change
        for device in devices:
            fleet.devices[device.device] = device
        for rec in workers:
            key = worker_key(rec.registration)
            fleet.put_worker(rec)
            fleet.last_seen[key] = 0.0  # resume() says when
            ekey = fleet.epoch_key(key)
            state = fleet.epochs.get(ekey)
            if (
                state is not None
                and rec.applied_epoch < state.epoch
                and awaited(state)
                and takes_part(state, key)
            ):
                fleet.scopes.inherit(ekey, key)
        for epoch in epochs:  # members no longer registered keep their entries' sizes
            if epoch.replica is None:
                fleet.sizes.settle(epoch.job, epoch.membership)
        return policy

    # --- inputs, each to its rules ---------------------------------------------------------------

    def register(self, reg: Registration, now: float) -> Registered:
        """A worker registers or renews (refused with ``PolicyError`` before any change)."""
        return self._registration.register(reg, now)

    def deregister(self, key: WorkerKey, reason: str, now: float) -> tuple[Outcome, bool]:
        """A worker leaves; False if it was not registered."""
        return self._registration.deregister(key, reason, now)

    def forget(self, job: str, replica: str | None, worker: int | None, now: float) -> Outcome:
        """An operator removes a job, a replica or one worker (``marduk monitor forget``)."""
        return self._registration.forget(job, replica, worker, now)

    def ack(
        self,
        key: WorkerKey,
        epoch: int,
        now: float,
        *,
        devices: Sequence[str] | None = None,
        revision: int | None = None,
    ) -> Outcome:
        """A worker acted on ``epoch``, its incarnation starting at ``revision`` of the epoch's
        command, knowing its ``devices`` (None: not said)."""
        return self._acks.ack(key, epoch, now, devices=devices, revision=revision)

    def on_report(self, report: Report, now: float) -> ReportResult:
        """A supervisor reports its trainer's status; a failure restarts the worker's scope."""
        return self._reports.on_report(report, now)

    def on_health(self, event: DeviceHealth, now: float) -> HealthResult:
        """Decide what a health event means. ``event.event_id`` must be set (the shell does)."""
        return self._devices.on_health(event, now)

    def drain(
        self,
        devices: list[str],
        host: str,
        undrain: bool,
        reason: str,
        now: float,
        by: str = "an operator",
    ) -> DrainResult:
        """An operator (or the straggler policy: ``by``) takes devices (or every device of
        ``host``) out of service, or back."""
        return self._service.drain(devices, host, undrain, reason, now, by=by)

    def on_workload_request(self, req: WorkloadRequest, now: float) -> WorkloadResult:
        """A trainer asks about itself: stop restarting it, exclude its node, a bad device."""
        return self._requests.on_request(req, now)

    def tick(self, now: float) -> Outcome:
        """Time passes: silent workers go stale, then expire; unconfirmed commands are resent."""
        out = self._tick.tick(now)
        self._pools.flush(out)
        return out

    # --- queries ---------------------------------------------------------------------------------

    def epoch_of(self, ekey: EpochKey) -> int:
        """The scope's current epoch (0 before its first command)."""
        return self.fleet.epoch_of(ekey)

    def epoch_of_worker(self, key: WorkerKey) -> int:
        """The current epoch of the worker's scope (0 for a worker not registered)."""
        rec = self.fleet.workers.get(key)
        return self.fleet.epoch_of(self.fleet.epoch_key_of(rec)) if rec else 0

    def awaiting(self, ekey: EpochKey) -> frozenset[WorkerKey]:
        """The scope's live workers that have not confirmed its epoch."""
        return self.fleet.scopes.awaiting(ekey)

    def worker_infos(self, job: str | None = None, now: float | None = None) -> list[WorkerInfo]:
        """The workers' rows; with ``now``, a worker that will grow its job is "joining"."""
        return views.worker_infos(self.fleet, job, now)

    def device_infos(self, job: str | None = None) -> list[DeviceInfo]:
        return views.device_infos(self.fleet, job)

    def job_infos(self, now: float, job: str | None = None) -> list[JobInfo]:
        """Jobs whose ranks the controller assigns: size, spares, the resize under way."""
        return self._jobs.infos(now, job)
