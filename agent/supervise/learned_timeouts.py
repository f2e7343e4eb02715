"""Hang and startup timeouts learned from the job (``--hang-timeout auto``,
``--startup-timeout auto``). Pure: observations in (seconds, measured by the caller from the
``now`` it passes the supervision core), timeouts out; no clock, no I/O.

NVRx's fault tolerance computes its timeouts from observed times too: a safety factor (5) times
the longest interval seen between heartbeats, and from the start to the first one, merged with
the previous values across restarts. Here it is a multiple (``factor``, 5 by default) of a high
percentile (the 99th) of what the agent saw, bounded below and above:

* **hang**: the intervals between two signs of progress of one rank (a step, a heartbeat, a
  section opened or closed) outside any section: a section is timed on its own, so a long
  checkpoint is no step interval. Learned once ``MIN_GAPS`` intervals were seen; until then,
  and while a rank is inside a section with no timeout of its own, the upper bound applies;
* **startup**: from a rank's start to its first sign of progress, one observation per
  incarnation (the first incarnation has none: the upper bound);
* **sections** opened without a timeout of their own: the section's observed durations, once
  ``MIN_SECTIONS`` of them were seen (an explicit ``timeout=`` always wins).

Observations are kept by the agent across the trainers' restarts (bounded: the last ``KEEP``
intervals, ``KEEP_STARTUPS`` startups, ``KEEP_SECTIONS`` durations of at most ``MAX_SECTIONS``
names), so a restarted trainer is watched with what its predecessors taught.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

PERCENTILE: Final = 0.99
FACTOR: Final = 5.0
HANG_BOUNDS: Final = (3.0, 600.0)  # seconds, the defaults of ``--hang-timeout auto``
STARTUP_BOUNDS: Final = (60.0, 1800.0)  # of ``--startup-timeout auto``
MIN_GAPS: Final = 20
MIN_SECTIONS: Final = 3
KEEP: Final = 1000
KEEP_STARTUPS: Final = 16
KEEP_SECTIONS: Final = 100
MAX_SECTIONS: Final = 32


@dataclass(frozen=True, slots=True)
class Bounds:
    low: float
    high: float

    def clamp(self, value: float) -> float:
        return min(self.high, max(self.low, value))


@dataclass(frozen=True, slots=True)
class Learning:
    """What is learned (``None``: that timeout stays the fixed option) and how."""

    hang: Bounds | None = None
    startup: Bounds | None = None
    factor: float = FACTOR


NOT_LEARNING: Final = Learning()  # both timeouts fixed (the options' numbers)


def high_percentile(samples: Sequence[float], q: float = PERCENTILE) -> float:
    """The nearest-rank ``q`` percentile of ``samples`` (not empty)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def learned(
    samples: Sequence[float], bounds: Bounds, factor: float, min_samples: int
) -> float | None:
    """``factor`` x the high percentile of ``samples``, within ``bounds``; None with fewer
    than ``min_samples`` (not yet learned)."""
    if len(samples) < max(1, min_samples):
        return None
    return bounds.clamp(factor * high_percentile(samples))


class Observations:
    """What the agent saw of its trainers, across incarnations (bounded)."""

    def __init__(self) -> None:
        self.gaps: deque[float] = deque(maxlen=KEEP)
        self.startups: deque[float] = deque(maxlen=KEEP_STARTUPS)
        self.sections: dict[str, deque[float]] = {}

    def gap(self, seconds: float) -> None:
        if seconds >= 0:
            self.gaps.append(seconds)

    def startup(self, seconds: float) -> None:
        if seconds >= 0:
            self.startups.append(seconds)

    def section(self, name: str, seconds: float) -> None:
        seen = self.sections.get(name)
        if seen is None:
            if len(self.sections) >= MAX_SECTIONS or seconds < 0:
                return
            seen = self.sections[name] = deque(maxlen=KEEP_SECTIONS)
        seen.append(seconds)


class Timeouts:
    """The timeouts in force: the fixed options, or what ``learning`` makes of ``seen``."""

    def __init__(self, learning: Learning, fixed_hang_s: float, fixed_startup_s: float) -> None:
        self.learning = learning
        self.fixed_hang_s = fixed_hang_s
        self.fixed_startup_s = fixed_startup_s
        self.seen = Observations()

    def hang_s(self, in_section: bool = False) -> float:
        """No progress for this long is a hang; ``in_section``: a rank is inside a section
        with no timeout of its own (its time is no step interval: the upper bound)."""
        b = self.learning.hang
        if b is None:
            return self.fixed_hang_s
        if in_section:
            return b.high
        value = learned(self.seen.gaps, b, self.learning.factor, MIN_GAPS)
        return b.high if value is None else value

    def startup_s(self) -> float:
        b = self.learning.startup
        if b is None:
            return self.fixed_startup_s
        value = learned(self.seen.startups, b, self.learning.factor, 1)
        return b.high if value is None else value

    def section_s(self, name: str) -> float | None:
        """A learned timeout for a section opened without one (None: none yet, or not
        learning hangs)."""
        b = self.learning.hang
        seen = self.seen.sections.get(name)
        if b is None or seen is None:
            return None
        return learned(seen, b, self.learning.factor, MIN_SECTIONS)

    def describe(self) -> str:
        """One line for status (empty when nothing is learned: plain mode says nothing)."""
        parts = []
        if self.learning.hang is not None:
            n = len(self.seen.gaps)
            how = (
                f"learned from {n} steps"
                if n >= MIN_GAPS
                else f"upper bound, learning ({n}/{MIN_GAPS} steps)"
            )
            parts.append(f"hang {round(self.hang_s(), 3):g}s ({how})")
        if self.learning.startup is not None:
            n = len(self.seen.startups)
            how = f"learned from {n} start(s)" if n else "upper bound, learning"
            parts.append(f"startup {round(self.startup_s(), 3):g}s ({how})")
        return ", ".join(parts)
