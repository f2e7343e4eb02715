"""The policy's delivery and liveness rules, pure: no server, time passed in."""

from __future__ import annotations

import pytest

from marduk.core.drmap import WorkerKey
from marduk.core.policy import Policy, PolicyConfig, PolicyError
from marduk.core.records import EpochKey
from tests.unit.test_policy import acceptance_map, failed, reg

R1, R2 = WorkerKey("j", "r1", 0), WorkerKey("j", "r2", 0)


def test_a_failure_joining_a_restart_in_flight_still_reaches_that_scope() -> None:
    # r1 on d1,d2 and r2 on d2,d3; r2 has not confirmed d3's restart when d2 fails.
    p = acceptance_map()
    p.on_health(failed("d3", "e1"), now=1)
    r = p.on_health(failed("d2", "e2"), now=2)
    assert [(c.replica, c.epoch, c.devices) for c in r.outcome.commands] == [("r1", 1, ["d2"])]
    # r2 hears of d2 too: the command in flight, again, same epoch, the device merged in.
    assert [(c.replica, c.epoch, c.devices) for c in r.outcome.resent] == [("r2", 1, ["d3", "d2"])]
    assert {(a.replica, a.coalesced) for a in r.reply.actions} == {("r1", False), ("r2", True)}
    # A device already listed sends nothing more: a storm stays bounded per scope.
    for i in range(50):
        storm = p.on_health(failed("d2", f"s{i}"), now=3)
        assert not storm.outcome.commands and not storm.outcome.resent
    # The registration reply carries the merged command (level-triggered convergence).
    assert p.register(reg("r2", ["d2", "d3"], pid=2), now=4).command.devices == ["d3", "d2"]  # type: ignore[union-attr]


def test_unconfirmed_commands_are_resent_about_once_a_second_until_confirmed() -> None:
    p = acceptance_map()
    p.on_health(failed("d3", "e1"), now=10)
    assert not p.tick(10.5).resent
    assert [(c.replica, c.epoch) for c in p.tick(11.0).resent] == [("r2", 1)]
    assert not p.tick(11.5).resent
    assert [c.epoch for c in p.tick(12.0).resent] == [1]
    p.ack(R2, 1, now=12.1)
    assert not p.tick(13.0).resent and not p.tick(20.0).resent


def test_resending_stops_when_the_restart_is_no_longer_pending() -> None:
    p = Policy(PolicyConfig(pending_timeout_s=5, worker_ttl_s=100))
    p.register(reg("r1", ["d1"]), now=0)
    p.on_health(failed("d1", "e1"), now=0)
    assert p.tick(4.0).resent
    assert not p.tick(6.0).resent


def test_silent_workers_go_stale_then_expire_and_release_a_pending_restart() -> None:
    p = Policy(PolicyConfig(worker_ttl_s=10, worker_expiry_s=100))
    p.register(reg("r1", ["d1", "d2"]), now=0)
    p.register(reg("r2", ["d2", "d3"], pid=2), now=0)
    assert p.register(reg("r1", ["d1", "d2"]), now=0).renew_interval == pytest.approx(10 / 3)
    p.on_health(failed("d3", "e1"), now=1)  # r2 restart pending, never acked
    p.register(reg("r1", ["d1", "d2"]), now=8)  # r1 renews, r2 does not
    out = p.tick(10.5)
    assert [(e.kind, e.replica) for e in out.events] == [("worker_stale", "r2")]
    assert p.stale == {R2} and not p.tick(11).events  # announced once
    infos = {w.replica: w.state for w in p.worker_infos()}
    assert infos == {"r1": "live", "r2": "stale"}
    # A stale worker holds nothing pending: the next failure of r2's device is a new restart.
    assert p.on_health(failed("d3", "e2"), now=12).outcome.commands[0].epoch == 2
    # It renews: live again, announced.
    r = p.register(reg("r2", ["d2", "d3"], pid=2), now=13)
    assert [e.kind for e in r.outcome.events] == ["worker_live"] and not p.stale
    # Silent past the expiry: removed, and devices only it used are forgotten.
    p.register(reg("r1", ["d1", "d2"]), now=110)
    out = p.tick(114)
    assert ("worker_expired", "r2") in [(e.kind, e.replica) for e in out.events]
    assert out.deleted_workers == [R2] and "d3" in out.deleted_devices
    assert R2 not in p.workers and not p.drmap.has_device("d3")


