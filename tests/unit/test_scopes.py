"""The scopes' state kept together: one scope added, changed and dropped in one place."""

from __future__ import annotations

from marduk.core.drmap import WorkerKey
from marduk.core.records import EpochKey, EpochRecord
from marduk.core.scopes import Scopes

R1 = EpochKey("j", "r1")
W0, W1 = WorkerKey("j", "r1", 0), WorkerKey("j", "r1", 1)


def test_a_restored_scope_issues_above_its_reserved_ceiling_once() -> None:
    s = Scopes()
    s.restore(EpochRecord(job="j", replica="r1", epoch=3, ceiling=100))
    assert s.next_epoch(R1) == 101
    s.put(R1, EpochRecord(job="j", replica="r1", epoch=101, ceiling=200))
    assert s.next_epoch(R1) == 102  # the floor is used up


def test_a_scope_is_in_flight_until_every_awaited_worker_confirms() -> None:
    s = Scopes()
    s.put(R1, EpochRecord(job="j", replica="r1", epoch=1))
    s.issued(R1, [W0, W1], now=10.0)
    assert s.in_flight(R1) and s.awaiting(R1) == {W0, W1}
    s.confirm(R1, W0)
    assert s.in_flight(R1)
    s.confirm(R1, W1)
    assert not s.in_flight(R1) and s.awaiting(R1) == frozenset()
    s.issued(R1, None, now=11.0)  # a checkpoint: nobody held
    assert not s.in_flight(R1)


def test_an_inherited_restart_is_ours_once_we_issue() -> None:
    s = Scopes()
    s.restore(EpochRecord(job="j", replica="r1", epoch=2))
    s.inherit(R1, W0)
    assert s.inherited(R1) and s.awaiting(R1) == {W0}
    s.issued(R1, [W0], now=1.0)
    assert not s.inherited(R1)


def test_resends_are_due_by_interval_and_stop_when_confirmed() -> None:
    s = Scopes()
    s.issued(R1, [W0], now=10.0)
    assert s.due(10.5, 1.0) == []
    assert s.due(11.0, 1.0) == [R1]
    s.sent(R1, 11.0)
    s.confirm(R1, W0)
    assert s.due(20.0, 1.0) == [] and not s._last_sent


def test_vacancies_expire_oldest_first_and_a_return_cancels_one() -> None:
    s = Scopes()
    r2 = EpochKey("j", "r2")
    for k in (R1, r2):
        s.put(k, EpochRecord(job=k.job, replica=k.replica, epoch=1))
    s.vacated(R1, 0.0)
    s.vacated(r2, 5.0)
    s.vacated(EpochKey("j", "never"), 0.0)  # no record: nothing to keep
    assert s.vacant_for(10.0, 12.0) == [R1]
    s.occupied(r2)
    assert s.vacant_for(10.0, 100.0) == []
    s.vacated(r2, 50.0)
    s.vacant_all({R1}, 60.0)  # after a takeover: counts from now, occupied ones not
    assert s.vacant_for(10.0, 70.0) == [r2]
    assert s.drop(r2) and not s.drop(r2) and r2 not in s
