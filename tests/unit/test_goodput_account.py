"""bench/goodput_account.py: where a worker's time went, from a recorded timeline (pure)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from goodput_account import account, ettr, incarnations


def ev(ev: str, t: float, pid: int, **fields: object) -> dict[str, object]:
    return {"ev": ev, "t": t, "pid": pid, **fields}


def life(pid: int, spawned: float, restored: int, steps: range, dt: float = 1.0) -> list[dict]:  # type: ignore[type-arg]
    """A trainer started at ``spawned``: 0.5 s import, 0.5 s init, 1 s restore, 1 s compile,
    then a step every ``dt``, from ``restored + 1``."""
    out = [
        ev("begin", spawned + 0.5, pid),
        ev("restore", spawned + 1, pid),
        ev("restored", spawned + 2, pid, step=restored),
    ]
    t = spawned + 3
    for k in steps:
        out.append(ev("step", t, pid, step=k))
        t += dt
    return out


def test_a_kill_loses_the_steps_after_the_checkpoint_and_the_gap_is_split_by_phase() -> None:
    # pid 1 steps 1..10 at t=3..12, saves step 5 (t 7.2-7.4), is killed at 12.5, its supervisor
    # notices at 12.7 and starts pid 2 at 13; pid 2 restores step 5 and redoes 6.. from t=16.
    first = [*life(1, 0, 0, range(1, 11)), ev("saved", 7.4, 1, step=5, t0=7.2)]
    second = life(2, 13, 5, range(6, 20))
    incs = incarnations([(0, 1), (13, 2)], first + second)
    acc = account(incs, notices=[12.7], failures=[12.5], t0=3, t1=30)
    s = acc.seconds
    assert s["detection"] == pytest.approx(0.2)  # 12.5 -> 12.7
    assert s["restart"] == pytest.approx(0.3)  # 12.7 -> 13
    assert s["import"] == pytest.approx(0.5)  # spawned -> begin
    assert s["init"] == pytest.approx(0.5)  # begin -> restore
    assert s["restore"] == pytest.approx(1.0)
    assert s["compile"] == pytest.approx(1.0)  # restored -> first step (6) at 16
    assert s["checkpoint"] == pytest.approx(0.2)
    # Lost: steps 6..10 of pid 1 (t 7-12, minus the checkpoint's 0.2 s inside step 6's span)
    # and the half step cut off by the kill (12 -> 12.5).
    assert s["lost"] == pytest.approx(5 - 0.2 + 0.5)
    assert acc.steps_lost == 5
    # Productive: steps 2..5 of pid 1 (t 3-7, less 0) and pid 2's steps after its first
    # (16 -> 29) plus its step in flight when the window closes (29 -> 30).
    assert s["productive"] == pytest.approx(4 + 13 + 1)
    assert sum(s.values()) == pytest.approx(27)
    assert acc.steps_kept == 5 + 14  # steps 1..5 of pid 1 (from t0=3) and 6..19 of pid 2
    assert acc.restarts == 1
    assert ettr(acc) == pytest.approx(18 / 27)


def test_a_sigterm_checkpoint_loses_nothing_but_the_step_in_flight() -> None:
    # A device event at 10.2; the trainer hears of it (SIGTERM) at 10.4, saves step 8, exits at
    # 10.6; the next one starts at 10.7 and restores step 8.
    first = [
        *life(1, 0, 0, range(1, 9)),
        ev("sigterm", 10.4, 1),
        ev("saved", 10.5, 1, step=8, t0=10.4),
        ev("exit", 10.6, 1),
    ]
    second = life(2, 10.7, 8, range(9, 12))
    acc = account(
        incarnations([(0, 1), (10.7, 2)], first + second), [], failures=[10.2], t0=3, t1=16
    )
    s = acc.seconds
    assert acc.steps_lost == 0
    assert s["lost"] == pytest.approx(0.2)  # step 9 in flight, 10 -> 10.2
    assert s["detection"] == pytest.approx(0.2)
    assert s["stop"] == pytest.approx(0.2)  # the checkpoint on the way out is part of stopping
    assert s["checkpoint"] == 0
    assert s["restart"] == pytest.approx(0.1)
    assert s["productive"] == pytest.approx(7 + 2 + 0.3)  # 3 -> 10; 13.7 -> 15.7 (+ in flight)


def test_a_failure_elsewhere_is_blamed_for_this_workers_restart() -> None:
    # Only failure: another worker's crash at 5.05; this one gets SIGTERM at 5.3.
    first = [*life(1, 0, 0, range(1, 4)), ev("sigterm", 5.3, 1), ev("exit", 5.4, 1)]
    second = life(2, 6, 3, range(4, 6))
    acc = account(incarnations([(0, 1), (6, 2)], first + second), [], [5.05], 3, 11)
    assert acc.seconds["detection"] == pytest.approx(0.25)
    assert acc.seconds["lost"] == pytest.approx(0.05)


def test_a_trainer_killed_while_starting_gives_its_startup_to_the_failure() -> None:
    # pid 2 is killed at 14 during its restore: the restart of pid 3 counts from there, and
    # what pid 2 did is import, init and restore, not steps.
    first = life(1, 0, 0, range(1, 9))  # killed at 11, noticed at 11.1
    second = life(2, 12, 8, range(0))[:2]  # begin 12.5, restore 13; killed at 14
    third = life(3, 15, 8, range(9, 12))
    acc = account(
        incarnations([(0, 1), (12, 2), (15, 3)], first + second + third),
        notices=[11.1, 14.2],
        failures=[11, 14],
        t0=3,
        t1=21,
    )
    s = acc.seconds
    assert s["restore"] == pytest.approx(1 + 1)  # pid 2: 13 -> 14; pid 3: 16 -> 17
    assert s["detection"] == pytest.approx(0.1 + 0.2)
    assert acc.restarts == 2
    assert sum(s.values()) == pytest.approx(18)


def test_the_step_in_flight_when_the_window_closes_is_productive() -> None:
    # The benchmark stops the job just after the window: that stop cuts off no kept work.
    steps = [*life(1, 0, 0, range(1, 9)), ev("sigterm", 10.6, 1), ev("exit", 10.7, 1)]
    acc = account(incarnations([(0, 1)], steps), [], [], t0=3, t1=10.5)
    assert acc.seconds["productive"] == pytest.approx(7.5)
    assert acc.seconds["lost"] == 0
