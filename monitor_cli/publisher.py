"""One NATS connection for a monitor, and health events published durably on it.

Both monitors that publish from a long-running process (``marduk monitor run``'s daemon and the
Alertmanager receiver) use a ``DurablePublisher``: it connects in the background and keeps the
connection (nats-py reconnects it), and ``publish`` stores an event in the health stream and
waits for the controller's decision, retrying with backoff until the event is stored or the
caller's deadline passes. Retrying is safe: the event id makes a repeat a duplicate.

Counters in ``stats``: ``nats.connect_failures``, ``nats.disconnects``, ``nats.reconnects``,
``publish.retries``, ``errors.task`` (the connecting task failed: a bug).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NATS

from marduk.aio import Backoff, TaskSet
from marduk.errors import ConnectError, MardukError, RequestRejected
from marduk.transport import bus
from marduk.transport.credentials import redact
from marduk.wire.protocol import DeviceHealth, HealthReply
from marduk.wire.subjects import Subjects
from monitor_cli.health import UndecidedError, publish_durably

log = logging.getLogger("monitor_cli.publisher")

OnRetry = Callable[[str, int], None]
"""Called before each pause between attempts with why the attempt failed and how many have."""


class UnavailableError(MardukError):
    """NATS (or JetStream) did not take the event before the deadline."""


class DurablePublisher:
    """Publish ``DeviceHealth`` events durably on one long-lived NATS connection."""

    def __init__(
        self,
        addr: str,
        prefix: str,
        stats: Counter[str],
        *,
        name: str,
        connect_timeout_s: float = 5.0,
        decide_timeout_s: float = 5.0,
        retry_initial_s: float = 0.25,
        retry_max_s: float = 5.0,
    ) -> None:
        self.addr = addr
        self.subjects = Subjects(prefix)
        self.stats = stats
        self.name = name
        self.connect_timeout_s = connect_timeout_s
        self.decide_timeout_s = decide_timeout_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.nc: NATS | None = None
        self._connected = asyncio.Event()
        self._tasks = TaskSet(self._task_failed)
        self._closing = False

    @property
    def ready(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    def start(self) -> None:
        """Connect in the background; a credential that cannot be used fails here, in one
        line, rather than in every retry."""
        bus.default_credentials().nats_options()
        self._tasks.spawn(self._connect_loop(), f"{self.name}:nats")

    def _task_failed(self, task: asyncio.Task[Any], e: BaseException) -> None:
        self.stats["errors.task"] += 1
        log.error(
            "%s failed: %s: %s (not connecting any more)", task.get_name(), type(e).__name__, e
        )

    async def publish(
        self, event: DeviceHealth, *, timeout: float = math.inf, on_retry: OnRetry | None = None
    ) -> HealthReply | None:
        """Store ``event`` and return the controller's decision (None: stored, not decided in
        ``decide_timeout_s``; a controller decides it once one serves).

        Retries until stored or ``timeout`` (seconds; by default, forever). Raises
        UnavailableError at the deadline, RequestRejected if the controller refuses the event.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        backoff = Backoff(self.retry_initial_s, self.retry_max_s, jitter=0.2)
        failures = 0
        while True:
            left = deadline - loop.time()
            try:
                return await self._attempt(event, left)
            except UndecidedError:
                return None
            except RequestRejected:
                raise
            except _Failed as e:
                why = str(e)
            failures += 1
            self.stats["publish.retries"] += 1
            if on_retry is not None:
                on_retry(why, failures)
            pause = min(backoff.next(), max(0.0, deadline - loop.time()))
            if deadline - loop.time() <= pause:
                raise UnavailableError(f"{why} (gave up after {timeout:g}s)")
            await asyncio.sleep(pause)

    async def _attempt(self, event: DeviceHealth, left: float) -> HealthReply:
        """One try: wait for the connection (one connect attempt's time), then publish."""
        why = f"not connected to NATS at {redact(self.addr)} yet"
        scope = asyncio.timeout(max(0.0, min(left, self.connect_timeout_s)))
        try:
            async with scope:
                await self._connected.wait()
        except TimeoutError:
            raise _Failed(why) from None
        nc = self.nc
        assert nc is not None
        if not nc.is_connected:
            raise _Failed(f"the connection to NATS at {redact(self.addr)} is down")
        decide = max(0.05, min(self.decide_timeout_s, left))
        try:
            # The outer bound covers a server that takes the bytes and never answers.
            return await asyncio.wait_for(
                publish_durably(nc, self.subjects, event, timeout=decide, addr=self.addr),
                decide + 5.0,
            )
        except (UndecidedError, RequestRejected):
            raise
        except TimeoutError as e:
            raise _Failed(str(e) or "NATS did not answer in time") from None
        except (MardukError, nats.errors.Error, OSError) as e:
            raise _Failed(one_line(e)) from None

    async def close(self) -> None:
        self._closing = True
        await self._tasks.stop()
        if self.nc is not None:
            await bus.close(self.nc, drain=False)
            self.nc = None

    async def _connect_loop(self) -> None:
        backoff, failures = Backoff(initial=0.5, cap=10.0), 0
        while True:
            try:
                await self._connect()
                return
            except ConnectError as e:
                self.stats["nats.connect_failures"] += 1
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "%s; retrying (events wait meanwhile)", e)
            except MardukError as e:  # e.g. credentials: retrying does not help
                log.error("%s", e)
                return
            await asyncio.sleep(backoff.next())

    async def _connect(self) -> None:
        async def disconnected() -> None:
            if self._closing or not self._connected.is_set():
                return  # our own close, or a first connect that has not succeeded
            self.stats["nats.disconnects"] += 1
            log.warning("lost NATS at %s; reconnecting (events wait)", redact(self.addr))

        async def reconnected() -> None:
            self.stats["nats.reconnects"] += 1
            log.info("reconnected to NATS")

        self.nc = await bus.connect(
            self.addr,
            name=self.name,
            timeout=self.connect_timeout_s,
            reconnect=True,
            on_disconnected=disconnected,
            on_reconnected=reconnected,
        )
        self._connected.set()
        log.info("connected to NATS at %s", redact(self.addr))


class _Failed(Exception):
    """One attempt failed in a way worth retrying; its message says why."""


def one_line(error: BaseException) -> str:
    """An error in one line: its first line, named by its type unless it is one of ours."""
    text = str(error).strip().splitlines()
    detail = text[0] if text else ""
    name = type(error).__name__
    if isinstance(error, MardukError) and detail:
        return detail
    return f"{name}: {detail}" if detail else name
