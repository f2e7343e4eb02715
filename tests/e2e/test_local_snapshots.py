"""Snapshots every step into the store the agent keeps, with real processes: one agent, two torch
gloo ranks (tests/trainers/snapshot_gloo.py), a controller. A SIGKILL of rank 1's trainer, then a
device event on rank 1's device (``marduk monitor inject-failure``): after each, both ranks
resume from the local store (never the persistent copies the agent writes meanwhile), at most
one step behind the last step both completed (the device event: none lost, the ranks saved at
the notice), and every value they print is the uninterrupted run's.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from agent.library.local_store import LocalStore
from tests.conftest import eventually_sync
from tests.processes import Proc, agent_run, inject
from tests.trainers.snapshot_gloo import expected

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

LINE = re.compile(r"\[rank(\d)\]:(.*)")
START = re.compile(r"start rank (\d) pid (\d+) resuming at (\d+) from (\w+)")
STEP = re.compile(r"step (\d+) value (\S+)")
NOTICE = re.compile(r"notice: saved step (\d+)")


class Run:
    """What each rank printed, by incarnation (a ``start`` line opens one)."""

    def __init__(self, p: Proc) -> None:
        self.incarnations: dict[int, list[dict[str, object]]] = {0: [], 1: []}
        for line in list(p.all):
            m = LINE.search(line)
            if not m:
                continue
            rank, text = int(m.group(1)), m.group(2).strip()
            if s := START.search(text):
                pid, start, source = int(s.group(2)), int(s.group(3)), s.group(4)
                inc = {"pid": pid, "start": start, "source": source, "steps": {}}
                self.incarnations[rank].append(inc)
            elif (s := NOTICE.search(text)) and self.incarnations[rank]:
                self.incarnations[rank][-1]["saved"] = int(s.group(1))
            elif (s := STEP.search(text)) and self.incarnations[rank]:
                steps = self.incarnations[rank][-1]["steps"]
                assert isinstance(steps, dict)
                steps[int(s.group(1))] = float(s.group(2))

    def last(self, rank: int) -> dict[str, object]:
        return self.incarnations[rank][-1]

    def completed(self) -> int:
        """The last step both ranks printed, over everything so far."""
        return min(
            max((k for inc in self.incarnations[r] for k in inc["steps"]), default=0)  # type: ignore[attr-defined]
            for r in (0, 1)
        )


def stepping(p: Proc, incarnations: int, past: int) -> Run:
    """Both ranks in their ``incarnations``-th incarnation, each past step ``past``."""

    def ready() -> bool:
        run = Run(p)
        return all(
            len(run.incarnations[r]) >= incarnations and max(run.last(r)["steps"] or [0]) > past  # type: ignore[call-overload]
            for r in (0, 1)
        )

    eventually_sync(ready, timeout=60)
    return Run(p)


def check_values(run: Run) -> None:
    for rank in (0, 1):
        for inc in run.incarnations[rank]:
            for step, value in inc["steps"].items():  # type: ignore[attr-defined]
                assert value == expected(step, rank, 2), (rank, step, value)


def resumed(p: Proc, incarnation: int, done: int) -> tuple[Run, int]:
    """Both ranks stepping in their ``incarnation``-th incarnation past ``done``, resumed at one
    step, from the local store (never the persistent copies), every value the uninterrupted
    run's."""
    run = stepping(p, incarnation, done + 1)
    starts = {run.last(r)["start"] for r in (0, 1)}
    assert len(starts) == 1, run.incarnations
    assert all(run.last(r)["source"] == "local" for r in (0, 1)), run.incarnations
    check_values(run)
    start = starts.pop()
    assert isinstance(start, int)
    return run, start


def test_two_gloo_ranks_resume_from_the_local_store_after_a_crash_and_a_device_event(
    controller_env: dict[str, str], tmp_path: Path
) -> None:
    store, persist = tmp_path / "store", tmp_path / "persist"
    a = agent_run(
        controller_env,
        *("--replica", "snap", "--nproc-per-node", "2", "--devices", "sd0,sd1"),
        *("--rank-devices", "split", "--local-ckpt-dir", str(store)),
        *("--persist-dir", str(persist), "--persist-interval", "0.5"),
        cmd=[sys.executable, "tests/trainers/snapshot_gloo.py", "--step-seconds", "0.1"],
    )
    t0 = time.monotonic()
    run = stepping(a, 1, 5)
    print(f"stepping after {time.monotonic() - t0:.1f}s")
    assert all(run.last(r)["source"] == "nothing" for r in (0, 1))
    eventually_sync(lambda: LocalStore(persist, rank=1).steps(), timeout=10)  # copies behind

    # A SIGKILL of rank 1's trainer: no notice, no save; at most the step in flight is lost.
    t1 = time.monotonic()
    os.kill(int(run.last(1)["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
    time.sleep(0.3)
    done = Run(a).completed()
    run, start = resumed(a, 2, done)
    print(f"crash: stepping again after {time.monotonic() - t1:.1f}s")
    assert done - 1 <= start <= done, (start, done)

    # A device event on rank 1's device: the notice reaches both before the stop; they save the
    # last step taken (rank 1's, from the failed device, is dropped if not yet written).
    t2 = time.monotonic()
    done = Run(a).completed()
    inject(controller_env, "sd1")
    run, start = resumed(a, 3, done)
    print(f"device event: stepping again after {time.monotonic() - t2:.1f}s")
    assert start >= done, (start, done)  # zero completed steps lost
    # What each rank had written when the notice's save was done: the job took the minimum.
    saved = [run.incarnations[r][1].get("saved") for r in (0, 1)]
    assert None not in saved and start == min(saved), (saved, start)  # type: ignore[type-var]

    a.stop()
    assert a.proc.returncode is not None
