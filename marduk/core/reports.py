"""Supervisors' reports of their trainers: running (an ack), restarting, exited, checkpointed, or
a failure that restarts the worker's scope. Pure: no I/O, no clock (``now`` is an argument).
``ReportRules``, over the policy's ``Fleet`` and ``Issuer``, the ``AckRules`` (a running trainer
acknowledges its epoch) and the ``GrowRules`` (a saved checkpoint confirms a grow).

The latest report of each worker is kept for ``status`` (in memory: not persisted). A failure
that a restart in flight already covers is answered with that restart (``coalesced``); one of a
worker that runs no trainer of its job (``Fleet.in_play``: a free spare, a retired member)
restarts nothing, and neither does one of a job that runs nothing yet or any more (forming its
first membership, or held below MIN: ``idle``); the event says so.
"""

from __future__ import annotations

import msgspec

from marduk.core.acks import AckRules
from marduk.core.decisions import (
    Outcome,
    PolicyError,
    ReportResult,
    action_of,
    event_at,
    worker_event,
)
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.core.grow_policy import GrowRules
from marduk.core.issuer import Issuer
from marduk.core.membership_policy import held
from marduk.wire.protocol import Action, Report

# Reports that make the controller restart the worker's restart scope.
FAILURE_STATUSES = frozenset({"crashed", "hung", "gave_up", "preempted"})


class ReportRules:
    """What a report decides (see the module)."""

    def __init__(self, fleet: Fleet, issuer: Issuer, acks: AckRules, grow: GrowRules) -> None:
        self.fleet = fleet
        self.issuer = issuer
        self.acks = acks
        self.grow = grow

    def on_report(self, report: Report, now: float) -> ReportResult:
        """A supervisor reports its trainer's status; a failure restarts the worker's scope."""
        key = WorkerKey(report.job, report.replica, report.worker)
        if key not in self.fleet.workers:
            raise PolicyError("unknown_worker", f"worker {key} is not registered; register first")
        self.fleet.heard(key, now)
        previous = self.fleet.reports.get(key)
        started = report.status == "running" and (
            previous is None
            or previous.incarnation != report.incarnation
            or previous.status != "running"
        )
        if previous is not None and previous.failure_class and not report.failure_class:
            # Keep the last failure's class visible in status while the trainer runs again.
            report = msgspec.structs.replace(report, failure_class=previous.failure_class)
        self.fleet.reports[key] = report
        out = Outcome()
        if report.status == "running":
            out = self.acks.ack(key, report.epoch, now)
            if started:  # not a progress update of a trainer already announced
                out.events.append(worker_event("trainer_started", key, report, now))
            return ReportResult(out, [])
        if report.status not in FAILURE_STATUSES:
            out.events.append(worker_event(f"trainer_{report.status}", key, report, now))
            if report.status == "checkpointed":
                self.grow.checkpointed(key, now, out)
            return ReportResult(out, [])
        event = worker_event(f"worker_{report.status}", key, report, now)
        out.events.append(event)
        if why := self.idle(key):
            # Nobody of the job runs a trainer: a restart would restart nothing, and a held
            # job's members would be sent another command for it. The job forms as before.
            note = f"nothing restarted: {why}"
            event.detail = f"{event.detail}; {note}" if event.detail else note
            return ReportResult(out, [])
        if key not in self.fleet.in_play((key,)):
            # A spare (the job's own while free, or a pool's) or a retired worker runs no
            # trainer of the job: its agent stopping (preempted) restarts nobody. A spare
            # holding a lost member's ranks is a member, and restarts the job as any member.
            return ReportResult(out, [])
        return ReportResult(out, [self._restart(key, report, now, out)])

    def idle(self, key: WorkerKey) -> str:
        """Why the job of ``key`` runs no trainer ("" if it may): its ranks come from the
        controller and it has no membership, before its first (forming) or after falling below
        MIN (held)."""
        if self.fleet.workers[key].registration.rendezvous is None or self.fleet.pool_spare(key):
            return ""
        state = self.fleet.epochs.get(self.fleet.epoch_key(key))
        if state is not None and state.membership is not None:
            return ""
        if held(state):
            return f"job {key.job} is held below MIN (no membership: its trainers are stopped)"
        return f"job {key.job} is forming (no membership yet: no trainer started)"

    def _restart(self, key: WorkerKey, report: Report, now: float, out: Outcome) -> Action:
        """The worker's trainer failed: its scope restarts, unless a restart in flight covers
        the failure already."""
        ekey = self.fleet.epoch_key(key)
        state = self.fleet.epochs.get(ekey)
        current = state.epoch if state else 0
        pending = self.issuer.pending(ekey, now)
        if report.epoch < current or (pending and not self.fleet.scopes.inherited(ekey)):
            # A restart that covers this failure is already under way (one inherited from an
            # earlier term may have been applied already: the crash may come after it).
            assert state is not None
            kind = state.command.kind if state.command else "restart"
            return action_of(ekey, kind, current, coalesced=True)
        what = report.failure_class or report.status
        reason = f"worker {key} {report.status}"
        if report.summary:
            reason += f" ({what}: {report.summary})"
        command = self.issuer.issue(ekey, "restart", reason, [], f"report:{key}", now, out)
        out.events.append(event_at(ekey, "restart_issued", now, epoch=command.epoch, detail=reason))
        return action_of(ekey, "restart", command.epoch)
