"""Device health decisions: failures, merged notices, flap damping, quarantine and drain.

Part of the pure policy (no I/O, ``now`` passed in): ``DeviceRules``, over the policy's ``Fleet``
and ``Issuer``, the ``ServiceRules`` (flapping) and the membership's ``issue_or_replace`` and
``spends_budget``.

* A ``failed`` device restarts every scope using it (coalesced into a restart in flight, its
  device merged in at the command's next revision: covered only for the workers whose
  incarnation starts after it, ``marduk.core.acks``); past its failure budget the scopes get
  ``fail``.
* **Flap damping.** A device that goes (back) to ``failed`` more than ``flap_limit`` times in
  ``flap_window_s`` is quarantined, even if it reported ``healthy`` in between (which clears the
  failure budget, so without damping it would be restarted on forever).
* **Out of service** (quarantined, or drained by an operator; ``marduk.core.service_policy``):
  further events about it send nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import msgspec

from marduk.core.decisions import HealthResult, Outcome, action_of, scope_order
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet, out_of_service
from marduk.core.issuer import Issuer
from marduk.core.records import DeviceRecord, EpochKey, EpochRecord, MergedFailure
from marduk.core.service_policy import IssueOrReplace, ServiceRules
from marduk.wire.protocol import (
    CommandKind,
    ControllerEvent,
    DeviceHealth,
    HealthReply,
    clip_text,
)

MAX_MERGED_DEVICES = 64
"""Devices one command lists at most: a failure past it takes a new epoch instead of merging."""


class SpendsBudget(Protocol):
    """Would a failure of ``device`` now spend its budget in the job ``ekey`` with a membership,
    the command in flight not listing it yet (``MembershipRules.spends_budget``)? Then it takes
    a new epoch, where the member leaves, instead of joining the restart in flight."""

    def __call__(self, ekey: EpochKey, device: str, now: float) -> bool: ...


class DeviceRules:
    """Health events: what each means for the scopes using the device (see the module)."""

    def __init__(
        self,
        fleet: Fleet,
        issuer: Issuer,
        service: ServiceRules,
        issue_or_replace: IssueOrReplace,
        spends_budget: SpendsBudget,
    ) -> None:
        self.fleet = fleet
        self.issuer = issuer
        self.service = service
        self.issue_or_replace = issue_or_replace
        self.spends_budget = spends_budget
        # Recent events' replies, oldest first, to answer a repeated event as a duplicate.
        self.recent: OrderedDict[str, HealthReply] = OrderedDict()

    def remember(self, reply: HealthReply) -> None:
        """A handled event, kept for the dedup window (``dedup_capacity`` events)."""
        self.recent[reply.event_id] = reply
        while len(self.recent) > self.fleet.config.dedup_capacity:
            self.recent.popitem(last=False)

    # --- health events ---------------------------------------------------------------------------

    def on_health(self, event: DeviceHealth, now: float) -> HealthResult:
        """Decide what a health event means. ``event.event_id`` must be set (the shell does)."""
        seen = self.recent.get(event.event_id)
        if seen is not None:
            dup = msgspec.structs.replace(seen, duplicate=True)
            return HealthResult(Outcome(), dup)

        out = Outcome()
        fleet = self.fleet
        workers = fleet.drmap.workers_for_device(event.device)
        record = fleet.devices.get(event.device)
        known = bool(workers) or (record is not None and out_of_service(record))
        reply = HealthReply(
            event_id=event.event_id, device=event.device, state=event.state, known=known
        )
        if not known:
            # Unknown devices are reported; no device record is kept (junk input must not grow
            # the state); only the event id is, for the dedup window.
            out.events.append(
                ControllerEvent(
                    kind="unknown_device",
                    ts=now,
                    device=event.device,
                    event_id=event.event_id,
                    detail=f"{event.state} from {event.source or '?'}: no replica uses it",
                )
            )
            return self._handled(reply, out)

        device, previous = self._record(event, now)
        if event.state == "failed" and previous != "failed" and not out_of_service(device):
            self.service.note_flip(device, now, out, reply)

        acts = event.state == "failed" or (
            event.state == "degraded" and fleet.config.restart_on_degraded
        )
        if event.state == "preempting" and workers and not out_of_service(device):
            self._request_checkpoint(event, workers, now, out, reply)
        elif out_of_service(device):
            # Its replicas got `fail` when it went out of service: nothing more to send.
            detail = f"{event.reason} (out of service: {device.out_reason})".strip()
            out.events.append(self._device_event(event, now, detail))
        elif acts and (playing := fleet.in_play(workers)):
            self._restart_for_device(event, device, playing, now, out, reply)
        else:
            detail = (event.reason or "") + ("" if workers else " (no replica uses it)")
            out.events.append(self._device_event(event, now, detail))
        out.put_devices.append(device)
        return self._handled(reply, out)

    def _record(self, event: DeviceHealth, now: float) -> tuple[DeviceRecord, str]:
        """The device's record, in the event's state (a healthy one clears its failure budget),
        and the state it was in."""
        device = self.fleet.devices.get(event.device) or DeviceRecord(device=event.device)
        previous = device.state
        device.state, device.reason = event.state, event.reason
        if previous != event.state or not device.since:
            device.since = now
        if event.state == "healthy":
            device.failures = []
        self.fleet.devices[event.device] = device
        return device, previous

    def _handled(self, reply: HealthReply, out: Outcome) -> HealthResult:
        """The event is decided: remembered for the dedup window, and persisted with ``out``."""
        self.remember(reply)
        out.handled.append(reply)
        return HealthResult(out, reply)

    @staticmethod
    def _device_event(event: DeviceHealth, now: float, detail: str) -> ControllerEvent:
        return ControllerEvent(
            kind=f"device_{event.state}",
            ts=now,
            device=event.device,
            event_id=event.event_id,
            detail=detail,
        )

    @staticmethod
    def _health_event(
        kind: str, ekey: EpochKey, event: DeviceHealth, epoch: int, now: float, detail: str
    ) -> ControllerEvent:
        """An event about a scope, decided for the health event ``event``."""
        return ControllerEvent(
            kind=kind,
            ts=now,
            job=ekey.job,
            replica=ekey.replica,
            device=event.device,
            event_id=event.event_id,
            epoch=epoch,
            detail=detail,
        )

    def _restart_for_device(
        self,
        event: DeviceHealth,
        device: DeviceRecord,
        workers: frozenset[WorkerKey],
        now: float,
        out: Outcome,
        reply: HealthReply,
    ) -> None:
        scopes = sorted({self.fleet.epoch_key(w) for w in workers}, key=scope_order)
        fresh = self._fresh(scopes, event, workers, now)
        kind: CommandKind = "restart"
        if fresh:
            config = self.fleet.config
            window = config.device_failure_window_s
            device.failures = [t for t in device.failures if now - t < window] + [now]
            if len(device.failures) > config.device_max_failures:
                kind = "fail"
        reason = f"device {event.device} {event.state}"
        if event.reason:
            reason += f": {event.reason}"
        for ekey in scopes:
            if ekey not in fresh:
                self._coalesce(ekey, event, reason, now, out, reply)
                continue
            affected = sorted(w for w in workers if self.fleet.epoch_key(w) == ekey)
            command = self.issue_or_replace(
                ekey, kind, reason, [event.device], event.event_id, now, out
            )
            if command is None:
                continue
            reply.actions.append(action_of(ekey, command.kind, command.epoch))
            out.events.append(
                self._health_event(
                    f"{command.kind}_issued",
                    ekey,
                    event,
                    command.epoch,
                    now,
                    reason + f" (affects {', '.join(str(w) for w in affected)})",
                )
            )

    def _fresh(
        self,
        scopes: list[EpochKey],
        event: DeviceHealth,
        workers: frozenset[WorkerKey],
        now: float,
    ) -> list[EpochKey]:
        """The scopes that take a new epoch for the event; the others join the restart in
        flight."""
        # A scope takes a new epoch unless a restart is in flight that none of the workers on
        # this device has confirmed yet: one that already restarted would otherwise be told
        # of the failure only as an update of an epoch it applied, and keep running on it.
        # A restart in flight inherited from an earlier term (read from the store) is no
        # reason either: its workers' acks were not persisted, so they may have applied it
        # (failures coalesced into it after a takeover would never be acted on).
        # Nor one whose member this failure takes out (its device's budget spent): merged, it
        # would be neither counted nor acted on (``spends_budget``, the membership's).
        # But a scope whose last command was issued for this very event has acted on it,
        # applied or not: the event is a redelivery (its dedup record was never written, the
        # leader died first), and joins that command rather than restarting the scope again.
        return [
            k
            for k in scopes
            if not self._issued_for(k, event.event_id)
            and (
                not self.issuer.pending(k, now)
                or self.fleet.scopes.inherited(k)
                or self._confirmed_on(k, event.device, workers)
                or self._merge_full(k, event.device)
                or self.spends_budget(k, event.device, now)
            )
        ]

    def _coalesce(
        self,
        ekey: EpochKey,
        event: DeviceHealth,
        reason: str,
        now: float,
        out: Outcome,
        reply: HealthReply,
    ) -> None:
        """The failure joins the scope's restart in flight (its device merged in)."""
        state = self.fleet.epochs[ekey]
        command = state.command
        assert command is not None
        self._merge_device(ekey, state, event, reason, now, out)
        reply.actions.append(action_of(ekey, command.kind, state.epoch, coalesced=True))
        merged = state.command
        assert merged is not None
        out.events.append(
            self._health_event(
                "coalesced",
                ekey,
                event,
                state.epoch,
                now,
                f"{merged.kind} at epoch {state.epoch} already in flight; "
                f"devices {', '.join(merged.devices) or '-'}",
            )
        )

    def _merge_device(
        self,
        ekey: EpochKey,
        state: EpochRecord,
        event: DeviceHealth,
        reason: str,
        now: float,
        out: Outcome,
    ) -> None:
        """A failure joins the restart in flight: its command at the next revision, the device
        merged in, sent again.

        Same epoch (agents act once per epoch), so the scope hears of every failed device
        without a second restart. A repeat of a device already listed is a failure too (it
        may come after a worker's new trainer started): it moves the revision, though the
        devices stay, and goes out with the next resend (``tick``), not at once: a storm of
        repeats sends at most one command a resend interval per scope. Each merge is kept
        (``EpochRecord.merged``, persisted): a worker whose incarnation started at a lower
        revision was not covered by it, and its ack restarts it again (``AckRules``). The
        event the command was issued for (a redelivery) changes nothing.
        """
        command = state.command
        assert command is not None
        if event.event_id and event.event_id == command.event_id:
            return
        device = event.device
        revision = command.revision + 1
        repeat = device in command.devices
        if repeat:
            merged = msgspec.structs.replace(command, revision=revision)
        else:
            merged = msgspec.structs.replace(
                command,
                devices=[*command.devices, device],
                reason=clip_text(command.reason + "; " + reason),
                revision=revision,
            )
        state.command = merged
        state.merged = [m for m in state.merged if m.device != device]
        state.merged.append(
            MergedFailure(device=device, revision=revision, event_id=event.event_id)
        )
        if not repeat:
            out.resent.append(merged)
            self.fleet.scopes.sent(ekey, now)
        if state not in out.write_ahead and state not in out.put_epochs:
            out.put_epochs.append(state)

    def _issued_for(self, ekey: EpochKey, event_id: str) -> bool:
        """Was the scope's last command issued for the event ``event_id``?"""
        state = self.fleet.epochs.get(ekey)
        command = state.command if state is not None else None
        return command is not None and bool(event_id) and command.event_id == event_id

    def _merge_full(self, ekey: EpochKey, device: str) -> bool:
        """Would merging ``device`` make the command in flight list too many devices?"""
        command = self.fleet.epochs[ekey].command
        return (
            command is not None
            and device not in command.devices
            and len(command.devices) >= MAX_MERGED_DEVICES
        )

    def _confirmed_on(self, ekey: EpochKey, device: str, workers: frozenset[WorkerKey]) -> bool:
        """Has a worker of scope ``ekey`` that uses ``device`` confirmed the current epoch?"""
        epoch = self.fleet.epochs[ekey].epoch
        return any(
            self.fleet.epoch_key(w) == ekey and self.fleet.workers[w].applied_epoch >= epoch
            for w in workers
        )

    def _request_checkpoint(
        self,
        event: DeviceHealth,
        workers: frozenset[WorkerKey],
        now: float,
        out: Outcome,
        reply: HealthReply,
    ) -> None:
        """Pathways-style: the host is about to go away; every scope on it saves now.

        A ``checkpoint`` command at a new epoch (agents apply it once), not held pending: a
        failure meanwhile still restarts. A notice for another device of the same host within
        the window is coalesced into the checkpoint already asked for.
        """
        reason = f"device {event.device} preempting" + (f": {event.reason}" if event.reason else "")
        for ekey in sorted({self.fleet.epoch_key(w) for w in workers}, key=scope_order):
            state = self.fleet.epochs.get(ekey)
            command = state.command if state is not None else None
            if (
                state is not None
                and command is not None
                and command.kind == "checkpoint"
                and now - state.issued_at < self.fleet.config.pending_timeout_s
            ):
                reply.actions.append(action_of(ekey, "checkpoint", state.epoch, coalesced=True))
                continue
            command = self.issuer.issue(
                ekey, "checkpoint", reason, [event.device], event.event_id, now, out, pending=False
            )
            reply.actions.append(action_of(ekey, "checkpoint", command.epoch))
            out.events.append(
                self._health_event(
                    "checkpoint_issued",
                    ekey,
                    event,
                    command.epoch,
                    now,
                    reason,
                )
            )
