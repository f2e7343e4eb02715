"""What is done about a straggler (marduk/core/straggler_policy.py): pure, time passed in."""

from __future__ import annotations

import pytest

from marduk.core.straggler_policy import (
    ActionConfig,
    JobRoom,
    Straggler,
    StragglerActions,
    parse_job_actions,
)
from marduk.core.stragglers import RankKey

A = RankKey("j", "r1", 0, 1)
B = RankKey("j", "r2", 0, 2)


def slow(key: RankKey = A, since: float = 0.0, relative: float = 0.6) -> Straggler:
    return Straggler(key, "compute", since, relative, (f"gpu-{key.rank}",))


def room(members: int = 2, min_nodes: int = 2, spares: int = 1, **kw: object) -> JobRoom:
    base = {"resizing": "", "last_resize_at": 0.0}
    return JobRoom(members, min_nodes, spares, **{**base, **kw})  # type: ignore[arg-type]


def actions(mode: str = "drain", **kw: object) -> StragglerActions:
    return StragglerActions(ActionConfig(mode=mode, act_after_s=10.0, interval_s=60.0, **kw))  # type: ignore[arg-type]


def test_report_only_by_default_says_nothing_and_does_nothing() -> None:
    a = StragglerActions()
    assert a.decide([slow()], {"j": room()}, 1000.0) == []


def test_a_persistent_straggler_with_a_spare_is_drained_once_per_interval() -> None:
    a = actions()
    assert a.decide([slow()], {"j": room()}, 5.0) == []  # not persistent yet
    [v] = a.decide([slow()], {"j": room()}, 10.0)
    assert (v.act, v.how, v.devices) == (True, "spare", ("gpu-1",))
    # The rank acted on reports on until its trainer stops: not a new case, nothing said.
    assert a.decide([slow()], {"j": room()}, 12.0) == []
    # The same job again within the interval (another straggler, or the same one still
    # reported): told once why not, then quiet.
    [w] = a.decide([slow(B, since=20.0)], {"j": room()}, 40.0)
    assert not w.act and "at most one action per job per 60 s" in w.why
    assert a.decide([slow(B, since=20.0)], {"j": room()}, 45.0) == []
    [x] = a.decide([slow(B, since=20.0)], {"j": room()}, 70.0)
    assert x.act and x.key == B


def test_the_jobs_last_membership_change_damps_too() -> None:
    """A new leader has no memory of its own actions: the epoch record's last resize stands
    for them."""
    [v] = actions().decide([slow()], {"j": room(last_resize_at=0.0 + 30.0)}, 50.0)
    assert not v.act and "resize interval" in v.why
    [w] = actions().decide([slow()], {"j": room(last_resize_at=30.0)}, 90.0)
    assert w.act


def test_without_a_spare_drain_never_acts_and_shrink_stops_at_min() -> None:
    [v] = actions("drain").decide([slow()], {"j": room(members=3, min_nodes=1, spares=0)}, 10.0)
    assert not v.act and "no free spare" in v.why
    [w] = actions("shrink").decide([slow()], {"j": room(members=3, min_nodes=1, spares=0)}, 10.0)
    assert (w.act, w.how) == (True, "shrink")
    [x] = actions("shrink").decide([slow()], {"j": room(members=2, min_nodes=2, spares=0)}, 10.0)
    assert not x.act and "at MIN (2 nodes)" in x.why


@pytest.mark.parametrize(
    ("r", "why"),
    [
        (None, "not a --nnodes job"),
        (room(members=0), "no membership in force"),
        (room(resizing="applying"), "resize of the job is under way"),
    ],
)
def test_a_job_that_cannot_hand_its_ranks_over_is_left_alone(r: JobRoom | None, why: str) -> None:
    [v] = actions().decide([slow()], {"j": r}, 10.0)
    assert not v.act and why in v.why


def test_the_worst_straggler_of_a_job_goes_first_and_only_it() -> None:
    out = actions().decide([slow(A, relative=0.7), slow(B, relative=0.5)], {"j": room()}, 10.0)
    assert [(v.key, v.act) for v in out] == [(B, True)]


def test_a_reason_is_said_again_for_a_new_episode() -> None:
    a = actions("drain")
    r = {"j": room(spares=0)}
    assert len(a.decide([slow(since=0.0)], r, 10.0)) == 1
    assert a.decide([slow(since=0.0)], r, 12.0) == []
    assert a.decide([], r, 14.0) == []  # cleared: the episode ends
    assert len(a.decide([slow(since=20.0)], r, 30.0)) == 1


def test_devices_unknown_are_never_drained() -> None:
    s = Straggler(A, "compute", 0.0, 0.5, ())
    [v] = actions().decide([s], {"j": room()}, 10.0)
    assert not v.act


def test_per_job_actions_override_the_default() -> None:
    a = StragglerActions(ActionConfig(mode="report", jobs=(("j", "drain"),), act_after_s=0.0))
    assert a.config.ever_acts
    [v] = a.decide([slow()], {"j": room()}, 1.0)
    assert v.act
    other = RankKey("k", "r1", 0, 1)
    assert a.decide([slow(other)], {"k": room()}, 1.0) == []


def test_job_actions_parse_and_bad_ones_are_named() -> None:
    assert parse_job_actions(["a=drain,b=shrink", "a=report"]) == (("a", "report"), ("b", "shrink"))
    for bad in ("a", "=drain", "a=stop"):
        with pytest.raises(ValueError, match="expected JOB=ACTION"):
            parse_job_actions([bad])
    with pytest.raises(ValueError):
        ActionConfig(mode="stop")  # type: ignore[arg-type]
