"""The shape every probe has.

A probe observes devices and says which *conditions* hold now, level-triggered: "GPU-x has an
uncorrectable ECC error", "this host is being preempted". It never publishes: the daemon
tracks conditions over time (``monitor_cli.conditions``) and publishes a ``DeviceHealth`` event
when a condition starts and a ``healthy`` one when the last condition of a device clears, never on
every interval. A probe that fails to observe raises; the daemon reports that as a condition of
the probe (not a crash) and tries again at the next interval.

Device ids are the strings agents register (``agent.local_device_uuids()``): NVML UUIDs for
NVIDIA GPUs, ``<host>:<platform>:<id>`` otherwise; a host-wide condition names every device
of the host.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from marduk.wire.protocol import HealthState


@dataclass(frozen=True, slots=True)
class Condition:
    """Something wrong with one device, as a probe sees it now."""

    device: str
    state: HealthState  # failed | degraded | preempting (healthy is the absence of conditions)
    key: str  # stable while the condition lasts, e.g. "xid:79", "ecc:uncorrectable"
    reason: str  # one line a human understands, e.g. "XID 79: GPU has fallen off the bus"


class Probe(Protocol):
    """Polled every ``interval_s``: returns every condition that holds now (empty: all well)."""

    name: str  # e.g. "nvml", "gce-metadata"; with the host it is the events' source
    interval_s: float

    async def check(self) -> list[Condition]: ...


Emit = Callable[[list[Condition]], Awaitable[None]]


class EventProbe(Protocol):
    """Pushed by its source (an NVML event set, a webhook, a metadata long-poll): calls ``emit``
    with every condition that holds now, whenever that changes, until cancelled."""

    name: str

    async def watch(self, emit: Emit) -> None: ...
