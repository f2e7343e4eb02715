"""Performance telemetry off the training loop's path (decisions.md 19).

The training thread only takes the time and appends it to a list (``PerfRecorder.step``,
``enter``/``leave``: about a microsecond, measured by bench/bench_telemetry.py); the agent's
thread swaps the list out once per window, sorts it into a summary per section (count, p50, p90,
max, min) and publishes that (``PerfSender``). Nothing here waits on the network, takes a lock
the training thread waits for, or raises into the loop.

Bounded: at most ``max_samples`` samples are held per window (more are counted in ``dropped``
and said in the summary), at most ``MAX_SECTIONS`` sections go out (those with the most
samples), names are cut to what the wire accepts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping

from agent.library.options import Options
from marduk.wire.perf import MAX_SECONDS, MAX_SECTIONS, PerfSummary, SectionStats

log = logging.getLogger("agent")

WINDOW_S = 5.0
"""Default window: MARDUK_PERF_WINDOW overrides it; 0 turns telemetry off."""
MAX_SAMPLES = 200_000
STEP = "step"

_BAD_NAME = re.compile(r"[^A-Za-z0-9_.:-]")


def section_name(name: str) -> str:
    """A trainer's section name as the wire accepts it (1-64 of A-Z a-z 0-9 _ . : -)."""
    return _BAD_NAME.sub("_", name)[:64] or "_"


class PerfRecorder:
    """Samples taken on the training thread, summarized on the agent's."""

    __slots__ = ("_buf", "_clock", "_last_step", "_max", "dropped")

    def __init__(
        self, max_samples: int = MAX_SAMPLES, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._buf: list[tuple[str, float]] = []
        self._max = max_samples
        self._clock = clock
        self._last_step: float | None = None
        self.dropped = 0

    # --- the training thread: a clock read and an append ----------------------------------------

    def step(self) -> None:
        now = self._clock()
        last, self._last_step = self._last_step, now
        if last is not None:
            buf = self._buf
            if len(buf) < self._max:
                buf.append((STEP, now - last))
            else:
                self.dropped += 1

    def enter(self) -> float:
        return self._clock()

    def leave(self, name: str, started: float) -> None:
        buf = self._buf
        if len(buf) < self._max:
            buf.append((name, self._clock() - started))
        else:
            self.dropped += 1

    def restart_steps(self) -> None:
        """The next step starts a new interval (after a pause that is no step: a restart)."""
        self._last_step = None

    # --- the agent's thread ----------------------------------------------------------------------

    def take(self) -> tuple[list[tuple[str, float]], int]:
        """The window's samples and how many were dropped; a fresh window starts."""
        # One assignment under the GIL: an append racing with it lands in one window or the
        # next, never in neither (the list taken is read only after the swap).
        buf, self._buf = self._buf, []
        dropped, self.dropped = self.dropped, 0
        return buf, dropped


def summarize(samples: list[tuple[str, float]]) -> list[SectionStats]:
    """Count, p50, p90, max and min per section; at most ``MAX_SECTIONS``, the most sampled."""
    by: dict[str, list[float]] = {}
    for name, dt in samples:
        by.setdefault(name, []).append(dt)
    names = sorted(by, key=lambda n: (-len(by[n]), n))[:MAX_SECTIONS]
    out = []
    for name in names:
        xs = sorted(min(max(x, 0.0), MAX_SECONDS) for x in by[name])
        n = len(xs)
        out.append(
            SectionStats(
                name=section_name(name),
                count=n,
                p50=xs[(n - 1) // 2],
                p90=xs[min(n - 1, (9 * n) // 10)],
                max=xs[-1],
                min=xs[0],
            )
        )
    # Two names may map to one on the wire ("a b", "a_b"): keep the first (the most sampled).
    first: dict[str, SectionStats] = {}
    for stats in out:
        first.setdefault(stats.name, stats)
    return list(first.values())


def window_from_env(env: Mapping[str, str] | None = None) -> float:
    """MARDUK_PERF_WINDOW in seconds (0 to 3600; 0: off), else ``WINDOW_S``."""
    raw = (os.environ if env is None else env).get("MARDUK_PERF_WINDOW", "")
    try:
        return max(0.0, min(float(raw), 3600.0)) if raw else WINDOW_S
    except ValueError:
        log.warning("MARDUK_PERF_WINDOW=%r is not a number of seconds; using %g", raw, WINDOW_S)
        return WINDOW_S


def rank_from_env(default: int, env: Mapping[str, str] | None = None) -> int:
    """This process's rank in the job: RANK (torchrun's), else the worker's index."""
    raw = (os.environ if env is None else env).get("RANK", "")
    return int(raw) if raw.isdigit() else default


def local_from_env(env: Mapping[str, str] | None = None) -> tuple[int | None, int | None]:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE), torchrun's, each None when unset."""
    e = os.environ if env is None else env
    rank, size = e.get("LOCAL_RANK", ""), e.get("LOCAL_WORLD_SIZE", "")
    return (
        int(rank) if rank.isdigit() and int(rank) <= 4096 else None,
        int(size) if size.isdigit() and 1 <= int(size) <= 4096 else None,
    )


class PerfSender:
    """Once per window: the recorder's samples, summarized, handed to ``send`` (a publish).
    A task of the client's loop; a failed send is counted, never raised."""

    def __init__(
        self,
        recorder: PerfRecorder,
        send: Callable[[PerfSummary], Awaitable[bool]],
        *,
        job: str,
        replica: str,
        worker: int,
        rank: int,
        incarnation: int,
        devices: list[str] | None = None,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.recorder = recorder
        self._send = send
        self._ids = (job, replica, worker, rank, incarnation)
        self._devices = [d for d in devices or [] if 0 < len(d) <= 256][:64]
        self._local = local_from_env()
        self.window_s = window_s
        self._clock = clock
        self.seq = 0
        self.sent = 0
        self.failed = 0

    def summary(self, elapsed: float) -> PerfSummary | None:
        samples, dropped = self.recorder.take()
        if not samples and not dropped:
            return None  # nothing happened: nothing to say (an idle or paused trainer)
        job, replica, worker, rank, incarnation = self._ids
        s = PerfSummary(
            job=job,
            replica=replica,
            worker=worker,
            rank=rank,
            incarnation=incarnation,
            window_s=min(max(elapsed, 1e-3), 3600.0),
            seq=self.seq,
            sections=summarize(samples),
            dropped=min(dropped, 10_000_000),
            devices=self._devices,
            local_rank=self._local[0],
            local_world_size=self._local[1],
        )
        self.seq += 1
        return s

    async def run(self) -> None:
        started = self._clock()
        while True:
            await asyncio.sleep(self.window_s)
            now = self._clock()
            s = self.summary(now - started)
            started = now
            if s is None:
                continue
            try:
                ok = await self._send(s)
            except Exception as e:  # the loop's telemetry must never stop the client
                log.debug("perf summary not sent: %s", e)
                ok = False
            if ok:
                self.sent += 1
            else:
                self.failed += 1


def sender_for(
    opts: Options, recorder: PerfRecorder, send: Callable[[PerfSummary], Awaitable[bool]]
) -> PerfSender | None:
    """The client's sender, named as its options say; None with MARDUK_PERF_WINDOW=0."""
    window = window_from_env()
    if window <= 0:
        return None
    return PerfSender(
        recorder,
        send,
        job=opts.job,
        replica=opts.replica,
        worker=opts.worker,
        rank=rank_from_env(opts.worker),
        incarnation=opts.incarnation,
        devices=opts.devices,
        window_s=window,
    )
