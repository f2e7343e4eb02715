"""True per-endpoint stats for ``nats micro stats``: each endpoint's ``data`` in $SRV.STATS.

nats-py's micro times its handler and counts what it raises. Ours never raises (a rejection is
an ``ErrorReply``), and the agents' endpoints hand each request to a task of its own and return
at once (``Edge.endpoint``), so micro's own figures count requests and nothing more. The edge
records here what each request really came to, from its decoding to its answer, and the
service's ``stats_handler`` (``EndpointStats.data``) puts it in the STATS reply. The fields are
described in docs/operations.md, *NATS micro stats*.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, NamedTuple

from nats.micro.service import EndpointStats as MicroEndpointStats

_LAST_ERROR_CHARS = 200


class RequestEnd(NamedTuple):
    """How one request's work ended: ``error``, the code it was answered with or why no answer
    went out ("" for neither), with a ``detail`` for ``last_error``; whether it was answered."""

    error: str = ""
    detail: str = ""
    answered: bool = True


ANSWERED = RequestEnd()
DROPPED = RequestEnd(answered=False)  # on purpose: not serving (the client asks the leader again)


class Tally:
    """One endpoint's requests since its service started: completed, errors by reason, time."""

    def __init__(self) -> None:
        self.completed = 0
        self.unanswered = 0
        self.in_flight = 0
        self.errors: Counter[str] = Counter()
        self.processing_ns = 0
        self.last_error = ""

    def started(self) -> int:
        """A request's work begins (before it is decoded); returns its start for ``done``."""
        self.in_flight += 1
        return time.perf_counter_ns()

    def done(self, start: int, end: RequestEnd) -> None:
        """A request's work that began at ``start`` ended as ``end``."""
        self.in_flight -= 1
        self.completed += 1
        self.processing_ns += time.perf_counter_ns() - start
        if not end.answered:
            self.unanswered += 1
        if end.error:
            self.errors[end.error] += 1
            self.last_error = f"{end.error}: {end.detail}"[:_LAST_ERROR_CHARS]

    def data(self) -> dict[str, Any]:
        """The STATS ``data`` of this endpoint (plain JSON types; times in nanoseconds, as
        micro's own ``processing_time``)."""
        return {
            "num_completed": self.completed,
            "num_errors": sum(self.errors.values()),
            "errors": dict(sorted(self.errors.items())),
            "last_error": self.last_error,
            "num_unanswered": self.unanswered,
            "in_flight": self.in_flight,
            "processing_time": self.processing_ns,
            "average_processing_time": self.processing_ns // max(self.completed, 1),
        }


class ServiceTallies:
    """Every endpoint's ``Tally`` of one micro service (a new service, a new set: micro's own
    counters start again with it too)."""

    def __init__(self) -> None:
        self._by_endpoint: dict[str, Tally] = {}

    def endpoint(self, name: str) -> Tally:
        return self._by_endpoint.setdefault(name, Tally())

    def stats_handler(self, stats: MicroEndpointStats) -> dict[str, Any]:
        """For ``ServiceConfig.stats_handler``: micro calls it for each endpoint while it builds
        a STATS reply, and sends what it returns as that endpoint's ``data``."""
        return self.endpoint(stats.name).data()
