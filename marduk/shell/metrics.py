"""Prometheus metrics and Kubernetes probes over one small HTTP endpoint.

``--metrics-addr HOST:PORT`` (MARDUK_METRICS_ADDR; off unless set) serves:

* ``/metrics``: the Prometheus text format (``prometheus-client``), names under ``marduk_``;
* ``/healthz``: 200 while the process's event loop runs (liveness);
* ``/readyz``: 200 when the process can do its job (readiness): for the controller, leading or a
  hot standby with a current state mirror; for ``marduk agent run``, the trainer stepping.

The counters ``marduk monitor status`` shows and the ``marduk_*_total`` counters come from the
same source: ``StatsCollector`` exports a process's ``stats`` Counter at scrape time, grouped
into labelled families by their dotted names (``rejected.invalid`` ->
``marduk_rejections_total{reason="invalid"}``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from marduk.aio import HttpServer, parse_host_port, respond

log = logging.getLogger("marduk.metrics")

# stats prefix -> (metric name, label name, help). Keys not listed become marduk_<name>_total.
FAMILIES: dict[str, tuple[str, str, str]] = {
    "received": ("marduk_messages_received_total", "kind", "Messages received, by kind."),
    "rejected": ("marduk_rejections_total", "reason", "Messages rejected, by reason."),
    "commands": ("marduk_commands_total", "kind", "Commands published, by kind (resent too)."),
    "events": ("marduk_health_events_total", "state", "Health events handled, by state."),
    "sources": ("marduk_health_events_by_source_total", "source", "Health events, by source."),
    "restarts": ("marduk_restarts_total", "cause", "Restarts issued, by cause and class."),
    "health": ("marduk_health_outcomes_total", "outcome", "Health events: duplicates, ..."),
    "errors": ("marduk_errors_total", "kind", "Internal errors, by kind."),
    "reports": ("marduk_reports_total", "status", "Supervisor reports, by status."),
    "requests": ("marduk_trainer_requests_total", "kind", "Trainers' requests, by kind."),
    "requests_refused": (
        "marduk_trainer_requests_refused_total",
        "reason",
        "Trainers' requests refused, by reason.",
    ),
}


class StatsCollector:
    """Exports a ``Counter`` of dotted names, read at each scrape (nothing copied).

    ``help_texts``: the help text of a counter outside FAMILIES, by its dotted name (default
    "Counter <name>.").
    """

    def __init__(
        self,
        stats: Counter[str],
        gauges: Callable[[], Iterable[Metric]],
        help_texts: Mapping[str, str] | None = None,
    ) -> None:
        self.stats = stats
        self.gauges = gauges
        self.help_texts = help_texts or {}

    def collect(self) -> Iterator[Metric]:
        families: dict[str, CounterMetricFamily] = {}
        for key, value in sorted(self.stats.items()):
            head, _, rest = key.partition(".")
            if head in FAMILIES and rest:
                name, label, doc = FAMILIES[head]
                fam = families.get(name)
                if fam is None:
                    fam = families[name] = CounterMetricFamily(
                        name.removesuffix("_total"), doc, labels=[label]
                    )
                fam.add_metric([rest], value)
            elif head not in FAMILIES:
                name = "marduk_" + key.replace(".", "_").replace("-", "_")
                yield CounterMetricFamily(
                    name, self.help_texts.get(key, f"Counter {key}."), value=value
                )
        yield from families.values()
        yield from self.gauges()


def gauge(name: str, doc: str, values: dict[str, float], label: str) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        fam.add_metric([key], value)
    return fam


def histogram(registry: CollectorRegistry, name: str, doc: str) -> Histogram:
    # Buckets from a millisecond (a notice) to minutes (a restart that waits for a checkpoint).
    buckets = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
               30, 60, 120, 300)  # fmt: skip
    return Histogram(name, doc, registry=registry, buckets=buckets)


@dataclass(slots=True)
class Probes:
    """What the endpoint answers: the registry to expose and the readiness check."""

    registry: CollectorRegistry
    ready: Callable[[], tuple[bool, str]]


class MetricsServer:
    """A minimal HTTP/1.1 server on the process's own event loop (no thread, no framework)."""

    def __init__(self, addr: str, probes: Probes) -> None:
        self.host, self.port = parse_listen_addr(addr)
        self.probes = probes
        self._server = HttpServer(self.host, self.port, self._handle, what="serve metrics")

    async def start(self) -> None:
        host, self.port = await self._server.start()
        log.info("metrics and probes on http://%s:%d (/metrics /healthz /readyz)", host, self.port)

    async def stop(self) -> None:
        await self._server.stop()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass  # headers: nothing we need
            parts = request.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            await respond(writer, self._route(parts[0] if parts else "", path))
        except (TimeoutError, OSError, UnicodeDecodeError, ValueError):
            pass  # a client gone, slow, or sending a line over the reader's limit
        finally:
            writer.close()

    def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        text = "text/plain; charset=utf-8"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", text, b"GET only\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.probes.registry)
        if path == "/healthz":
            return "200 OK", text, b"ok\n"
        if path == "/readyz":
            ok, why = self.probes.ready()
            return ("200 OK" if ok else "503 Service Unavailable"), text, (why + "\n").encode()
        return "404 Not Found", text, b"/metrics, /healthz or /readyz\n"


def parse_listen_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` -> (host, port); one clear error otherwise."""
    return parse_host_port(addr, option="--metrics-addr", example="0.0.0.0:9090", bare_port=True)
