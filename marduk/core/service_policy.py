"""Devices out of service: flap damping, quarantine, drain, and claims of devices across jobs.

Part of the pure policy (no I/O, ``now`` passed in): ``ServiceRules``, over the policy's ``Fleet``;
``marduk.core.device_policy.DeviceRules`` asks it about flapping devices.

* **Flap damping.** A device that goes (back) to ``failed`` more than ``flap_limit`` times in
  ``flap_window_s`` is quarantined, even if it reported ``healthy`` in between.
* **Out of service** (quarantined, or drained by an operator): every scope using it gets
  ``fail`` (the pods go back to the scheduler) -- in a job with a membership only the members
  using it leave, and a spare takes their ranks (``marduk.core.membership_policy``); a worker
  registering with it is told (``RegisterReply.unusable_devices``), and it is never forgotten
  while out of service. ``undrain`` puts it back and clears its history.
"""

from __future__ import annotations

from typing import Protocol

from marduk.core.decisions import (
    DrainResult,
    Outcome,
    PolicyError,
    action_of,
    event_at,
    scope_order,
)
from marduk.core.fleet import Fleet, out_of_service
from marduk.core.records import DeviceRecord, EpochKey
from marduk.wire.protocol import (
    Action,
    Command,
    CommandKind,
    ControllerEvent,
    HealthReply,
    Registration,
)


class IssueOrReplace(Protocol):
    """How a scope gets a command (``MembershipRules.issue_or_replace``): a ``fail`` of a job
    with a membership replaces the members concerned instead; None when nothing is sent."""

    def __call__(
        self,
        ekey: EpochKey,
        kind: CommandKind,
        reason: str,
        devices: list[str],
        cause: str,
        now: float,
        out: Outcome,
    ) -> Command | None: ...


