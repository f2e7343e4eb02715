"""Timeouts learned from the job (agent/supervise/learned_timeouts.py), pure: observed times in,
timeouts out, and the supervision core watching with them (``now`` passed in)."""

from __future__ import annotations

import pytest

from agent.supervise.learned_timeouts import (
    MIN_GAPS,
    Bounds,
    Learning,
    Timeouts,
    high_percentile,
    learned,
)
from agent.supervise.run_config import ConfigError, timeout_option
from agent.supervise.supervision import GiveUp, Limits, Restart, Supervision


def test_a_multiple_of_the_99th_percentile_within_the_bounds() -> None:
    samples = [0.2] * 99 + [5.0]  # one slow step in a hundred: the 99th percentile ignores it
    assert high_percentile(samples) == 0.2
    assert learned(samples, Bounds(0.5, 60.0), 5.0, 20) == pytest.approx(1.0)
    assert learned(samples, Bounds(3.0, 60.0), 5.0, 20) == 3.0  # bounded below
    assert learned([100.0] * 30, Bounds(3.0, 60.0), 5.0, 20) == 60.0  # and above
    assert learned([0.2] * 19, Bounds(3.0, 60.0), 5.0, 20) is None  # not enough seen yet


def test_until_learned_the_upper_bound_applies_and_fixed_timeouts_never_change() -> None:
    t = Timeouts(Learning(hang=Bounds(1.0, 600.0)), fixed_hang_s=30.0, fixed_startup_s=99.0)
    assert t.hang_s() == 600.0 and t.startup_s() == 99.0
    for _ in range(MIN_GAPS):
        t.seen.gap(0.5)
    assert t.hang_s() == pytest.approx(2.5) and t.hang_s(in_section=True) == 600.0
    assert "hang 2.5s (learned from 20 steps)" in t.describe()
    plain = Timeouts(Learning(), fixed_hang_s=30.0, fixed_startup_s=99.0)
    for _ in range(100):
        plain.seen.gap(0.1)
    assert plain.hang_s() == 30.0 and plain.describe() == ""


def step_every(core: Supervision, seconds: float, steps: int, now: float) -> float:
    for i in range(steps):
        now += seconds
        core.progress(0, i, now)
        assert core.tick(now) is None
    return now


def test_a_02s_step_job_is_hung_after_the_learned_timeout_not_the_fixed_one() -> None:
    core = Supervision(Limits(learning=Learning(hang=Bounds(2.0, 600.0))))
    core.started(0.0)
    now = step_every(core, 0.2, 30, 5.0)
    assert core.tick(now + 1.9) is None
    d = core.tick(now + 2.1)  # 5 x 0.2 s is under the lower bound: 2 s
    assert isinstance(d, Restart) and d.failure == "hung" and "for 2s" in d.why


def test_what_was_learned_outlives_the_incarnation_and_startup_is_learned_from_starts() -> None:
    learning = Learning(hang=Bounds(1.0, 600.0), startup=Bounds(5.0, 1800.0))
    core = Supervision(Limits(learning=learning))
    core.started(0.0)
    now = step_every(core, 0.4, 30, 3.0)  # first step 3.4 s after the start
    core.stopped()
    core.started(now)
    assert core.timeouts.startup_s() == pytest.approx(17.0)  # 5 x 3.4 s
    assert core.tick(now + 16.0) is None
    d = core.tick(now + 17.5)
    assert isinstance(d, Restart) and "no first step within 17s" in d.why
    core.started(now + 20.0)
    core.progress(0, 1, now + 21.0)
    d = core.tick(now + 23.5)  # 5 x 0.4 s, learned by the incarnation before
    assert isinstance(d, Restart) and "for 2s" in d.why


def test_a_long_section_is_no_step_interval_and_is_timed_on_its_own() -> None:
    core = Supervision(Limits(learning=Learning(hang=Bounds(1.0, 600.0))))
    core.started(0.0)
    now = step_every(core, 0.2, 30, 1.0)
    for _ in range(3):  # three checkpoints of 10 s: inside them, no step hang
        core.section(0, "checkpoint", True, None, now)
        assert core.tick(now + 9.0) is None
        now += 10.0
        core.section(0, "checkpoint", False, None, now)
        now = step_every(core, 0.2, 5, now)
    assert core.timeouts.hang_s() == pytest.approx(1.0)  # the checkpoints did not stretch it
    core.section(0, "checkpoint", True, None, now)
    assert core.tick(now + 49.0) is None
    d = core.tick(now + 51.0)  # learned for the section: 5 x 10 s
    assert isinstance(d, Restart) and "section 'checkpoint' open for more than 50s" in d.why


def test_stop_restarting_still_applies_to_a_learned_hang() -> None:
    core = Supervision(Limits(learning=Learning(hang=Bounds(1.0, 600.0))))
    core.started(0.0)
    now = step_every(core, 0.2, 30, 1.0)
    core.stop_restarting("asked")
    assert isinstance(core.tick(now + 1.5), GiveUp)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("600", (600.0, None)),
        ("auto", (600.0, Bounds(3.0, 600.0))),
        ("auto:1:120", (120.0, Bounds(1.0, 120.0))),
    ],
)
def test_the_option_takes_seconds_or_auto_with_bounds(
    value: str, expected: tuple[float, Bounds | None]
) -> None:
    assert timeout_option(value, "--hang-timeout", (3.0, 600.0)) == expected


@pytest.mark.parametrize("value", ["soon", "0", "auto:5", "auto:9:3", "auto:x:9", "inf"])
def test_a_bad_timeout_option_is_one_line_naming_it(value: str) -> None:
    with pytest.raises(ConfigError, match="--hang-timeout"):
        timeout_option(value, "--hang-timeout", (3.0, 600.0))
