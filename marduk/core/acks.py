"""Acknowledgements: a worker acted on an epoch. Pure: no I/O, no clock (``now`` is an
argument). ``AckRules``, over the policy's ``Fleet`` and ``Issuer``.

An ack confirms the scope's epoch for its worker (a restart in flight waits for no one else once
every live worker has). A failure merged into the restart in flight after the worker acted (its
ack lists the devices it knew) did not cover it: the worker is restarted again at a new epoch.
Acks are not persisted: after a controller restart agents re-register (on its hello) with the
epoch they acknowledged, which rebuilds them, so the thousands of acks of a job-wide restart
queue no write.
"""

from __future__ import annotations

from collections.abc import Sequence

from marduk.core.decisions import Outcome, event_at
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.core.issuer import Issuer
from marduk.core.records import EpochKey, EpochRecord, WorkerRecord


class AckRules:
    """What an ack changes (see the module)."""

    def __init__(self, fleet: Fleet, issuer: Issuer) -> None:
        self.fleet = fleet
        self.issuer = issuer

    def ack(
        self, key: WorkerKey, epoch: int, now: float, *, devices: Sequence[str] | None = None
    ) -> Outcome:
        """A worker acted on ``epoch``, knowing its command's ``devices`` (None: not said)."""
        out = Outcome()
        rec = self.fleet.workers.get(key)
        if rec is not None:
            self.fleet.heard(key, now)
        if rec is None or epoch <= rec.applied_epoch:
            return out
        rec.applied_epoch = epoch
        rec.updated_at = now
        ekey = self.fleet.epoch_key_of(rec)
        state = self.fleet.epochs.get(ekey)
        if state is not None and epoch >= state.epoch:
            self.fleet.scopes.confirm(ekey, key)
        if state is not None and devices is not None and epoch == state.epoch:
            self._restart_if_acted_too_early(ekey, state, rec, devices, now, out)
        return out

    def _restart_if_acted_too_early(
        self,
        ekey: EpochKey,
        state: EpochRecord,
        rec: WorkerRecord,
        acted_on: Sequence[str],
        now: float,
        out: Outcome,
    ) -> None:
        """A failure of one of this worker's devices was merged into the restart in flight
        after the worker had acted on it (its ack was on its way): its trainer may have
        started before that failure, so the merge did not cover it. A new epoch does."""
        command = state.command
        if command is None or command.kind != "restart":
            return
        mine = set(rec.registration.devices)
        late = [d for d in command.devices if d in mine and d not in acted_on]
        if not late:
            return
        reg = rec.registration
        worker = WorkerKey(reg.job, reg.replica, reg.worker)
        reason = (
            f"device(s) {', '.join(late)} failed while {worker} was restarting for epoch "
            f"{state.epoch}"
        )
        issued = self.issuer.issue(ekey, "restart", reason, late, "", now, out)
        out.events.append(
            event_at(
                ekey,
                "restart_issued",
                now,
                worker=reg.worker,
                device=late[0],
                epoch=issued.epoch,
                detail=reason + " (merged after it acted)",
            )
        )
