"""Conditions over time -> the health events worth publishing, pure (``marduk monitor run``).

``ConditionTracker`` is pure (no I/O; ``now`` is an argument). It is fed each probe's current
conditions, or the news that a probe failed, and returns the ``DeviceHealth`` events to publish:

- a condition *starts* and is as bad as the worst condition of its device: an event with the
  device's worst state (failed > preempting > degraded). A lesser condition starting under a
  worse one says nothing new and is not published;
- the device's worst state *changes* (its failed condition cleared, a degraded one remains):
  an event with the new worst state;
- the last condition of a device *clears*: ``healthy``;
- anything else (the same conditions again, a reason reworded): nothing.

With ``clear_after_s`` a condition must stay absent that long before it counts as cleared, so a
flapping input (thermal throttling that comes and goes every poll) is one event, not a stream.
Event ids are stable and unique per transition: ``<source>:<device>:<key>:<start unix ms>``
for a start, ``<source>:<device>:<state>:<unix ms>`` for a change or a clear; a publish that
is retried sends the same id, which the controller deduplicates.

A probe that raises is not a device condition: it says nothing about the devices. It is
counted and logged once per streak, its conditions are kept as they were (unknown is not
healthy), and only if the daemon is configured with ``probe_error_state`` (``degraded``) does
it become a condition ``probe-error:<probe>`` on every device of the host, cleared when the
probe works again. Off by default: a Kubernetes API that is down for a minute must not mark
every GPU of the fleet degraded.

Known limit: the controller treats any ``healthy`` event as "clears the failure history" (the
restart budget of docs/decisions.md #6). A device that fails, recovers and fails again is
therefore never escalated by the monitor's own events alone; keep ``clear_after_s`` and the
probes' hold times long enough that a recovery is real.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from marduk.wire.protocol import DeviceHealth, HealthState
from monitor_cli.probes.base import Condition

SEVERITY: Final[dict[str, int]] = {"healthy": 0, "degraded": 1, "preempting": 2, "failed": 3}
PROBE_ERROR_KEY: Final = "probe-error"
# protocol.DeviceId: printable ASCII without spaces, at most 256 characters.
_DEVICE_RE: Final = re.compile(r"\A[\x21-\x7e]{1,256}\Z")
_MAX_REASON: Final = 4096
_MAX_SHORT: Final = 256


def _ms(t: float) -> int:
    return round(t * 1000)


def _short(text: str) -> str:
    """An id of at most 256 characters: long ones keep their head and get a digest tail."""
    if len(text) <= _MAX_SHORT:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{text[: _MAX_SHORT - 17]}~{digest}"


@dataclass(slots=True)
class _Active:
    condition: Condition
    probe: str
    since: float
    absent_since: float | None = None  # seen absent, held until clear_after_s has passed


class ConditionTracker:
    """Conditions over time -> the ``DeviceHealth`` events worth publishing (see module doc)."""

    def __init__(
        self,
        host: str,
        *,
        clear_after_s: float = 0.0,
        probe_error_state: HealthState | None = None,
    ) -> None:
        if probe_error_state == "healthy":
            raise ValueError("probe_error_state must be a problem state or None")
        self.host = host
        self.clear_after_s = clear_after_s
        self.probe_error_state = probe_error_state
        self._active: dict[str, dict[tuple[str, str], _Active]] = {}
        self._reported: dict[str, HealthState] = {}  # device -> last state published
        self._failing: dict[str, int] = {}  # probe -> failures in the current streak
        self.stats: Counter[str] = Counter()

    # -- inputs --

    def observe(
        self, probe: str, conditions: Iterable[Condition], now: float
    ) -> list[DeviceHealth]:
        """``probe`` says these conditions hold now (all of them: absent ones have cleared)."""
        self._failing.pop(probe, None)
        current: dict[tuple[str, str], Condition] = {}
        for c in conditions:
            if not _DEVICE_RE.match(c.device) or c.state not in SEVERITY or c.state == "healthy":
                self.stats["conditions.invalid"] += 1
                continue
            k = (c.device, c.key)
            if k not in current or SEVERITY[c.state] > SEVERITY[current[k].state]:
                current[k] = c
        old = self._active.get(probe, {})
        new: dict[tuple[str, str], _Active] = {}
        started: list[_Active] = []
        for k, c in current.items():
            prev = old.get(k)
            if prev is not None and prev.condition.state == c.state:
                new[k] = _Active(c, probe, prev.since)  # goes on; a reworded reason is no news
            else:
                new[k] = _Active(c, probe, now)
                started.append(new[k])
        cleared: list[_Active] = []
        for k, prev in old.items():
            if k in new:
                if new[k].since != prev.since:  # same key, another state: the old one ended
                    cleared.append(prev)
                continue
            held = prev.condition.key != PROBE_ERROR_KEY and self.clear_after_s > 0
            absent_since = prev.absent_since if prev.absent_since is not None else now
            if held and now - absent_since < self.clear_after_s:
                new[k] = _Active(prev.condition, probe, prev.since, absent_since)
            else:
                cleared.append(prev)
        self._active[probe] = new
        return self._events(probe, started, cleared, now)

    def probe_failed(
        self, probe: str, error: str, now: float, devices: Sequence[str]
    ) -> list[DeviceHealth]:
        """``probe`` could not observe. Its conditions stay as they were (see module doc)."""
        self._failing[probe] = self._failing.get(probe, 0) + 1
        self.stats[f"probe.{probe}.errors"] += 1
        if self.probe_error_state is None:
            return []
        active = self._active.setdefault(probe, {})
        started: list[_Active] = []
        for device in devices:
            k = (device, PROBE_ERROR_KEY)
            if k in active or not _DEVICE_RE.match(device):
                continue
            reason = f"probe {probe} cannot observe this host: {error}"
            c = Condition(device, self.probe_error_state, PROBE_ERROR_KEY, reason)
            active[k] = _Active(c, probe, now)
            started.append(active[k])
        return self._events(probe, started, [], now)

    def tick(self, now: float) -> list[DeviceHealth]:
        """Clear held conditions whose ``clear_after_s`` has passed (call about once a second)."""
        out: list[DeviceHealth] = []
        for probe, active in self._active.items():
            if probe in self._failing:
                continue  # a failing probe cannot say its conditions cleared
            expired = [
                k
                for k, a in active.items()
                if a.absent_since is not None and now - a.absent_since >= self.clear_after_s
            ]
            if expired:
                cleared = [active.pop(k) for k in expired]
                out.extend(self._events(probe, [], cleared, now))
        return out

    # -- views --

    def failing(self, probe: str) -> int:
        """Failures of ``probe`` in its current streak (0: it works)."""
        return self._failing.get(probe, 0)

    def conditions(self, device: str | None = None) -> list[Condition]:
        """Every condition held now (of one device), worst first."""
        out = [
            a
            for active in self._active.values()
            for a in active.values()
            if device is None or a.condition.device == device
        ]
        out.sort(key=lambda a: (-SEVERITY[a.condition.state], a.since, a.condition.key))
        return [a.condition for a in out]

    def state(self, device: str) -> HealthState:
        """What was last published for ``device`` (``healthy`` if nothing was)."""
        return self._reported.get(device, "healthy")

    # -- the decision --

    def _worst(self, device: str) -> _Active | None:
        found = [
            a
            for active in self._active.values()
            for a in active.values()
            if a.condition.device == device
        ]
        if not found:
            return None
        return min(found, key=lambda a: (-SEVERITY[a.condition.state], a.since, a.condition.key))

    def _events(
        self, probe: str, started: list[_Active], cleared: list[_Active], now: float
    ) -> list[DeviceHealth]:
        out: list[DeviceHealth] = []
        devices = sorted({a.condition.device for a in [*started, *cleared]})
        for device in devices:
            worst = self._worst(device)
            state: HealthState = worst.condition.state if worst else "healthy"
            previous = self._reported.get(device, "healthy")
            news = sorted(
                (a for a in started if a.condition.device == device and a.condition.state == state),
                key=lambda a: a.condition.key,
            )
            gone = "; ".join(a.condition.reason for a in cleared if a.condition.device == device)
            if worst is None:
                if previous == "healthy":
                    continue
                source = f"{probe}@{self.host}"
                event_id = f"{source}:{device}:healthy:{_ms(now)}"
                reason = f"cleared: {gone}" if gone else "cleared"
            elif news:
                first = news[0]
                source = f"{first.probe}@{self.host}"
                event_id = f"{source}:{device}:{first.condition.key}:{_ms(first.since)}"
                reason = "; ".join(a.condition.reason for a in news)
            elif state != previous:
                source = f"{worst.probe}@{self.host}"
                event_id = f"{source}:{device}:{state}:{_ms(now)}"
                reason = worst.condition.reason + (f" (cleared: {gone})" if gone else "")
            else:
                continue
            self._reported[device] = state
            if state == "healthy":
                del self._reported[device]
            self.stats[f"events.{state}"] += 1
            out.append(
                DeviceHealth(
                    device=device,
                    state=state,
                    reason=reason[:_MAX_REASON],
                    source=_short(source),
                    event_id=_short(event_id),
                    timestamp=now,
                )
            )
        return out
