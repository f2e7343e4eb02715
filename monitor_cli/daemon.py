"""``marduk monitor run``: run probes, turn their conditions into health events, publish them.

Two layers, as in the controller (docs/decisions.md #1):

* ``ConditionTracker`` (monitor_cli/conditions.py, pure) turns each probe's conditions into
  the ``DeviceHealth`` events worth publishing.
* ``MonitorDaemon`` is the async shell: one guarded, named task per probe (a polled ``Probe`` is
  checked every ``interval_s``; an ``EventProbe``'s ``watch`` is restarted with backoff when it
  raises or returns), one task that sends events in order through a ``DurablePublisher`` (one
  long-lived NATS connection; a failed publish retried with backoff; nothing is dropped but an
  event the controller rejects), counters in ``stats``, and a clean stop on SIGTERM that gives
  queued events a few seconds to go out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from marduk.aio import Backoff, TaskSet, restart_forever
from marduk.errors import MardukError, RequestRejected
from marduk.transport import bus
from marduk.transport.credentials import redact
from marduk.wire.protocol import DeviceHealth, HealthReply, HealthState
from marduk.wire.subjects import Subjects
from monitor_cli.conditions import ConditionTracker
from monitor_cli.probes.base import Condition, EventProbe, Probe
from monitor_cli.publisher import DurablePublisher, one_line

log = logging.getLogger("monitor_cli.daemon")


def default_host() -> str:
    """The node's name where Kubernetes tells it (downward API), else this machine's name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


# --- the shell ---------------------------------------------------------------------------------


@dataclass
class DaemonSettings:
    """How ``MonitorDaemon`` runs; the CLI maps options and MARDUK_* variables onto these."""

    addr: str = field(default_factory=bus.default_addr)
    """NATS server URL(s), comma-separated."""
    prefix: str = "marduk"
    """Subject prefix of the deployment."""
    host: str = field(default_factory=default_host)
    """Names the events' source (``<probe>@<host>``)."""
    devices: list[str] | None = None
    """The host's devices, for host-wide conditions; None: those the probes discover."""
    publish_timeout_s: float = 10.0
    """One publish attempt: stored by JetStream and decided by the controller."""
    connect_timeout_s: float = 5.0
    """One attempt to connect to NATS (the daemon keeps trying)."""
    clear_after_s: float = 0.0
    """A condition must stay absent this long before it counts as cleared."""
    probe_error_state: HealthState | None = None
    """Report a failing probe as this state on every device of the host (None: don't)."""
    check_timeout_s: float = 30.0
    """Longest a polled probe's ``check()`` may take before it counts as failed."""
    retry_initial_s: float = 0.5
    """First pause before publishing again after a failure; doubles up to ``retry_max_s``."""
    retry_max_s: float = 10.0
    restart_initial_s: float = 1.0
    """First pause before restarting a watch that stopped; doubles up to ``restart_max_s``."""
    restart_max_s: float = 60.0
    drain_timeout_s: float = 5.0
    """At stop, how long queued events may still take to go out."""