def test_a_second_live_process_cannot_take_a_worker_identity() -> None:
    p = Policy(PolicyConfig(worker_ttl_s=10))
    p.register(reg("r1", ["d1"], pid=100), now=0)
    with pytest.raises(PolicyError) as e:
        p.register(reg("r1", ["d1"], pid=200), now=5)
    assert e.value.code == "duplicate_worker" and "pid 100" in str(e.value)
    # The holder's own renewals, and a supervisor's next incarnation, are not duplicates.
    p.register(reg("r1", ["d1"], pid=100), now=6)
    p.register(reg("r1", ["d1"], pid=100, incarnation=1), now=7)
    # A holder silent for the TTL is presumed dead: the new process takes over.
    assert p.register(reg("r1", ["d1"], pid=200, incarnation=0), now=18).result == "updated"
    # A deregistered identity is free at once.
    p.deregister(WorkerKey("j", "r1", 0), "exited", now=19)
    assert p.register(reg("r1", ["d1"], pid=300), now=19).result == "new"


def test_forget_removes_a_job_a_replica_or_a_worker() -> None:
    p = Policy()
    p.register(reg("r1", ["d1"], worker=0), now=0)
    p.register(reg("r1", ["d2"], worker=1, pid=2), now=0)
    p.register(reg("r2", ["d3"], pid=3), now=0)
    p.register(reg("x", ["d9"], job="other", pid=4), now=0)
    p.on_health(failed("d2", "e0", state="degraded"), now=0)
    out = p.forget("j", "r1", 1, now=1)
    assert out.deleted_workers == [WorkerKey("j", "r1", 1)] and out.deleted_devices == ["d2"]
    assert [e.kind for e in out.events] == ["forgotten"]
    assert p.forget("j", None, None, now=2).deleted_workers == [
        WorkerKey("j", "r1", 0),
        WorkerKey("j", "r2", 0),
    ]
    assert [w.job for w in p.worker_infos()] == ["other"]
    assert not p.forget("nope", None, None, now=3).deleted_workers


@pytest.mark.parametrize("replica", ["pod-abc", None])
def test_forgetting_keeps_the_epochs_so_they_never_go_backwards(replica: str | None) -> None:
    """Forgetting a replica (or its job) deleted its epoch record, so the id
    coming back (or a forgotten worker still alive, a fresh process) restarted at epoch 1."""
    p = Policy()
    p.register(reg("pod-abc", ["d1"]), now=0)
    for i in range(3):
        p.on_health(failed("d1", f"e{i}"), now=1 + i)
        p.ack(WorkerKey("j", "pod-abc", 0), i + 1, now=1.5 + i)
    out = p.forget("j", replica, None, now=10)
    assert not out.deleted_epochs and p.epoch_of(EpochKey("j", "pod-abc")) == 3
    p.register(reg("pod-abc", ["d1"], pid=2), now=11)  # a fresh process: seen_epoch 0
    r = p.on_health(failed("d1", "e9"), now=12)
    assert [c.epoch for c in r.outcome.commands] == [4]


def test_restore_gives_every_worker_a_full_ttl_and_remembers_handled_events() -> None:
    p = acceptance_map()
    r = p.on_health(failed("d3", "e1"), now=1)
    handled = r.outcome.handled
    q = Policy.restore(
        p.config, list(p.workers.values()), list(p.epochs.values()), [], handled, now=1000
    )
    assert not q.tick(1001).events  # renewals are not persisted: nobody is stale yet
    dup = q.on_health(failed("d3", "e1"), now=1002)
    assert dup.reply.duplicate and not dup.outcome.commands
    assert [a.epoch for a in dup.reply.actions] == [1]
    assert q.epoch_of(EpochKey("j", "r2")) == 1


