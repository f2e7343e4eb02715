"""Where a Marduk restart's time goes, read from one bench_restart.py run (``--breakdown``).

Every agent logs (at info, to its own ``agent-<replica>-<worker>.log`` in the run's directory)
when it sees its trainer exit, when a restart command makes it stop its trainer, when the stop
is over, and when the next trainer runs; the workers record the crash and their first
statement (``events-<rank>.jsonl``). Per fault, from the crash (rank 0's last event):

* **detect**: rank 0's agent sees the exit (``trainer crashed``);
* **command**: the other agents have the restart command (``stopping the trainer``): the
  report, the controller's decision and commit, the publish and its delivery (median agent);
* **stop**: their trainers are gone and every leftover checked (median agent);
* **start**: the next trainer runs its first statement (median agent);
* **slowest**: the last of the 8 running, minus the median one's (the tail the job waits for).

Log timestamps have millisecond resolution and the agents' clock is the workers' (one machine).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+\s+agent\.supervisor: (.*)$")
_STOPPING = re.compile(r"stopping the trainer \(pid \d+\): restart command epoch (\d+)")
_STOPPED = re.compile(r"^restart command epoch (\d+):")
_STARTED = re.compile(r"^trainer started: pid \d+, epoch (\d+)")
STAGES = ("detect", "command", "stop", "start", "slowest")


def _when(stamp: str, ms: str) -> float:
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


def agent_marks(log: Path) -> dict[str, dict[int, float]]:
    """For one agent: epoch -> when it began stopping, finished, started; and each crash seen
    (keyed by its order)."""
    marks: dict[str, dict[int, float]] = {
        "stopping": {},
        "stopped": {},
        "started": {},
        "crashed": {},
    }
    for line in log.read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        t, message = _when(m.group(1), m.group(2)), m.group(3)
        if message.startswith("trainer crashed"):
            marks["crashed"][len(marks["crashed"])] = t
        elif s := _STOPPING.search(message):
            marks["stopping"].setdefault(int(s.group(1)), t)
        elif s := _STOPPED.match(message):
            marks["stopped"].setdefault(int(s.group(1)), t)
        elif s := _STARTED.match(message):
            marks["started"].setdefault(int(s.group(1)), t)
    return marks


def breakdown(bench_dir: Path, faults: int) -> dict[str, float]:
    """Median over the faults of each stage (ms). Fault k is rank 0's crash in incarnation k
    and the restart at epoch k + 1 (scope job: one epoch per restart)."""
    events = [
        json.loads(line)
        for f in bench_dir.glob("events-*.jsonl")
        for line in f.read_text().splitlines()
        if line.strip()
    ]
    crash = {e["inc"]: e["t"] for e in events if e["ev"] == "crash"}
    first_start: dict[tuple[int, int], float] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        if e["ev"] == "start":
            first_start.setdefault((e["rank"], e["inc"]), e["t"])
    crasher = agent_marks(bench_dir / "agent-r0-0.log")
    others = [
        agent_marks(p) for p in sorted(bench_dir.glob("agent-*.log")) if p.name != "agent-r0-0.log"
    ]
    stages: dict[str, list[float]] = {s: [] for s in STAGES}
    for k in range(faults):
        epoch = k + 1
        t0, seen = crash.get(k), crasher["crashed"].get(k)
        got = [m["stopping"][epoch] for m in others if epoch in m["stopping"]]
        done = [m["stopped"][epoch] for m in others if epoch in m["stopped"]]
        starts = [t for (rank, inc), t in first_start.items() if inc == k + 1 and rank != 0]
        if t0 is None or seen is None or not got or not done or not starts:
            continue  # an agent that had no trainer to stop, or a fault not measured
        stages["detect"].append(seen - t0)
        stages["command"].append(statistics.median(got) - seen)
        stages["stop"].append(
            statistics.median(d - g for d, g in zip(sorted(done), sorted(got), strict=False))
        )
        stages["start"].append(statistics.median(starts) - statistics.median(done))
        stages["slowest"].append(max(starts) - statistics.median(starts))
    return {s: round(statistics.median(v) * 1000, 1) for s, v in stages.items() if v}