class MonitorDaemon:
    """Probes in, health events out (see the module docstring)."""

    def __init__(self, probes: Sequence[Probe | EventProbe], settings: DaemonSettings) -> None:
        names = [p.name for p in probes]
        if len(set(names)) != len(names):
            raise ValueError(f"probe names must be unique: {names}")
        self.probes = list(probes)
        self.settings = settings
        self.tracker = ConditionTracker(
            settings.host,
            clear_after_s=settings.clear_after_s,
            probe_error_state=settings.probe_error_state,
        )
        self.subjects = Subjects(settings.prefix)
        self.stats: Counter[str] = Counter()
        self._queue: deque[DeviceHealth] = deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks = TaskSet(self._task_failed, prefix="marduk-monitor:")
        self._publisher: asyncio.Task[None] | None = None
        self.publisher = DurablePublisher(
            settings.addr,
            settings.prefix,
            self.stats,
            name=f"marduk-monitor@{settings.host}",
            connect_timeout_s=settings.connect_timeout_s,
            decide_timeout_s=settings.publish_timeout_s,
            retry_initial_s=settings.retry_initial_s,
            retry_max_s=settings.retry_max_s,
        )
        self._stopped = False

    # -- lifecycle --

    async def start(self) -> None:
        self.publisher.start()
        for probe in self.probes:
            if _is_event_probe(probe):
                self._spawn(probe.name, lambda p=probe: self._watch(p))  # type: ignore[misc]
            else:
                self._spawn(probe.name, lambda p=probe: self._poll(p))  # type: ignore[misc]
        if self.settings.clear_after_s > 0:
            self._spawn("tick", self._tick)
        self._publisher = self._spawn("publisher", self._publish_loop)
        log.info(
            "monitoring host %s, devices %s, with %s; publishing to %s at %s",
            self.settings.host,
            ", ".join(self.host_devices()) or "(none known yet)",
            ", ".join(_describe(p) for p in self.probes) or "no probe",
            self.subjects.health,
            redact(self.settings.addr),
        )

    async def stop(self) -> None:
        """Stop the probes, give queued events ``drain_timeout_s`` to go out, then close."""
        if self._stopped:
            return
        self._stopped = True
        others = [t for t in self._tasks if t is not self._publisher]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        if self._queue:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), self.settings.drain_timeout_s)
        if self._publisher is not None:
            self._publisher.cancel()
            await asyncio.gather(self._publisher, return_exceptions=True)
        if self._queue:
            self.stats["events.unpublished_at_stop"] += len(self._queue)
            log.warning(
                "stopping with %d event(s) not published (NATS or the health stream "
                "unavailable): %s",
                len(self._queue),
                ", ".join(f"{e.device} {e.state}" for e in self._queue),
            )
        await self.publisher.close()
        log.info("monitor stopped; counters: %s", dict(sorted(self.stats.items())))

    async def run(self) -> None:
        """Start, serve until SIGTERM or SIGINT, stop."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await self.start()
            await stop.wait()
            log.info("stopping (signal)")
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self.stop()

    # -- views --

    def host_devices(self) -> list[str]:
        """The host's devices: the configured list, else every device the probes discovered."""
        if self.settings.devices is not None:
            return list(self.settings.devices)
        found: list[str] = []
        for probe in self.probes:
            known = getattr(probe, "known_devices", None)
            if callable(known):
                found.extend(d for d in known() if d not in found)
        return found

    @property
    def pending(self) -> int:
        """Events waiting to be published."""
        return len(self._queue)

    # -- tasks --

    def _spawn(self, name: str, factory: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """A named task that is restarted with backoff when it crashes (kopf-style)."""

        def ended(error: BaseException | None, pause: float) -> None:
            if error is None:
                log.error("task %s exited unexpectedly; restarting in %gs", name, pause)
            else:
                log.error("task %s crashed; restarting in %gs", name, pause, exc_info=error)
            self.stats[f"task.{name}.restarts"] += 1

        return self._tasks.spawn(restart_forever(factory, self._restart_backoff(), ended), name)

    def _task_failed(self, task: asyncio.Task[Any], e: BaseException) -> None:
        # restart_forever restarts whatever the task raised; only its own failure lands here.
        self.stats["errors.task"] += 1
        log.error("task %s failed: %s: %s", task.get_name(), type(e).__name__, e)

    async def _poll(self, probe: Probe) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            try:
                conditions = await asyncio.wait_for(probe.check(), self.settings.check_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._probe_failed(probe.name, e)
            else:
                self._observe(probe.name, conditions)
            await asyncio.sleep(max(0.0, probe.interval_s - (loop.time() - began)))

    def _restart_backoff(self) -> Backoff:
        return Backoff(self.settings.restart_initial_s, self.settings.restart_max_s)

    async def _watch(self, probe: EventProbe) -> None:
        async def emit(conditions: list[Condition]) -> None:
            self._observe(probe.name, conditions)

        def ended(error: BaseException | None, _pause: float) -> None:
            self._probe_failed(probe.name, error or MardukError("its watch returned"))
            self.stats[f"probe.{probe.name}.restarts"] += 1

        await restart_forever(lambda: probe.watch(emit), self._restart_backoff(), ended)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.settings.clear_after_s / 4))
            self._enqueue(self.tracker.tick(time.time()))

    def _observe(self, name: str, conditions: list[Condition]) -> None:
        failures = self.tracker.failing(name)
        if failures:
            log.info("probe %s works again after %d failure(s)", name, failures)
        self.stats[f"probe.{name}.observations"] += 1
        self._enqueue(self.tracker.observe(name, conditions, time.time()))

    def _probe_failed(self, name: str, error: BaseException) -> None:
        text = one_line(error)
        first = self.tracker.failing(name) == 0
        events = self.tracker.probe_failed(name, text, time.time(), self.host_devices())
        self.stats[f"probe.{name}.errors"] += 1
        if first:
            what = (
                f"reported as {self.settings.probe_error_state}"
                if self.settings.probe_error_state
                else "not reported as a device condition"
            )
            log.warning("probe %s failed: %s (%s; retrying, logged once)", name, text, what)
        self._enqueue(events)

    def _enqueue(self, events: list[DeviceHealth]) -> None:
        for e in events:
            log.info(
                "device %s %s (%s): %s [%s]", e.device, e.state, e.source, e.reason, e.event_id
            )
            self.stats["events.queued"] += 1
            self._queue.append(e)
        if self._queue:
            self._idle.clear()
            self._wake.set()

    # -- publishing --

    async def _publish_loop(self) -> None:
        """Publish the queue's head until it is stored and decided, in order, never skipping."""
        while True:
            if not self._queue:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            event = self._queue[0]
            failures = 0

            def retrying(why: str, n: int, event: DeviceHealth = event) -> None:
                nonlocal failures
                failures = n
                log.log(
                    logging.WARNING if n == 1 else logging.DEBUG,
                    "cannot publish %s about %s yet (%s); retrying with backoff, %d queued",
                    event.state,
                    event.device,
                    why,
                    len(self._queue),
                )

            try:
                reply = await self.publisher.publish(event, on_retry=retrying)
            except RequestRejected as e:
                # The controller refuses it (e.g. a malformed device id): repeating won't help.
                self.stats["events.rejected"] += 1
                log.error("event %s about %s rejected: %s", event.event_id, event.device, e)
            else:
                self._published(event, reply)
            if failures > 1:
                log.info("published again after %d failed attempt(s)", failures)
            self._queue.popleft()

    def _published(self, event: DeviceHealth, reply: HealthReply | None) -> None:
        if reply is None:
            # Stored durably: the controller handles it when one serves. Not lost.
            self.stats["events.undecided"] += 1
            log.warning("%s %s: stored; no controller decided yet", event.device, event.state)
            return
        self.stats["events.published"] += 1
        if reply.duplicate:
            self.stats["events.duplicate"] += 1
        acted = len(reply.actions)
        log.info(
            "controller: %s %s%s",
            event.device,
            event.state,
            f", {acted} restart scope(s) acted on"
            if acted
            else ("" if reply.known else " (no replica uses it)"),
        )


def _is_event_probe(probe: Any) -> bool:
    return callable(getattr(probe, "watch", None))


def _describe(probe: Any) -> str:
    if _is_event_probe(probe):
        return f"{probe.name} (events)"
    return f"{probe.name} (every {probe.interval_s:g}s)"
