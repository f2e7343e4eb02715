"""What every part of the controller is handed: its settings and subjects, the counters, the
rate-limited logs, and the few things a part asks of the whole (do we lead, start a task, step
down, the connection).

The parts (``edge``, ``handlers``, ``outbox``, ``takeover``, ``standbys``, ``telemetry``) never
see the ``Controller``: each gets a ``Context`` and, as callables, the few decisions of the
others it uses; ``shell`` wires them. An import contract (pyproject.toml) keeps the parts apart
from each other and from ``shell``, so a test builds one with real small objects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
from nats.aio.client import Client as NATS

from marduk.aio import RateLimitedLog
from marduk.controller.commit import NotServing
from marduk.controller.settings import ControllerSettings
from marduk.wire.protocol import ErrorReply
from marduk.wire.subjects import Subjects

log = logging.getLogger("marduk.controller")

Handler = Callable[[Any, str], Awaitable[msgspec.Struct | None]]
"""A request handler: the decoded request and its subject in, the reply out (None: none)."""


class Route(NamedTuple):
    """One micro endpoint of the handlers' table (``Handlers.routes``, served by the edge)."""

    name: str
    subject: str
    type_: type[msgspec.Struct]
    handler: Handler
    concurrent: bool
    """Each request in a task of its own (the agents' endpoints, which come in storms), not
    one at a time (the operators'): ``Edge.endpoint``."""


class Logs:
    """The controller's logs that a flood must not flood: a few lines per kind a minute, and
    an internal error's traceback once a minute per kind. What they count goes to ``stats``."""

    def __init__(self, stats: Counter[str]) -> None:
        self._stats = stats
        self._limited = RateLimitedLog(log, clock=time.time)
        self._internal = RateLimitedLog(log, burst=1, more=None, clock=time.time)

    def limited(self, key: str, line: str, level: int = logging.WARNING) -> None:
        """The first few of each kind per minute: a flood of junk must not flood the log."""
        self._limited.log(key, level, "%s", line)

    def internal(self, what: str) -> None:
        """An internal error (call it from the ``except``): counted; the traceback once a
        minute per kind, not per message."""
        self._stats["errors.internal"] += 1
        self._internal.log(
            f"handling.{what.split(' ')[0]}",
            logging.ERROR,
            "internal error handling %s (repeats this minute are counted)",
            what,
            exc_info=True,
        )

    def task_failed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        """A spawned task's error would otherwise vanish (nobody awaits it): count and log it."""
        self._stats["errors.internal"] += 1
        self._internal.log(
            f"task.{task.get_name()}",
            logging.ERROR,
            "internal error in task %s (repeats this minute are counted)",
            task.get_name(),
            exc_info=error,
        )

    def reject(self, kind: str, reason: str, message: str, subject: str) -> ErrorReply:
        """A bad message: counted by reason, logged a few times a minute; the error to answer."""
        self._stats[f"rejected.{reason}"] += 1
        self._stats["rejected"] += 1
        self.limited(f"{kind}.{reason}", f"rejected {kind} on {subject}: {message}")
        return ErrorReply(code=reason, message=message[:4000])


@dataclass(frozen=True, slots=True)
class Context:
    """What every part is handed; the shell makes one and owns what it refers to."""

    settings: ControllerSettings
    subjects: Subjects
    controller_id: str
    stats: Counter[str]
    """The counters /metrics and ``monitor status`` show (``marduk_*_total``)."""
    logs: Logs
    leading: Callable[[], bool]
    """Serving, within the lease's fence, and connected: only then does a part decide or send
    (what nats-py buffers while reconnecting would go out after a new leader may lead)."""
    spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]]
    """Start a task of the work in flight (a request, an event's commit, a step-down): its
    error is counted and logged; ``Controller.stop`` gives it a grace, then cancels it."""
    step_down: Callable[[str], None]
    """Give the lease up (why), in a task of its own: never from inside a commit, since
    stepping down waits for the commits in flight."""
    connection: Callable[[], NATS]
    """The NATS connection; raises ``NotServing`` while there is none (before start, after
    stop)."""

    def connected(self) -> NATS | None:
        """The connection if there is one and it is up (for what is sent only then)."""
        try:
            nc = self.connection()
        except NotServing:
            return None
        return nc if nc.is_connected else None
