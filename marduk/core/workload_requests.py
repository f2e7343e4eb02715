"""A trainer's requests about itself (``client.request``, relayed by its agent): pure rules.

Part of the pure policy (no I/O, ``now`` passed in). A request names its worker, as a report
does, and is authorised the same way: the worker must be registered, and a request can touch
only that worker's own devices, so a trainer can take its own node out, never another's.

* ``stop_restarting``: the agent acts on it alone (it restarts the trainer no more); the
  controller records it as an event, nothing else.
* ``exclude_node``: every device the worker registered is drained, as ``marduk monitor drain``
  drains them (``ServiceRules.drain``, "drained by its trainer"): its scope gets ``fail``, or, in
  a job whose ranks the controller assigns, a restart without this member at the next epoch (a
  spare takes its ranks, or the job shrinks or is held).
* ``device_bad``: a ``failed`` health event for that device (``DeviceRules.on_health``), as a
  monitor would send it, source ``trainer``; its id repeats with the request's, so a request
  said twice restarts once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from marduk.core.decisions import DrainResult, HealthResult, Outcome, PolicyError
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.wire.protocol import Action, ControllerEvent, DeviceHealth, WorkloadRequest

WHAT = {
    "stop_restarting": "stop restarting me",
    "exclude_node": "exclude my node",
    "device_bad": "my device is bad",
}


@dataclass(slots=True)
class WorkloadResult:
    outcome: Outcome
    detail: str
    devices: list[str] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)


Drain = Callable[[list[str], str, float], DrainResult]  # devices, reason, now
OnHealth = Callable[[DeviceHealth, float], HealthResult]


class WorkloadRules:
    """Decides a trainer's request over the fleet, with the drain and health rules it uses."""

    def __init__(self, fleet: Fleet, drain: Drain, on_health: OnHealth) -> None:
        self.fleet = fleet
        self._drain = drain
        self._on_health = on_health

    def on_request(self, req: WorkloadRequest, now: float) -> WorkloadResult:
        """Refused (``PolicyError``) before any change: an unknown worker, a device not its own,
        a worker with no device to exclude."""
        key = WorkerKey(req.job, req.replica, req.worker)
        rec = self.fleet.workers.get(key)
        if rec is None:
            raise PolicyError("unknown_worker", f"worker {key} is not registered; register first")
        own = rec.registration.devices
        if req.kind == "device_bad" and req.device not in own:
            named = f"device {req.device!r}" if req.device else "no device"
            raise PolicyError(
                "not_own_device", f"{named}: worker {key} may report only its own {own}"[:4000]
            )
        if req.kind == "exclude_node" and not own:
            raise PolicyError("no_devices", f"worker {key} registered no device to exclude")
        self.fleet.heard(key, now)
        event = ControllerEvent(
            kind="trainer_request",
            ts=now,
            job=req.job,
            replica=req.replica,
            worker=req.worker,
            device=req.device,
            detail=f"{req.kind} ({WHAT[req.kind]}) from local rank {req.rank}"
            + (f": {req.reason}" if req.reason else ""),
        )
        if req.kind == "stop_restarting":
            out = Outcome()
            out.events.append(event)
            return WorkloadResult(out, "recorded: the agent restarts the trainer no more")
        if req.kind == "exclude_node":
            drained = self._drain(list(own), req.reason, now)
            drained.outcome.events.insert(0, event)
            n = len(drained.devices)
            detail = (
                f"{n} device(s) drained; the node leaves at the next epoch"
                if n
                else "its devices were out of service already"
            )
            return WorkloadResult(drained.outcome, detail, drained.devices, drained.actions)
        assert req.device is not None
        health = DeviceHealth(
            device=req.device,
            state="failed",
            reason=req.reason or "reported bad by its trainer",
            source="trainer",
            event_id=f"trainer:{key}:{req.request_id or f'{now:.6f}'}"[:256],
            timestamp=now,
        )
        decided = self._on_health(health, now)
        decided.outcome.events.insert(0, event)
        reply = decided.reply
        if reply.duplicate:
            detail = "said before: the first decision stands"
        else:
            detail = f"device {req.device} reported failed"
        return WorkloadResult(decided.outcome, detail, [req.device], list(reply.actions))
