"""Issuing a command: a new epoch for a restart scope, written ahead past its ceiling, the
membership it carries, who must confirm it, and the peer notices it sends. Pure: no I/O, no
clock (``now`` is an argument). Every rule set that commands goes through one ``Issuer``.

Epochs (docs/decisions.md #3): each scope's epoch only increases; commands up to the scope's
reserved ceiling need no write of their own, one above it reserves the next block first
(``Outcome.write_ahead``). A restart is *pending* while live workers have not confirmed it and
for at most ``pending_timeout_s``: further failures of the scope coalesce into it, and ``tick``
resends it.

A command that carries a membership is as large as its job (about 105 bytes a node with usual
names: 107 KB at ``MAX_MEMBERS``) and is sent whole with every resend and registration reply:
one encoding past ``COMMAND_BUDGET`` (agents refuse a message over ``MAX_MESSAGE_BYTES``) is
announced when issued (event ``command_oversized``), not found when published or decoded. The
worker whose entry could make it so is refused at its first registration
(``MembershipRules.check_size``, ``command_size``); this is the backstop for what admission
lets by (a worker back under its name with a longer address, a pool's spare).
"""

from __future__ import annotations

from marduk.core import membership as rdzv
from marduk.core.command_size import COMMAND_BUDGET
from marduk.core.decisions import Outcome, event_at
from marduk.core.fleet import Fleet
from marduk.core.notices import failed_peers, peer_notices
from marduk.core.records import EpochKey, EpochRecord
from marduk.wire.protocol import (
    MAX_MESSAGE_BYTES,
    Command,
    CommandKind,
    Membership,
    clip_text,
    encode,
)

__all__ = ["COMMAND_BUDGET", "Issuer"]


class Issuer:
    """Issues the commands of every rule set over one ``Fleet``."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def issue(
        self,
        ekey: EpochKey,
        kind: CommandKind,
        reason: str,
        devices: list[str],
        cause: str,
        now: float,
        out: Outcome,
        *,
        pending: bool = True,
        membership: Membership | None = None,
    ) -> Command:
        """A new epoch for ``ekey`` and its command. ``pending``: a restart the scope's workers
        must confirm (coalescing further failures, resent until then); a checkpoint is not.
        ``membership``: the job's first (else a restart renews the one in force)."""
        fleet = self.fleet
        epoch = fleet.scopes.next_epoch(ekey)
        state = fleet.epochs.get(ekey) or EpochRecord(job=ekey.job, replica=ekey.replica)
        if epoch > state.ceiling:
            state.ceiling = epoch + fleet.config.epoch_block - 1
            out.write_ahead.append(state)
        membership = membership or self._next_membership(ekey, state, kind, epoch)
        if membership is not state.membership:
            # Who takes part at this epoch must be durable before anyone is told: a leader
            # taking over mid-change starts from it, never from a membership nobody saw.
            state.membership = membership
            if state not in out.write_ahead:
                out.write_ahead.append(state)
        command = Command(
            command_id=f"{ekey.job}/{ekey.replica or '*'}/{epoch}",
            job=ekey.job,
            replica=ekey.replica,
            scope="job" if ekey.replica is None else "replica",
            kind=kind,
            epoch=epoch,
            reason=clip_text(reason),
            devices=devices,
            event_id=cause,
            issued_at=now,
            membership=state.membership,
            retired=fleet.retired(ekey),
        )
        state.epoch, state.issued_at, state.command = epoch, now, command
        state.merged = []  # a new incarnation: nothing merged into it yet
        if kind == "checkpoint":
            state.checkpoints += 1
        fleet.scopes.put(ekey, state)
        if ekey.replica is None:  # members gone keep their entries while it lists them
            fleet.sizes.settle(ekey.job, state.membership)
        fleet.scopes.issued(ekey, fleet.live_takers(ekey, state) if pending else None, now)
        out.commands.append(command)
        if command.membership is not None or command.retired:
            self._check_size(ekey, command, now, out)
        if state not in out.write_ahead:
            out.put_epochs.append(state)
        if kind in ("restart", "fail") and ekey.replica is not None:
            self._notify_peers(ekey.job, now, out)
        return command

    def pending(self, ekey: EpochKey, now: float) -> bool:
        """Is the scope's restart in flight: unconfirmed, and issued under the timeout ago?"""
        state = self.fleet.epochs.get(ekey)
        if state is None or not self.fleet.scopes.in_flight(ekey):
            return False
        return now - state.issued_at < self.fleet.config.pending_timeout_s

    def _check_size(self, ekey: EpochKey, command: Command, now: float, out: Outcome) -> None:
        """Announce a command too large for its agents to read (``COMMAND_BUDGET``): it is
        still sent (nothing smaller would do: every member needs the whole membership), but the
        operator learns of it now, with what to shorten, not from agents refusing it."""
        size = len(encode(command))
        if size <= COMMAND_BUDGET:
            return
        nodes = len(command.membership.members) if command.membership is not None else 0
        detail = (
            f"the {command.kind} at epoch {command.epoch} encodes to {size} bytes, over the "
            f"{COMMAND_BUDGET}-byte budget of a command (agents refuse messages over "
            f"{MAX_MESSAGE_BYTES} bytes as oversized): its membership lists {nodes} node(s), "
            f"{len(command.retired)} retired worker(s); shorten the agents' --local-addr and "
            "replica names, or run fewer nodes per job"
        )
        out.events.append(
            event_at(ekey, "command_oversized", now, epoch=command.epoch, detail=detail)
        )

    def _next_membership(
        self, ekey: EpochKey, state: EpochRecord, kind: CommandKind, epoch: int
    ) -> Membership | None:
        """A restart of a job with a membership renews it (same members, a new coordinator
        port); other commands carry the one in force."""
        if kind != "restart" or state.membership is None or ekey.replica is not None:
            return state.membership
        return rdzv.renew(state.membership, epoch, ekey.job, self.fleet.candidates(ekey.job))

    def _notify_peers(self, job: str, now: float, out: Outcome) -> None:
        """The notices of ``out`` for ``job``, made again from all of its commands so far (a
        decision may restart several replicas of the job: each notice names them all)."""
        recipients = self.fleet.notice_replicas(job)
        if not recipients:
            return
        peers = failed_peers(job, out.commands)
        reason = "; ".join(
            f"{c.replica} {c.kind} at epoch {c.epoch}: {c.reason}"
            for c in out.commands
            if c.job == job and c.replica is not None and c.kind in ("restart", "fail")
        )
        out.notices = [n for n in out.notices if n.job != job]
        out.notices.extend(peer_notices(job, recipients, peers, reason, now))
