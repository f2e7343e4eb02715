"""Where a worker's time went, from its recorded timeline: the pure core of bench_goodput.py.

Every instant of the measured window is given to exactly one category, from the moments the
trainer (``examples/jax_trainer.py --events``), its supervisor and the benchmark recorded:

* ``productive``: stepping, on a step that is kept (never redone);
* ``lost``: stepping on a step that is redone later (done after the checkpoint the next
  incarnation restores from), or on a step cut off by the failure;
* ``checkpoint``: saving the periodic checkpoint;
* ``detection``: from the failure (the health event's publish, the kill -9) until the worker
  hears of it (SIGTERM) or its supervisor notices its death;
* ``stop``: from SIGTERM until the trainer exited (saving its checkpoint on the way out);
* ``restart``: from the trainer's end until its supervisor started the next one;
* ``import``: from that start until the trainer's main() runs (interpreter, JAX import):
  nearly nothing for a trainer forked from a fork server that imported JAX already;
* ``init``: from main() until the restore begins (JAX's backend, the data, the parameters:
  small programs compiled or loaded from the compilation cache);
* ``restore``: reading the checkpoint and placing it on the devices;
* ``compile``: from the restore to the first step (compiling, or loading the compiled step from
  JAX's persistent cache).

ETTR = productive time / wall time, summed over the job's workers.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

CATEGORIES = (
    "productive",
    "lost",
    "checkpoint",
    "detection",
    "stop",
    "restart",
    "import",
    "init",
    "restore",
    "compile",
)


@dataclass
class Incarnation:
    """One trainer process of a worker."""

    pid: int
    spawned: float  # its supervisor started it
    events: list[dict[str, object]] = field(default_factory=list)  # the trainer's, by time

    def first(self, ev: str) -> dict[str, object] | None:
        return next((e for e in self.events if e["ev"] == ev), None)

    @property
    def restored_step(self) -> int | None:
        e = self.first("restored")
        return int(e["step"]) if e is not None else None  # type: ignore[call-overload]

    def steps(self) -> list[tuple[int, float]]:
        return [(int(e["step"]), float(e["t"])) for e in self.events if e["ev"] == "step"]  # type: ignore[call-overload,arg-type]


@dataclass
class Account:
    seconds: Counter[str] = field(default_factory=Counter)
    steps_kept: int = 0
    steps_lost: int = 0  # done, then redone (or to be redone) after a restore
    restarts: int = 0

    def add(self, other: Account) -> None:
        self.seconds.update(other.seconds)
        self.steps_kept += other.steps_kept
        self.steps_lost += other.steps_lost
        self.restarts += other.restarts


def incarnations(
    spawns: list[tuple[float, int]], events: list[dict[str, object]]
) -> list[Incarnation]:
    """Group a worker's trainer events by process, in start order. ``spawns``: (time, pid)
    of every start its supervisor made; a process with events but no recorded start starts at
    its first event."""
    by_pid: dict[int, Incarnation] = {}
    for t, pid in spawns:
        by_pid.setdefault(pid, Incarnation(pid, t))
    for e in sorted(events, key=lambda e: float(e["t"])):  # type: ignore[arg-type]
        pid = int(e["pid"])  # type: ignore[call-overload]
        inc = by_pid.setdefault(pid, Incarnation(pid, float(e["t"])))  # type: ignore[arg-type]
        inc.events.append(e)
    return sorted(by_pid.values(), key=lambda i: i.spawned)


def account(
    incs: list[Incarnation],
    notices: list[float],
    failures: list[float],
    t0: float,
    t1: float,
) -> Account:
    """Split the window [t0, t1] of one worker into CATEGORIES.

    ``notices``: when its supervisor saw a trainer die without saying goodbye (a kill -9);
    ``failures``: when every failure of the job happened (any worker's: a failure elsewhere
    can restart this worker too). A trainer's end is blamed on the latest failure before it.
    """
    out = Account(restarts=sum(1 for i in incs if t0 <= i.spawned <= t1))
    for start, end, category in slices(incs, notices, failures, t1):
        span = min(end, t1) - max(start, t0)
        if span > 0:
            out.seconds[category] += span
    redo_from = redone_after(incs)
    for n, inc in enumerate(incs):
        for k, t in inc.steps():
            if t0 <= t <= t1:
                if k > redo_from[n]:
                    out.steps_lost += 1
                else:
                    out.steps_kept += 1
    return out


def redone_after(incs: list[Incarnation]) -> list[float]:
    """Per incarnation: the lowest step a later one restored (its steps after that are redone)."""
    out: list[float] = []
    low = float("inf")
    for inc in reversed(incs):
        out.append(low)
        if inc.restored_step is not None:
            low = min(low, inc.restored_step)
    return out[::-1]


def slices(
    incs: list[Incarnation], notices: list[float], failures: list[float], t_end: float
) -> list[tuple[float, float, str]]:
    """The worker's life as (start, end, category) spans, the last one open until ``t_end``."""
    failures = sorted(failures)
    notices = sorted(notices)
    redo_from = redone_after(incs)
    markers: list[tuple[float, object]] = []  # (time, label from then on)
    for n, inc in enumerate(incs):
        nxt = incs[n + 1].spawned if n + 1 < len(incs) else None
        own: list[tuple[float, object]] = [(inc.spawned, "import")]
        stopping = False
        for e in inc.events:
            t, ev = float(e["t"]), e["ev"]  # type: ignore[arg-type]
            if ev == "begin":
                own.append((t, "init"))
            elif ev == "restore":
                own.append((t, "restore"))
            elif ev == "restored":
                own.append((t, "compile"))
            elif ev == "step":
                own.append((t, ("step", n, int(e["step"]) + 1)))  # type: ignore[call-overload]
            elif ev == "saved" and not stopping:
                own.append((float(e["t0"]), "checkpoint"))  # type: ignore[arg-type]
                own.append((t, ("step", n, int(e["step"]) + 1)))  # type: ignore[call-overload]
            elif ev == "sigterm":
                stopping = True
                own.append((t, "stop"))
            elif ev == "exit":
                own.append((t, "restart"))
        if nxt is not None:
            if own[-1][1] != "restart":  # died without a word: its supervisor noticed
                last = own[-1][0]
                i = bisect.bisect_right(notices, last)
                end = notices[i] if i < len(notices) and notices[i] <= nxt else nxt
                own.append((end, "restart"))
            # The failure that ended it: the latest before the trainer heard of it.
            heard = next(t for t, label in own if label in ("stop", "restart"))
            i = bisect.bisect_right(failures, heard)
            if i:
                failed_at = failures[i - 1]
                before = [m for m in own if m[0] < heard]
                if failed_at > before[-1][0]:
                    own.insert(len(before), (failed_at, "detection"))
        markers.extend(own)
    markers.sort(key=lambda m: m[0])

    def resolve(label: object, until: float) -> str:
        if not isinstance(label, tuple):
            return str(label)
        _, n, k = label
        done = any(s == k for s, _t in incs[n].steps())
        if not done:  # cut off by the failure, unless still running when the window closed
            return "productive" if until >= t_end else "lost"
        return "lost" if k > redo_from[n] else "productive"

    ends = [t for t, _ in markers[1:]] + [max(t_end, markers[-1][0])]
    return [(t, end, resolve(label, end)) for (t, label), end in zip(markers, ends, strict=True)]


def ettr(total: Account) -> float:
    wall = sum(total.seconds.values())
    return total.seconds["productive"] / wall if wall else 0.0
