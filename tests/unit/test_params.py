"""Live parameters, the pure rules: values checked, sets applied, versions and who is behind."""

from __future__ import annotations

import pytest

from agent.library.params import merge_rank_acks
from marduk.core.params import (
    Ack,
    ParamsError,
    apply_set,
    behind,
    describe_change,
    worker_states,
)
from marduk.wire.params import (
    MAX_LIST,
    MAX_STRING,
    JobParams,
    ParamValueError,
    parse_assignment,
)


def test_assignments_read_json_else_text() -> None:
    assert parse_assignment("lr=3e-4") == ("lr", 3e-4)
    assert parse_assignment("log_every=50") == ("log_every", 50)
    assert parse_assignment("profile=true") == ("profile", True)
    assert parse_assignment("name=resnet") == ("name", "resnet")
    assert parse_assignment('tags=[1, "a"]') == ("tags", [1, "a"])
    assert parse_assignment("lr=null") == ("lr", None)
    assert parse_assignment("path=a=b") == ("path", "a=b")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("lr", "not KEY=VALUE"),
        ("1lr=1", "invalid parameter name"),
        ("a b=1", "invalid parameter name"),
        ('x={"a": 1}', "objects are not parameters"),
        ("x=[[1]]", "lists of lists"),
        ("x=" + "a" * (MAX_STRING + 1), "at most 256"),
        ("x=" + str(list(range(MAX_LIST + 1))), "at most 16"),
        ("x=1e999", "not a finite number"),
        ("x=" + str(2**60), "beyond"),
    ],
)
def test_bad_input_is_one_line_naming_it(text: str, why: str) -> None:
    with pytest.raises(ParamValueError, match=why) as e:
        parse_assignment(text)
    assert "\n" not in str(e.value)


def test_a_set_bumps_the_version_and_says_old_and_new() -> None:
    p0 = JobParams(job="j")
    r1 = apply_set(p0, {"lr": 0.1, "log_every": 10}, replica=None, by="ann@h", now=5.0)
    assert r1.params.version == 1 and r1.params.values == {"lr": 0.1, "log_every": 10}
    assert r1.params.set_by == "ann@h" and r1.params.set_at == 5.0
    r2 = apply_set(r1.params, {"lr": 0.05, "log_every": 10}, replica=None, by="b", now=6.0)
    assert r2.changed == ["lr"] and r2.old == {"lr": 0.1} and r2.new == {"lr": 0.05}
    assert describe_change(r2, None) == "version 2: lr: 0.1 -> 0.05"
    # The same values again: not news, the version stays.
    same = apply_set(r2.params, {"lr": 0.05}, replica=None, by="b", now=7.0)
    assert same.changed == [] and same.params.version == 2
    # 1 and True are different parameters.
    r3 = apply_set(r2.params, {"log_every": True}, replica=None, by="b", now=8.0)
    assert r3.changed == ["log_every"]
    # null removes.
    r4 = apply_set(r3.params, {"lr": None}, replica=None, by="b", now=9.0)
    assert "lr" not in r4.params.values and r4.old == {"lr": 0.05}


def test_replica_overrides_and_what_each_runs() -> None:
    p = apply_set(JobParams(job="j"), {"lr": 0.1}, replica=None, by="", now=0).params
    p = apply_set(p, {"lr": 0.2}, replica="r1", by="", now=0).params
    assert p.effective("r0") == {"lr": 0.1} and p.effective("r1") == {"lr": 0.2}
    p = apply_set(p, {"lr": None}, replica="r1", by="", now=0).params
    assert p.overrides == {} and p.effective("r1") == {"lr": 0.1}


def test_compare_and_set_on_the_version() -> None:
    p = apply_set(JobParams(job="j"), {"lr": 0.1}, replica=None, by="", now=0).params
    with pytest.raises(ParamsError, match="at version 1, not 0") as e:
        apply_set(p, {"lr": 0.2}, replica=None, by="", now=0, if_version=0)
    assert e.value.code == "conflict"
    assert apply_set(p, {"lr": 0.2}, replica=None, by="", now=0, if_version=1).params.version == 2


def test_too_many_keys() -> None:
    with pytest.raises(ParamsError, match="at most 64"):
        apply_set(JobParams(job="j"), {f"k{i}": i for i in range(65)}, replica=None, by="", now=0)


def test_who_is_behind() -> None:
    p = JobParams(job="j", version=3)
    workers = [("r0", 0), ("r1", 0), ("r2", 0)]
    applied = {
        ("r0", 0): Ack(3, {}),
        ("r1", 0): Ack(2, {}),
        ("r2", 0): Ack(3, {"lr": "too high"}),
    }
    rows = worker_states(p, workers, applied)
    assert [(w.replica, w.state) for w in rows] == [
        ("r0", "applied"),
        ("r1", "behind"),
        ("r2", "rejected"),
    ]
    assert behind(p, workers, applied) == 1
    assert behind(p, [*workers, ("r3", 0)], applied) == 2  # never acknowledged
    assert behind(JobParams(job="j"), workers, {}) == 0


def test_a_worker_of_several_ranks_runs_the_lowest_version_and_shows_each() -> None:
    """Under one agent with four local ranks: rank 3 has not acknowledged version 2 yet, so
    the worker is behind (never 'applied' on the first rank's word), and each rank is shown."""
    version, rejected, ranks = merge_rank_acks(
        {0: (2, {}), 1: (2, {"lr": "above 1.0"}), 2: (2, {}), 3: (1, {})}, 4
    )
    assert (version, rejected) == (1, {"lr": "above 1.0"})
    p = JobParams(job="j", version=2)
    [row] = worker_states(p, [("r0", 0)], {("r0", 0): Ack(version, rejected, tuple(ranks))})
    assert (row.version, row.state) == (1, "behind")
    assert [(r.rank, r.state) for r in row.ranks] == [
        (0, "applied"),
        (1, "rejected"),
        (2, "applied"),
        (3, "behind"),
    ]
    assert behind(p, [("r0", 0)], {("r0", 0): Ack(version, rejected, tuple(ranks))}) == 1
    # A rank that never said anything counts as 0.
    assert merge_rank_acks({0: (2, {})}, 2)[0] == 0