def test_an_epoch_near_the_json_limit_is_not_adopted() -> None:
    p = Policy()
    with pytest.raises(PolicyError) as e:
        p.register(reg("r1", ["d1"], epoch=2**53), now=0)
    assert e.value.code == "invalid" and "r1" not in {w.replica for w in p.worker_infos()}


def test_a_failure_on_a_worker_that_already_restarted_starts_a_new_epoch() -> None:
    """Review S1: w0 holds a and c, w1 holds b (one replica). a fails (epoch 1); w0 restarts
    and confirms, w1 is slow; then c fails. Merging c into epoch 1 would leave w0 running on a
    failed device (it has applied epoch 1): a new epoch goes out instead."""
    p = Policy()
    p.register(reg("r1", ["a", "c"], worker=0), now=0)
    p.register(reg("r1", ["b"], worker=1, pid=2), now=0)
    assert [c.epoch for c in p.on_health(failed("a", "e1"), now=1).outcome.commands] == [1]
    p.ack(WorkerKey("j", "r1", 0), 1, now=2)
    r = p.on_health(failed("c", "e2"), now=3)
    assert [(c.epoch, c.devices) for c in r.outcome.commands] == [(2, ["c"])]
    assert not r.outcome.resent
    # While nobody on the device has confirmed, a failure still joins the restart in flight.
    r = p.on_health(failed("b", "e3"), now=4)
    assert not r.outcome.commands and [c.devices for c in r.outcome.resent] == [["c", "b"]]


def test_an_epoch_far_beyond_what_was_reserved_is_not_adopted() -> None:
    p = Policy()
    with pytest.raises(PolicyError):
        p.register(reg("r1", ["d1"], epoch=50_000), now=0)
    assert not p.epochs  # refused before anything changed
    p.register(reg("r1", ["d1"], epoch=5_000), now=1)  # a lost write's worth: adopted
    assert p.epoch_of(EpochKey("j", "r1")) == 5_000


@pytest.mark.parametrize("epoch", [2**31, 2**53])
def test_a_refused_registration_leaves_no_trace(epoch: int) -> None:
    """An epoch refused as ``invalid`` once left the worker "heard from" but
    never recorded: a TTL later the tick raised KeyError and worker_expired repeated forever."""
    p = Policy(PolicyConfig(worker_ttl_s=15, worker_expiry_s=40))
    with pytest.raises(PolicyError) as e:
        p.register(reg("r1", ["d1"], epoch=epoch), now=0)
    assert e.value.code == "invalid"
    assert not p.last_seen and not p.stale and not p.workers and not p.epochs
    for now in (16, 41, 100):
        assert not p.tick(now).events


def test_tick_finds_silent_workers_in_order_of_last_heard() -> None:
    # tick looks only at the oldest-heard workers: one renewed later must neither be missed
    # nor hide those behind it, and stale ones at the front must not stop the scan.
    p = Policy(PolicyConfig(worker_ttl_s=15, worker_expiry_s=40))
    for r in ("r1", "r2", "r3"):
        p.register(reg(r, [f"d-{r}"]), now=0)
    p.register(reg("r1", ["d-r1"]), now=10)  # a renewal: r1 now heard from last
    assert {e.replica for e in p.tick(16).events if e.kind == "worker_stale"} == {"r2", "r3"}
    assert not p.tick(20).events
    assert [e.replica for e in p.tick(26).events if e.kind == "worker_stale"] == ["r1"]
    p.ack(WorkerKey("j", "r2", 0), 0, now=27)  # r2 heard from again
    expired = [e.replica for e in p.tick(41).events if e.kind == "worker_expired"]
    assert expired == ["r3"]
    assert set(p.last_seen) == {WorkerKey("j", "r1", 0), WorkerKey("j", "r2", 0)}
