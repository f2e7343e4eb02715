"""Time passing (``Policy.tick``, about four times a second): silent workers go stale, then
expire; vacant scopes' epoch records are dropped after the retention; memberships waiting for
MIN workers or a grow move on; unconfirmed commands are resent. Pure: no I/O, no clock (``now``
is an argument). ``TickRules``, over the policy's ``Fleet`` and ``Issuer``, the membership's
and the grow's rules.

Liveness: a worker silent for ``worker_ttl_s`` is ``stale`` (it no longer holds a restart of
its scope pending, and a member leaves its job's membership); silent for ``worker_expiry_s`` it
is removed. Only workers silent for a TTL are looked at (``Fleet.last_seen`` is kept in order of
last heard), not all of them.
"""

from __future__ import annotations

from marduk.core.decisions import Outcome, event_at
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.core.grow_policy import GrowRules
from marduk.core.issuer import Issuer
from marduk.core.membership_policy import MembershipRules


class TickRules:
    """What time passing decides (see the module)."""

    def __init__(
        self, fleet: Fleet, issuer: Issuer, membership: MembershipRules, grow: GrowRules
    ) -> None:
        self.fleet = fleet
        self.issuer = issuer
        self.membership = membership
        self.grow = grow

    def tick(self, now: float) -> Outcome:
        """Time passes: silent workers go stale, then expire; unconfirmed commands are resent."""
        out = Outcome()
        newly_stale = self._silent(now, out)
        self.membership.lose_silent(newly_stale, now, out)
        self._drop_vacant_epochs(now, out)
        self.membership.tick(now, out)
        self.grow.tick(newly_stale, now, out)
        self._resend(now, out)
        return out

    def _silent(self, now: float, out: Outcome) -> list[WorkerKey]:
        """Workers silent for the TTL go stale (those returned), for the expiry are removed."""
        fleet = self.fleet
        ttl, expiry = fleet.config.worker_ttl_s, fleet.config.worker_expiry_s
        silent_ones = []
        for key, seen in fleet.last_seen.items():  # oldest first
            if now - seen < ttl:
                # Everyone after was heard from later. (Should the wall clock step back, a
                # worker heard from just after is found silent when those ahead of it are.)
                break
            silent_ones.append((key, seen))
        newly_stale: list[WorkerKey] = []
        for key, seen in silent_ones:
            silent = now - seen
            if silent >= expiry:
                fleet.remove_worker(key, out, now)
                self.grow.left(key)
                detail = f"silent for {silent:.0f}s; removed from the map"
                out.events.append(event_at(key, "worker_expired", now, detail=detail))
            elif silent >= ttl and key not in fleet.stale:
                fleet.stale.add(key)
                # A silent worker must not hold a restart of its scope pending.
                fleet.scopes.confirm(fleet.epoch_key(key), key)
                detail = f"no renewal for {silent:.0f}s (TTL {ttl:g}s)"
                out.events.append(event_at(key, "worker_stale", now, detail=detail))
                newly_stale.append(key)
        return newly_stale

    def _drop_vacant_epochs(self, now: float, out: Outcome) -> None:
        """Epoch records of scopes vacant for ``epoch_retention_s`` are deleted, so the state
        bucket does not keep every job ever run. Safe: a worker that comes back later with an
        epoch it saw has it adopted at registration (the next command is above it), and a new
        process starts after every command of the old ones."""
        fleet = self.fleet
        retention = fleet.config.epoch_retention_s
        for ekey in fleet.scopes.vacant_for(retention, now):
            if fleet.scope_workers(ekey) or not fleet.scopes.drop(ekey):
                continue
            if ekey.replica is None:  # its membership goes: so do its members' entries
                fleet.sizes.settle(ekey.job, None)
            out.deleted_epochs.append(ekey)
            detail = f"no worker for {retention:g}s: the scope's epoch record is deleted"
            out.events.append(event_at(ekey, "epochs_dropped", now, detail=detail))

    def _resend(self, now: float, out: Outcome) -> None:
        """Commands of scopes whose live workers have not all confirmed, once a second."""
        fleet = self.fleet
        for ekey in fleet.scopes.due(now, fleet.config.resend_interval_s):
            state = fleet.epochs.get(ekey)
            if state is None or state.command is None or not self.issuer.pending(ekey, now):
                continue
            out.resent.append(state.command)
            fleet.scopes.sent(ekey, now)
