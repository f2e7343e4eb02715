"""What ``marduk agent run`` exposes on ``--metrics-addr``: its counters and gauges, the restart
and first-step histograms, and the readiness probe's answer (pure: ``readiness``, ``gauges``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from marduk.shell.metrics import StatsCollector, gauge, histogram


def readiness(
    running: Sequence[bool],
    waiting: Sequence[int],
    *,
    incarnation: int,
    epoch: int,
    step: int | None,
) -> tuple[bool, str]:
    """Ready once every local rank runs and has stepped; ``waiting``: the ranks that have not."""
    if not all(running):
        return False, "not every trainer is running"
    if waiting:
        who = "trainer" if len(running) == 1 else f"local rank(s) {list(waiting)}"
        return False, f"{who} (incarnation {incarnation}) has not stepped yet"
    return True, f"trainer stepping (epoch {epoch}, step {step})"


def gauges(
    running: int, epoch: int, incarnation: int, persist_lag: tuple[float, float] | None = None
) -> Iterator[Metric]:
    yield gauge(
        "marduk_agent_trainer_running",
        "Trainers (local ranks) running.",
        {"trainer": float(running)},
        "process",
    )
    yield gauge(
        "marduk_agent_epoch",
        "The epoch the trainers run at.",
        {"current": float(epoch)},
        "epoch",
    )
    yield gauge(
        "marduk_agent_incarnation",
        "Trainer starts so far (0: the first).",
        {"current": float(max(incarnation, 0))},
        "incarnation",
    )
    if persist_lag is not None:  # --persist-dir (agent/supervise/local_ckpt.py)
        yield gauge(
            "marduk_agent_persist_lag_steps",
            "Steps the newest persistent copy is behind the newest local snapshot (worst rank).",
            {"steps": persist_lag[0]},
            "lag",
        )
        yield gauge(
            "marduk_agent_persist_lag_seconds",
            "Age of the newest persistent copy while a newer local snapshot exists (0: caught up).",
            {"seconds": persist_lag[1]},
            "lag",
        )


class Telemetry:
    """The agent's registry: its counters (``stats``) and gauges, read at each scrape, and the
    time from the trainers' end to the next ones running, and from a start to the first step."""

    def __init__(self, stats: Counter[str], read_gauges: Callable[[], Iterable[Metric]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(stats, read_gauges))
        self.restart_seconds = histogram(
            self.registry,
            "marduk_agent_restart_seconds",
            "From a trainer's end (crash, hang, command) to the next trainers running.",
        )
        self.first_step_seconds = histogram(
            self.registry,
            "marduk_agent_time_to_first_step_seconds",
            "From a trainer's start to its first step (or heartbeat).",
        )
        self._ended_at: float | None = None

    def trainers_ended(self, now: float) -> None:
        self._ended_at = now

    def trainers_started(self, now: float) -> None:
        """The next trainers run: the restart took since the last ones ended (if they did)."""
        if self._ended_at is not None:
            self.restart_seconds.observe(now - self._ended_at)
            self._ended_at = None
