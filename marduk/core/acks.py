"""Acknowledgements: a worker acted on an epoch. Pure: no I/O, no clock (``now`` is an
argument). ``AckRules``, over the policy's ``Fleet`` and ``Issuer``.

An ack confirms the scope's epoch for its worker (a restart in flight waits for no one else once
every live worker has). **A failure is covered by a restart only if that restart's incarnation
starts after the failure.** Only the agent knows when its incarnation started, so it says so
without a clock: each failure merged into the restart in flight moves its command's revision
(``marduk.core.device_policy``), an update that reaches the agent before its new trainer starts
is taken in, and the ack says the revision the incarnation started with. A failure of one of
the worker's devices merged at a higher revision came after that start: the worker's scope is
restarted again at a new epoch. An agent older than the revision says the devices it knew
instead (a device merged that it did not know); one that says neither is taken at its word.

Acks are not persisted: after a controller restart agents re-register (on its hello) with the
epoch they acknowledged and its revision, which rebuilds them and is checked the same way
(``RegistrationRules``), so the thousands of acks of a job-wide restart queue no write.
"""

from __future__ import annotations

from collections.abc import Sequence

from marduk.core.decisions import Outcome, event_at
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.core.issuer import Issuer
from marduk.core.records import EpochKey, EpochRecord, MergedFailure, WorkerRecord


class AckRules:
    """What an ack changes (see the module)."""

    def __init__(self, fleet: Fleet, issuer: Issuer) -> None:
        self.fleet = fleet
        self.issuer = issuer

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
        if state is not None and epoch == state.epoch:
            self.restart_uncovered(ekey, rec, now, out, revision=revision, devices=devices)
        return out

    def restart_uncovered(
        self,
        ekey: EpochKey,
        rec: WorkerRecord,
        now: float,
        out: Outcome,
        *,
        revision: int | None,
        devices: Sequence[str] | None = None,
    ) -> None:
        """The worker runs the scope's current epoch, its incarnation started at ``revision``
        (or knowing ``devices``): failures of its devices merged into the restart after that
        came after its trainer started, so the restart did not cover them. A new epoch does."""
        state = self.fleet.epochs[ekey]
        command = state.command
        if command is None or command.kind != "restart":
            return
        mine = set(rec.registration.devices)
        if revision is not None:
            late = [m for m in state.merged if m.revision > revision and m.device in mine]
            since = f"its incarnation started at revision {revision} of {command.revision}"
        elif devices is not None:
            known = set(devices)
            late = [m for m in uncovered_by_devices(state) if m.device in mine - known]
            since = "it acted knowing only " + (", ".join(sorted(known)) or "no device")
        else:
            return
        if not late:
            return
        self._restart_again(ekey, state, rec, late, since, now, out)

    def _restart_again(
        self,
        ekey: EpochKey,
        state: EpochRecord,
        rec: WorkerRecord,
        late: list[MergedFailure],
        since: str,
        now: float,
        out: Outcome,
    ) -> None:
        reg = rec.registration
        worker = WorkerKey(reg.job, reg.replica, reg.worker)
        names = list(dict.fromkeys(m.device for m in late))
        reason = (
            f"device(s) {', '.join(names)} failed while {worker} was restarting for epoch "
            f"{state.epoch}"
        )
        # Issued for the last failure not covered: the one the scope's restart answers now.
        cause = max(late, key=lambda m: m.revision).event_id
        issued = self.issuer.issue(ekey, "restart", reason, names, cause, now, out)
        out.events.append(
            event_at(
                ekey,
                "restart_issued",
                now,
                worker=reg.worker,
                device=names[0],
                epoch=issued.epoch,
                detail=f"{reason} (merged after it acted: {since})",
            )
        )


def uncovered_by_devices(state: EpochRecord) -> list[MergedFailure]:
    """The devices the scope's command lists, each as a merge (revision 0: listed when it was
    issued, or merged by a leader that kept no record of merges), for an ack that says only
    which devices it knew."""
    command = state.command
    merged = {m.device: m for m in state.merged}
    devices = command.devices if command is not None else []
    return [merged.get(d) or MergedFailure(device=d, revision=0) for d in devices]