class ServiceRules:
    """Quarantine, drain and device claims (see the module)."""

    def __init__(self, fleet: Fleet, issue_or_replace: IssueOrReplace) -> None:
        self.fleet = fleet
        self.issue_or_replace = issue_or_replace

    def note_flip(self, device: DeviceRecord, now: float, out: Outcome, reply: HealthReply) -> None:
        """The device went (back) to ``failed``: past the flap limit it is quarantined."""
        config = self.fleet.config
        window = config.flap_window_s
        device.flips = [t for t in device.flips if now - t < window] + [now]
        if len(device.flips) <= config.flap_limit:
            return
        device.quarantined = True
        device.out_reason = (
            f"quarantined: failed {len(device.flips)} times within {window:g}s (flapping)"
        )
        out.events.append(
            ControllerEvent(
                kind="device_quarantined", ts=now, device=device.device, detail=device.out_reason
            )
        )
        reply.actions.extend(
            self._fail_scopes(
                [device.device], device.out_reason, f"quarantine:{device.device}", now, out
            )
        )

    def check_claims(self, reg: Registration, now: float) -> None:
        """Refuse a worker claiming a device that a live worker of another job holds on another
        host. Device ids are physical, so one of the two claims is false; the first stands
        until its holder deregisters or goes silent. A job-scoped agent identity may register
        only for its own job (the server enforces that), so it cannot claim another job's
        devices, and so cannot get them drained or failed. Only with
        ``exclusive_devices`` (the default with auth: PolicyConfig)."""
        fleet = self.fleet
        if not fleet.config.exclusive_devices:
            return
        for device in reg.devices:
            for key in fleet.drmap.workers_for_device(device):
                holder = fleet.workers.get(key)
                if holder is None or key.job == reg.job or holder.registration.host == reg.host:
                    continue
                if key in fleet.stale or now - fleet.last_seen.get(key, 0.0) >= (
                    fleet.config.worker_ttl_s
                ):
                    continue
                raise PolicyError(
                    "device_claimed",
                    f"device {device} is held by worker {key} on "
                    f"{holder.registration.host or '?'}; a worker of job {reg.job} on "
                    f"{reg.host or '?'} may not claim it (forget that worker if it is gone)",
                )

    def _claims_elsewhere(self, device: str, host: str) -> list[str]:
        """Workers on hosts other than ``host`` that claim ``device``."""
        workers = self.fleet.workers
        return sorted(
            f"{key} on {workers[key].registration.host or '?'}"
            for key in self.fleet.drmap.workers_for_device(device)
            if key in workers and workers[key].registration.host != host
        )

    def _by_host(self, host: str, named: set[str]) -> tuple[set[str], list[str]]:
        """The devices of ``host``'s workers that no worker on another host claims too (with
        ``named``), and a line for each that one does (not drained: the operator names it)."""
        claimed: set[str] = set()
        for key, worker in self.fleet.workers.items():
            if worker.registration.host == host:
                claimed |= self.fleet.drmap.devices_for_worker(key)
        names, conflicts = set(named), []
        for name in sorted(claimed - named):
            elsewhere = self._claims_elsewhere(name, host)
            if elsewhere:
                conflicts.append(
                    f"{name}: also claimed by {', '.join(elsewhere)}; not drained by host "
                    "(name it to drain it)"
                )
            else:
                names.add(name)
        return names, conflicts

    def drain(
        self,
        devices: list[str],
        host: str,
        undrain: bool,
        reason: str,
        now: float,
        *,
        by: str = "an operator",
    ) -> DrainResult:
        """An operator (or the straggler policy: ``by``) takes devices (or every device of
        ``host``) out of service, or back.

        By host: only devices that no worker on another host claims too. A conflicting claim
        is reported (``conflicts``), not acted on: the operator names the device to drain it.
        """
        out = Outcome()
        names, conflicts = self._by_host(host, set(devices)) if host else (set(devices), [])
        changed: list[str] = []
        fleet = self.fleet
        for name in sorted(names):
            rec = fleet.devices.get(name)
            if undrain:
                if rec is None or not out_of_service(rec):
                    continue
                rec.drained = rec.quarantined = False
                rec.out_reason, rec.flips, rec.failures = "", [], []
            else:
                if not fleet.drmap.has_device(name) and rec is None:
                    continue  # a device nobody uses is not remembered
                rec = rec or DeviceRecord(device=name, since=now)
                if rec.drained:
                    continue
                rec.drained = True
                rec.out_reason = f"drained by {by}{': ' + reason if reason else ''}"
            fleet.devices[name] = rec
            out.put_devices.append(rec)
            changed.append(name)
            out.events.append(
                ControllerEvent(
                    kind="device_undrained" if undrain else "device_drained",
                    ts=now,
                    device=name,
                    detail=reason,
                )
            )
        actions: list[Action] = []
        if changed and not undrain:
            why = f"drained by {by}{': ' + reason if reason else ''}"
            actions = self._fail_scopes(
                changed, why, f"drain:{host or ','.join(changed)}", now, out
            )
        return DrainResult(out, changed, actions, conflicts)

    def _fail_scopes(
        self, devices: list[str], reason: str, cause: str, now: float, out: Outcome
    ) -> list[Action]:
        """``fail`` to every scope using one of ``devices``, once each, in flight or not."""
        fleet = self.fleet
        workers = {w for d in devices for w in fleet.drmap.workers_for_device(d)}
        actions = []
        for ekey in sorted({fleet.epoch_key(w) for w in workers}, key=scope_order):
            used = sorted(
                d
                for d in devices
                if any(fleet.epoch_key(w) == ekey for w in fleet.drmap.workers_for_device(d))
            )
            command = self.issue_or_replace(ekey, "fail", reason, used, cause, now, out)
            if command is None:
                continue
            actions.append(action_of(ekey, command.kind, command.epoch))
            out.events.append(
                event_at(ekey, f"{command.kind}_issued", now, epoch=command.epoch, detail=reason)
            )
        return actions
