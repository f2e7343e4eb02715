"""Device health decisions: failures, merged notices, flap damping, quarantine and drain.

Part of the pure policy (no I/O, ``now`` passed in); ``marduk.core.policy.Policy`` mixes it in and
holds the state it works on.

* A ``failed`` device restarts every scope using it (coalesced into a restart in flight, its
  device merged in); past its failure budget the scopes get ``fail``.
* **Flap damping.** A device that goes (back) to ``failed`` more than ``flap_limit`` times in
  ``flap_window_s`` is quarantined, even if it reported ``healthy`` in between (which clears the
  failure budget, so without damping it would be restarted on forever).
* **Out of service** (quarantined, or drained by an operator; ``marduk.core.service_policy``):
  further events about it send nothing.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from marduk.core.decisions import (
    HealthResult,
    Outcome,
    PolicyConfig,
    scope_order,
)
from marduk.core.drmap import DRMap, WorkerKey
from marduk.core.records import DeviceRecord, EpochKey, EpochRecord, WorkerRecord
from marduk.core.scopes import Scopes
from marduk.core.service_policy import ServicePolicy
from marduk.wire.protocol import (
    Action,
    Command,
    CommandKind,
    ControllerEvent,
    DeviceHealth,
    HealthReply,
)

MAX_MERGED_DEVICES = 64
"""Devices one command lists at most: a failure past it takes a new epoch instead of merging."""


class DevicePolicy(ServicePolicy):
    """The device half of ``Policy`` (state and helpers declared here, defined there)."""

    config: PolicyConfig
    drmap: DRMap
    devices: dict[str, DeviceRecord]
    scopes: Scopes
    workers: dict[WorkerKey, WorkerRecord]
    last_seen: dict[WorkerKey, float]
    stale: set[WorkerKey]
    _recent_events: OrderedDict[str, HealthReply]

    @property
    def epochs(self) -> dict[EpochKey, EpochRecord]:
        """Every scope's epoch record (read it; the policy changes it through ``scopes``)."""
        return self.scopes.records

    def _epoch_key(self, key: WorkerKey) -> EpochKey:
        raise NotImplementedError

    def _pending(self, ekey: EpochKey, now: float) -> bool:
        raise NotImplementedError

    def _remember(self, reply: HealthReply) -> None:
        raise NotImplementedError

    def _in_play(self, workers: frozenset[WorkerKey]) -> frozenset[WorkerKey]:
        raise NotImplementedError

    def _issue(
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
    ) -> Command:
        raise NotImplementedError

    # --- health events ---------------------------------------------------------------------------

    def on_health(self, event: DeviceHealth, now: float) -> HealthResult:
        """Decide what a health event means. ``event.event_id`` must be set (the shell does)."""
        seen = self._recent_events.get(event.event_id)
        if seen is not None:
            dup = msgspec.structs.replace(seen, duplicate=True)
            return HealthResult(Outcome(), dup)

        out = Outcome()
        workers = self.drmap.workers_for_device(event.device)
        record = self.devices.get(event.device)
        known = bool(workers) or (record is not None and self.out_of_service(record))
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
            self._remember(reply)
            out.handled.append(reply)
            return HealthResult(out, reply)

        device = self.devices.get(event.device) or DeviceRecord(device=event.device)
        previous = device.state
        device.state, device.reason = event.state, event.reason
        if previous != event.state or not device.since:
            device.since = now
        if event.state == "healthy":
            device.failures = []
        self.devices[event.device] = device
        if event.state == "failed" and previous != "failed" and not self.out_of_service(device):
            self._note_flip(device, now, out, reply)

        acts = event.state == "failed" or (
            event.state == "degraded" and self.config.restart_on_degraded
        )
        if event.state == "preempting" and workers and not self.out_of_service(device):
            self._request_checkpoint(event, workers, now, out, reply)
        elif self.out_of_service(device):
            # Its replicas got `fail` when it went out of service: nothing more to send.
            out.events.append(
                ControllerEvent(
                    kind=f"device_{event.state}",
                    ts=now,
                    device=event.device,
                    event_id=event.event_id,
                    detail=f"{event.reason} (out of service: {device.out_reason})".strip(),
                )
            )
        elif acts and (playing := self._in_play(workers)):
            self._restart_for_device(event, device, playing, now, out, reply)
        else:
            out.events.append(
                ControllerEvent(
                    kind=f"device_{event.state}",
                    ts=now,
                    device=event.device,
                    event_id=event.event_id,
                    detail=(event.reason or "") + ("" if workers else " (no replica uses it)"),
                )
            )
        out.put_devices.append(device)
        self._remember(reply)
        out.handled.append(reply)
        return HealthResult(out, reply)

    def _restart_for_device(
        self,
        event: DeviceHealth,
        device: DeviceRecord,
        workers: frozenset[WorkerKey],
        now: float,
        out: Outcome,
        reply: HealthReply,
    ) -> None:
        scopes = sorted({self._epoch_key(w) for w in workers}, key=scope_order)
        # A scope takes a new epoch unless a restart is in flight that none of the workers on
        # this device has confirmed yet: one that already restarted would otherwise be told
        # of the failure only as an update of an epoch it applied, and keep running on it.
        # A restart in flight inherited from an earlier term (read from the store) is no
        # reason either: its workers' acks were not persisted, so they may have applied it
        # (failures coalesced into it after a takeover would never be acted on).
        # But a scope whose last command was issued for this very event has acted on it,
        # applied or not: the event is a redelivery (its dedup record was never written, the
        # leader died first), and joins that command rather than restarting the scope again.
        fresh = [
            k
            for k in scopes
            if not self._issued_for(k, event.event_id)
            and (
                not self._pending(k, now)
                or self.scopes.inherited(k)
                or self._confirmed_on(k, event.device, workers)
                or self._merge_full(k, event.device)
            )
        ]
        kind: CommandKind = "restart"
        if fresh:
            window = self.config.device_failure_window_s
            device.failures = [t for t in device.failures if now - t < window] + [now]
            if len(device.failures) > self.config.device_max_failures:
                kind = "fail"
        reason = f"device {event.device} {event.state}"
        if event.reason:
            reason += f": {event.reason}"
        for ekey in scopes:
            if ekey not in fresh:
                state = self.epochs[ekey]
                assert state.command is not None
                self._merge_device(ekey, state, event.device, reason, now, out)
                reply.actions.append(
                    Action(
                        job=ekey.job,
                        replica=ekey.replica,
                        kind=state.command.kind,
                        epoch=state.epoch,
                        coalesced=True,
                    )
                )
                out.events.append(
                    ControllerEvent(
                        kind="coalesced",
                        ts=now,
                        job=ekey.job,
                        replica=ekey.replica,
                        device=event.device,
                        event_id=event.event_id,
                        epoch=state.epoch,
                        detail=f"{state.command.kind} at epoch {state.epoch} already in flight; "
                        f"devices {', '.join(state.command.devices) or '-'}",
                    )
                )
                continue
            affected = sorted(w for w in workers if self._epoch_key(w) == ekey)
            issued = self._issue_or_replace(
                ekey, kind, reason, [event.device], event.event_id, now, out
            )
            if issued is None:
                continue
            command = issued
            reply.actions.append(
                Action(job=ekey.job, replica=ekey.replica, kind=command.kind, epoch=command.epoch)
            )
            out.events.append(
                ControllerEvent(
                    kind=f"{command.kind}_issued",
                    ts=now,
                    job=ekey.job,
                    replica=ekey.replica,
                    device=event.device,
                    event_id=event.event_id,
                    epoch=command.epoch,
                    detail=reason + f" (affects {', '.join(str(w) for w in affected)})",
                )
            )

    def _merge_device(
        self, ekey: EpochKey, state: EpochRecord, device: str, reason: str, now: float, out: Outcome
    ) -> None:
        """A failure joins the restart in flight: send it again with the device merged in.

        Same epoch (agents act once per epoch), so the scope hears of every failed device
        without a second restart; repeats of a device already listed send nothing.
        """
        command = state.command
        assert command is not None
        if device in command.devices:
            return
        merged = msgspec.structs.replace(
            command,
            devices=[*command.devices, device],
            reason=(command.reason + "; " + reason)[:4000],
        )
        state.command = merged
        out.resent.append(merged)
        self.scopes.sent(ekey, now)
        if state not in out.write_ahead and state not in out.put_epochs:
            out.put_epochs.append(state)

    def _issued_for(self, ekey: EpochKey, event_id: str) -> bool:
        """Was the scope's last command issued for the event ``event_id``?"""
        state = self.epochs.get(ekey)
        command = state.command if state is not None else None
        return command is not None and bool(event_id) and command.event_id == event_id

    def _merge_full(self, ekey: EpochKey, device: str) -> bool:
        """Would merging ``device`` make the command in flight list too many devices?"""
        command = self.epochs[ekey].command
        return (
            command is not None
            and device not in command.devices
            and len(command.devices) >= MAX_MERGED_DEVICES
        )

    def _confirmed_on(self, ekey: EpochKey, device: str, workers: frozenset[WorkerKey]) -> bool:
        """Has a worker of scope ``ekey`` that uses ``device`` confirmed the current epoch?"""
        epoch = self.epochs[ekey].epoch
        return any(
            self._epoch_key(w) == ekey and self.workers[w].applied_epoch >= epoch for w in workers
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
        for ekey in sorted({self._epoch_key(w) for w in workers}, key=scope_order):
            state = self.epochs.get(ekey)
            command = state.command if state is not None else None
            if (
                state is not None
                and command is not None
                and command.kind == "checkpoint"
                and now - state.issued_at < self.config.pending_timeout_s
            ):
                reply.actions.append(
                    Action(
                        job=ekey.job,
                        replica=ekey.replica,
                        kind="checkpoint",
                        epoch=state.epoch,
                        coalesced=True,
                    )
                )
                continue
            command = self._issue(
                ekey, "checkpoint", reason, [event.device], event.event_id, now, out, pending=False
            )
            reply.actions.append(
                Action(job=ekey.job, replica=ekey.replica, kind="checkpoint", epoch=command.epoch)
            )
            out.events.append(
                ControllerEvent(
                    kind="checkpoint_issued",
                    ts=now,
                    job=ekey.job,
                    replica=ekey.replica,
                    device=event.device,
                    event_id=event.event_id,
                    epoch=command.epoch,
                    detail=reason,
                )
            )
