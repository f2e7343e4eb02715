"""The restart policy, pure: no server, time passed in."""

from __future__ import annotations

import msgspec
import pytest

from marduk.core.drmap import WorkerKey
from marduk.core.policy import Policy, PolicyConfig, PolicyError
from marduk.core.records import EpochKey
from marduk.wire.protocol import DeviceHealth, Registration


def reg(
    replica: str,
    devices: list[str],
    *,
    worker: int = 0,
    scope: str = "replica",
    pid: int = 1,
    incarnation: int = 0,
    epoch: int = 0,
    job: str = "j",
) -> Registration:
    return Registration(
        job=job,
        replica=replica,
        worker=worker,
        host="h",
        devices=devices,
        scope=scope,
        pid=pid,
        incarnation=incarnation,
        epoch=epoch,
    )  # type: ignore[arg-type]


def failed(device: str, event_id: str, state: str = "failed") -> DeviceHealth:
    return DeviceHealth(device=device, state=state, event_id=event_id)  # type: ignore[arg-type]


def acceptance_map() -> Policy:
    p = Policy()
    p.register(reg("r1", ["d1", "d2"]), now=0)
    p.register(reg("r2", ["d2", "d3"], pid=2), now=0)
    return p


def targets(result) -> set[tuple[str, str | None]]:
    return {(c.job, c.replica) for c in result.outcome.commands}


def test_failure_reaches_exactly_the_replicas_on_the_device() -> None:
    p = acceptance_map()
    r = p.on_health(failed("d3", "e1"), now=1)
    assert targets(r) == {("j", "r2")}
    assert r.reply.known and [a.replica for a in r.reply.actions] == ["r2"]
    r = p.on_health(failed("d1", "e2"), now=2)
    assert targets(r) == {("j", "r1")}


def test_shared_device_reaches_both() -> None:
    r = acceptance_map().on_health(failed("d2", "e1"), now=1)
    assert targets(r) == {("j", "r1"), ("j", "r2")}
    assert all(c.kind == "restart" and c.epoch == 1 for c in r.outcome.commands)


def test_unknown_device_reaches_nobody_and_is_not_remembered() -> None:
    p = acceptance_map()
    r = p.on_health(failed("nope", "e1"), now=1)
    assert not r.reply.known and not r.outcome.commands and not r.reply.actions
    assert "nope" not in p.devices
    assert r.outcome.events[0].kind == "unknown_device"


def test_storm_of_events_gives_one_command_per_replica() -> None:
    p = acceptance_map()
    commands = []
    for i in range(50):
        commands += p.on_health(failed("d2", f"e{i}"), now=1 + i * 0.01).outcome.commands
    assert sorted((c.replica, c.epoch) for c in commands) == [("r1", 1), ("r2", 1)]


def test_duplicate_event_id_is_ignored_and_answers_the_same() -> None:
    p = acceptance_map()
    first = p.on_health(failed("d3", "same"), now=1)
    second = p.on_health(failed("d3", "same"), now=100)
    assert not second.outcome.commands and second.reply.duplicate
    assert second.reply.actions == first.reply.actions


def test_ack_ends_coalescing_and_next_failure_bumps_epoch() -> None:
    p = acceptance_map()
    p.on_health(failed("d3", "e1"), now=1)
    assert p.awaiting(EpochKey("j", "r2")) == {WorkerKey("j", "r2", 0)}
    p.ack(WorkerKey("j", "r2", 0), epoch=1, now=2)
    assert not p.awaiting(EpochKey("j", "r2"))
    r = p.on_health(failed("d3", "e2"), now=3)
    assert [(c.replica, c.epoch) for c in r.outcome.commands] == [("r2", 2)]


def test_fresh_process_registration_confirms_the_epoch() -> None:
    p = acceptance_map()
    p.on_health(failed("d3", "e1"), now=1)
    out = p.register(reg("r2", ["d2", "d3"], pid=99, incarnation=1), now=2)
    assert out.epoch == 1 and out.command is not None and out.command.epoch == 1
    assert not p.awaiting(EpochKey("j", "r2"))
    assert p.workers[WorkerKey("j", "r2", 0)].applied_epoch == 1


def test_same_process_reregistering_without_applying_stays_awaited() -> None:
    p = acceptance_map()
    p.on_health(failed("d3", "e1"), now=1)
    out = p.register(reg("r2", ["d2", "d3"], pid=2), now=2)  # same pid/incarnation, epoch 0
    assert out.result == "unchanged" and out.epoch == 1
    assert not out.outcome.events and not out.outcome.put_workers  # periodic resync: silent
    assert p.awaiting(EpochKey("j", "r2")) == {WorkerKey("j", "r2", 0)}


def test_pending_restart_times_out() -> None:
    p = Policy(PolicyConfig(pending_timeout_s=10))
    p.register(reg("r1", ["d1"]), now=0)
    assert len(p.on_health(failed("d1", "a"), now=1).outcome.commands) == 1
    assert not p.on_health(failed("d1", "b"), now=5).outcome.commands
    assert [c.epoch for c in p.on_health(failed("d1", "c"), now=12).outcome.commands] == [2]


def test_job_scope_restarts_every_replica_with_one_command() -> None:
    p = Policy()
    for i, r in enumerate(["r1", "r2", "r3"]):
        for w in range(2):
            p.register(reg(r, [f"{r}-d{w}"], worker=w, scope="job", pid=10 * i + w), now=0)
    res = p.on_health(failed("r2-d1", "e1"), now=1)
    [cmd] = res.outcome.commands
    assert (cmd.job, cmd.replica, cmd.scope, cmd.epoch) == ("j", None, "job", 1)
    assert len(p.awaiting(EpochKey("j", None))) == 6


def test_scope_conflict_is_refused() -> None:
    p = Policy()
    p.register(reg("r1", ["d1"], scope="job"), now=0)
    with pytest.raises(PolicyError) as e:
        p.register(reg("r2", ["d2"], scope="replica", pid=2), now=0)
    assert e.value.code == "scope_conflict"
    p.register(reg("r1", ["d1"], scope="replica"), now=1)  # the only worker may change its mind


def test_degraded_is_reported_not_restarted_by_default() -> None:
    p = acceptance_map()
    r = p.on_health(failed("d1", "e1", state="degraded"), now=1)
    assert not r.outcome.commands and p.devices["d1"].state == "degraded"
    p2 = Policy(PolicyConfig(restart_on_degraded=True))
    p2.register(reg("r1", ["d1"]), now=0)
    assert p2.on_health(failed("d1", "e1", state="degraded"), now=1).outcome.commands


def test_device_budget_escalates_to_fail_and_healthy_resets() -> None:
    p = Policy(PolicyConfig(device_max_failures=2))
    p.register(reg("r1", ["d1"]), now=0)
    kinds = []
    for i in range(4):
        res = p.on_health(failed("d1", f"e{i}"), now=10 * i + 1)
        kinds += [c.kind for c in res.outcome.commands]
        p.ack(WorkerKey("j", "r1", 0), epoch=p.epoch_of(EpochKey("j", "r1")), now=10 * i + 2)
    assert kinds == ["restart", "restart", "fail", "fail"]
    p.on_health(failed("d1", "h", state="healthy"), now=50)
    assert p.devices["d1"].failures == []
    assert p.on_health(failed("d1", "e9"), now=60).outcome.commands[0].kind == "restart"


def test_deregister_keeps_the_epoch_and_forgets_unused_devices() -> None:
    p = acceptance_map()
    p.on_health(failed("d3", "e1"), now=1)
    out, known = p.deregister(WorkerKey("j", "r2", 0), "done", now=2)
    assert known and out.deleted_workers == [WorkerKey("j", "r2", 0)]
    # Epochs never go backwards for a replica id, even with nobody left in its scope.
    assert not out.deleted_epochs and p.epoch_of(EpochKey("j", "r2")) == 1
    # d3 was used by r2 only: forgotten (state and failure history); d2 is still r1's.
    assert out.deleted_devices == ["d3"] and "d3" not in p.devices
    r = p.on_health(failed("d3", "e2"), now=3)
    assert not r.reply.known and not r.outcome.commands and "d3" not in p.devices
    assert p.deregister(WorkerKey("j", "r2", 0), "again", now=4) == (out.__class__(), False)
    # The replica id comes back: its next restart is above every epoch it ever had.
    p.register(reg("r2", ["d3"], pid=9), now=5)
    assert p.on_health(failed("d3", "e3"), now=6).outcome.commands[0].epoch == 2


def test_restore_rebuilds_map_epochs_and_awaiting() -> None:
    p = acceptance_map()
    p.on_health(failed("d2", "e1"), now=1)
    p.ack(WorkerKey("j", "r1", 0), 1, now=2)
    # Round-trip through JSON as the store does.
    enc = msgspec.json.encode
    from marduk.core.records import DeviceRecord, EpochRecord, WorkerRecord

    w = [msgspec.json.decode(enc(x), type=WorkerRecord) for x in p.workers.values()]
    e = [msgspec.json.decode(enc(x), type=EpochRecord) for x in p.epochs.values()]
    d = [msgspec.json.decode(enc(x), type=DeviceRecord) for x in p.devices.values()]
    q = Policy.restore(p.config, w, e, d)
    assert q.drmap == p.drmap
    assert q.awaiting(EpochKey("j", "r2")) == {WorkerKey("j", "r2", 0)}
    assert not q.awaiting(EpochKey("j", "r1"))
    r = q.on_health(failed("d1", "e2"), now=3)
    # Epochs up to the reserved ceiling may have gone out unrecorded: issue above it.
    ceiling = p.epochs[EpochKey("j", "r1")].ceiling
    assert [(c.replica, c.epoch) for c in r.outcome.commands] == [("r1", ceiling + 1)]
    assert r.outcome.write_ahead  # a new block is reserved before that command goes out


def test_registration_with_higher_applied_epoch_is_adopted() -> None:
    """A controller that lost a write learns the epoch back from agents; no epoch is reused."""
    p = Policy()
    out = p.register(reg("r1", ["d1"], epoch=7), now=0)
    # Written ahead: a command under the adopted ceiling needs no write of its own.
    assert out.epoch == 7 and out.outcome.write_ahead[0].ceiling >= 7
    [cmd] = p.on_health(failed("d1", "e1"), now=1).outcome.commands
    assert cmd.epoch == 8


def test_epoch_ceiling_is_written_ahead_only_when_a_block_runs_out() -> None:
    p = Policy(PolicyConfig(epoch_block=3))
    reg_out = p.register(reg("r1", ["d1"]), now=0)
    # Reserved at registration, written ahead (durable before any command relies on it).
    assert reg_out.outcome.write_ahead[0].ceiling == 3
    wrote = []
    for i in range(7):
        res = p.on_health(failed("d1", f"e{i}"), now=i)
        [cmd] = res.outcome.commands
        wrote.append((cmd.epoch, bool(res.outcome.write_ahead)))
        assert cmd.epoch <= p.epochs[EpochKey("j", "r1")].ceiling
        p.ack(WorkerKey("j", "r1", 0), cmd.epoch, now=i)
    assert wrote == [
        (1, False),
        (2, False),
        (3, False),
        (4, True),
        (5, False),
        (6, False),
        (7, True),
    ]


def report(replica: str, status: str, *, worker: int = 0, epoch: int = 0, **kw: object):  # type: ignore[no-untyped-def]
    from marduk.wire.protocol import Report

    return Report(job="j", replica=replica, worker=worker, status=status, epoch=epoch, **kw)  # type: ignore[arg-type]


def test_crash_report_restarts_the_workers_scope_once() -> None:
    p = Policy()
    for w in range(2):
        p.register(reg("r1", [f"d{w}"], worker=w, scope="job", pid=w), now=0)
        p.register(reg("r2", [f"e{w}"], worker=w, scope="job", pid=10 + w), now=0)
    res = p.on_report(report("r1", "crashed", failure_class="cuda_error", summary="boom"), now=1)
    [cmd] = res.outcome.commands
    assert (cmd.replica, cmd.epoch, cmd.kind) == (None, 1, "restart")
    assert "cuda_error" in cmd.reason and res.actions[0].epoch == 1
    # The mesh broke: the other workers crash too, still at epoch 0 -> covered, no new command.
    for r, w in [("r1", 1), ("r2", 0), ("r2", 1)]:
        res = p.on_report(report(r, "crashed", worker=w), now=1.1)
        assert not res.outcome.commands and res.actions[0].coalesced
    # All restart at epoch 1 and say so; the next crash is a new restart.
    for r in ("r1", "r2"):
        for w in range(2):
            p.on_report(report(r, "running", worker=w, epoch=1), now=2)
    assert not p.awaiting(EpochKey("j", None))
    [cmd] = p.on_report(report("r2", "hung", worker=1, epoch=1), now=3).outcome.commands
    assert cmd.epoch == 2


def test_report_from_unknown_worker_is_refused_and_clean_exit_restarts_nothing() -> None:
    p = acceptance_map()
    with pytest.raises(PolicyError) as e:
        p.on_report(report("nobody", "crashed"), now=1)
    assert e.value.code == "unknown_worker"
    res = p.on_report(report("r1", "exited", exit_code=0), now=1)
    assert not res.outcome.commands and res.outcome.events[0].kind == "trainer_exited"


def test_trainer_started_is_announced_once_per_incarnation() -> None:
    p = acceptance_map()

    def kinds(status: str, incarnation: int, step: int | None = None) -> list[str]:
        r = report("r1", status, incarnation=incarnation, step=step)
        return [e.kind for e in p.on_report(r, now=1).outcome.events]

    assert kinds("running", 0) == ["trainer_started"]
    assert kinds("running", 0, step=5) == []  # a progress report
    assert kinds("running", 0, step=9) == []
    assert kinds("crashed", 0, step=9)[0] == "worker_crashed"
    assert kinds("running", 1) == ["trainer_started"]
    assert kinds("running", 1, step=3) == []


def restored(p: Policy) -> Policy:
    """A new leader's policy: ``p``'s records round-tripped through JSON, as the store does."""
    from marduk.core.records import DeviceRecord, EpochRecord, WorkerRecord

    enc = msgspec.json.encode
    w = [msgspec.json.decode(enc(x), type=WorkerRecord) for x in p.workers.values()]
    e = [msgspec.json.decode(enc(x), type=EpochRecord) for x in p.epochs.values()]
    d = [msgspec.json.decode(enc(x), type=DeviceRecord) for x in p.devices.values()]
    return Policy.restore(p.config, w, e, d)


def test_a_restart_in_flight_read_from_the_store_does_not_swallow_a_failure() -> None:
    """R1 applied epoch 1 and acked it, but acks are not persisted, so the
    new leader's records say r1 has not applied it. A failure of r1's device after the
    takeover must reach r1 as a new epoch: a resend of epoch 1 (merged devices) would be
    dropped by an agent that applied it. Once this term issued its own restart, further
    failures coalesce into it as usual."""
    p = acceptance_map()
    p.on_health(failed("d1", "e1"), now=1)
    q = restored(p)  # the records as stored: r1's ack of epoch 1 (next) is not persisted
    q2 = restored(p)
    p.ack(WorkerKey("j", "r1", 0), 1, now=2)
    assert q.awaiting(EpochKey("j", "r1")) == {WorkerKey("j", "r1", 0)}  # believed in flight
    r = q.on_health(failed("d1", "e2"), now=3)
    [command] = r.outcome.commands
    assert command.replica == "r1" and command.epoch > 1 and not r.reply.actions[0].coalesced
    again = q.on_health(failed("d1", "e3"), now=4)
    assert not again.outcome.commands and again.reply.actions[0].coalesced
    # A crash report meets an inherited restart the same way.
    from marduk.wire.protocol import Report

    crash = Report(job="j", replica="r1", worker=0, status="crashed", epoch=1)
    res = q2.on_report(crash, now=3)
    assert [c.epoch > 1 for c in res.outcome.commands] == [True]


def test_a_command_lists_a_bounded_number_of_merged_devices() -> None:
    """Failures merged into a restart in flight stop growing its command past
    MAX_MERGED_DEVICES; the next one takes a new epoch."""
    from marduk.core.device_policy import MAX_MERGED_DEVICES

    p = Policy(PolicyConfig(device_max_failures=10_000))
    devices = [f"d{i}" for i in range(MAX_MERGED_DEVICES + 1)]
    p.register(reg("r1", devices), now=0)
    for i, d in enumerate(devices[:MAX_MERGED_DEVICES]):
        p.on_health(failed(d, f"e{i}"), now=1)
    state = p.epochs[EpochKey("j", "r1")]
    assert state.epoch == 1 and state.command is not None
    assert len(state.command.devices) == MAX_MERGED_DEVICES
    r = p.on_health(failed(devices[-1], "last"), now=1)
    assert [c.epoch for c in r.outcome.commands] == [2]


def test_an_event_redelivered_after_a_takeover_joins_the_restart_issued_for_it() -> None:
    """The old leader issued epoch 1 for event e1 and stored its epoch record, but not e1's
    dedup record (it died in between): e1 is redelivered to the new leader. The inherited
    restart was issued for e1 itself, so e1 joins it (no second restart for one failure); any
    other failure meeting it takes a new epoch."""
    p = acceptance_map()
    p.on_health(failed("d1", "e1"), now=1)
    q = restored(p)
    again = q.on_health(failed("d1", "e1"), now=2)
    assert not again.outcome.commands and again.reply.actions[0].coalesced
    assert again.reply.actions[0].epoch == 1
    other = q.on_health(failed("d1", "e2"), now=3)
    assert [c.epoch > 1 for c in other.outcome.commands] == [True]
    # Even once r1 confirmed epoch 1 (it re-registered before the redelivery came).
    q3 = restored(p)
    q3.register(reg("r1", ["d1", "d2"], epoch=1), now=2)
    late = q3.on_health(failed("d1", "e1"), now=3)
    assert not late.outcome.commands and late.reply.actions[0].epoch == 1


def test_a_failure_merged_after_the_worker_acted_restarts_it_again() -> None:
    """d3 fails while r2's restart for d2 is in flight: merged into epoch 1. r2's ack says it
    acted knowing only d2, so its trainer may predate d3's failure: epoch 2 for d3."""
    p = acceptance_map()
    p.on_health(failed("d2", "e1"), now=1)
    merged = p.on_health(failed("d3", "e2"), now=1.01)
    assert [a.coalesced for a in merged.reply.actions] == [True]
    out = p.ack(WorkerKey("j", "r2", 0), epoch=1, now=1.02, devices=["d2"])
    assert [(c.replica, c.epoch, c.devices) for c in out.commands] == [("r2", 2, ["d3"])]
    assert p.awaiting(EpochKey("j", "r2")) == {WorkerKey("j", "r2", 0)}
    # r1 (on d2, not on d3) acted on what it knew: nothing more for it.
    assert not p.ack(WorkerKey("j", "r1", 0), epoch=1, now=1.03, devices=["d2"]).commands


def test_an_ack_that_knew_the_merged_device_or_says_nothing_restarts_nothing() -> None:
    for devices in (["d2", "d3"], None):
        p = acceptance_map()
        p.on_health(failed("d2", "e1"), now=1)
        p.on_health(failed("d3", "e2"), now=1.01)
        assert not p.ack(WorkerKey("j", "r2", 0), epoch=1, now=1.02, devices=devices).commands
        assert not p.awaiting(EpochKey("j", "r2"))


def test_a_failure_right_after_the_replica_was_handed_its_restart_is_not_covered_by_it() -> None:
    """Issue 24: d1 fails (epoch 1); r1's agent receives epoch 1 and starts its new trainer;
    d1 fails again before r1's ack reached the leader. Coalesced into epoch 1 (its command
    resent at revision 1), but r1's ack says its incarnation started at revision 0, before
    that failure: the restart did not cover it, so r1 restarts again, for that event."""
    p = Policy()
    p.register(reg("r1", ["d1"]), now=0)
    assert [c.epoch for c in p.on_health(failed("d1", "e1"), now=1).outcome.commands] == [1]
    again = p.on_health(failed("d1", "e2"), now=1.001)
    assert [(a.epoch, a.coalesced) for a in again.reply.actions] == [(1, True)]
    # A repeat is not sent at once (a storm of them stays bounded): the next resend says it.
    assert not again.outcome.commands and not again.outcome.resent
    resent = p.tick(now=2.5).resent
    assert [(c.epoch, c.revision, c.devices) for c in resent] == [(1, 1, ["d1"])]
    out = p.ack(WorkerKey("j", "r1", 0), epoch=1, now=2.6, devices=["d1"], revision=0)
    assert [(c.epoch, c.devices, c.event_id, c.revision) for c in out.commands] == [
        (2, ["d1"], "e2", 0)
    ]
    assert [e.kind for e in out.events] == ["restart_issued"]
    assert "revision 0 of 1" in (out.events[0].detail or "")
    assert p.awaiting(EpochKey("j", "r1")) == {WorkerKey("j", "r1", 0)}


def test_an_update_taken_in_before_the_trainer_started_is_covered() -> None:
    """The same race, but the update (revision 1) reached the agent before its new trainer
    started: the ack says revision 1, and the one restart covers both failures."""
    p = Policy()
    p.register(reg("r1", ["d1"]), now=0)
    p.on_health(failed("d1", "e1"), now=1)
    p.on_health(failed("d1", "e2"), now=1.001)
    p.on_health(failed("d1", "e3"), now=1.002)
    assert p.epochs[EpochKey("j", "r1")].command.revision == 2  # type: ignore[union-attr]
    assert not p.ack(WorkerKey("j", "r1", 0), epoch=1, now=1.01, revision=2).commands
    assert not p.awaiting(EpochKey("j", "r1"))
    # Confirmed: the next failure takes a new epoch (not merged), as before.
    assert [c.epoch for c in p.on_health(failed("d1", "e4"), now=2).outcome.commands] == [2]


def test_an_event_redelivered_for_its_own_command_moves_no_revision() -> None:
    """The event a command was issued for, redelivered (its dedup record never written), is
    not a second failure: the revision stays, and an ack at revision 0 covers it."""
    p = acceptance_map()
    p.on_health(failed("d1", "e1"), now=1)
    q = restored(p)
    q.on_health(failed("d1", "e1"), now=2)
    assert q.epochs[EpochKey("j", "r1")].command.revision == 0  # type: ignore[union-attr]
    assert not q.ack(WorkerKey("j", "r1", 0), epoch=1, now=3, revision=0).commands


def test_only_the_worker_on_a_device_merged_after_it_started_restarts_again() -> None:
    """A replica of two workers: d2 (worker 1's) is merged into the restart for d1 at
    revision 1. Worker 0's incarnation started before that, but d2 is not its device: its ack
    restarts nothing. Worker 1's started before it too: the replica restarts again."""
    p = Policy()
    p.register(reg("r1", ["d1"], worker=0), now=0)
    p.register(reg("r1", ["d2"], worker=1, pid=2), now=0)
    p.on_health(failed("d1", "e1"), now=1)
    p.on_health(failed("d2", "e2"), now=1.001)
    assert not p.ack(WorkerKey("j", "r1", 0), epoch=1, now=1.01, revision=0).commands
    out = p.ack(WorkerKey("j", "r1", 1), epoch=1, now=1.02, revision=0)
    assert [(c.epoch, c.devices, c.event_id) for c in out.commands] == [(2, ["d2"], "e2")]


def test_a_new_leader_checks_the_revision_a_worker_registers_with() -> None:
    """The merge (revision 1) was stored, r1's ack at revision 0 never reached the old leader:
    after the takeover r1 registers again, saying epoch 1 at revision 0. The new leader (the
    merges are on the epoch record) restarts it again; one that says revision 1 does not."""
    p = Policy()
    p.register(reg("r1", ["d1"]), now=0)
    p.on_health(failed("d1", "e1"), now=1)
    p.on_health(failed("d1", "e2"), now=1.001)
    for revision, restarts in ((0, True), (1, False), (None, False)):
        q = restored(p)
        again = msgspec.structs.replace(reg("r1", ["d1"], epoch=1), revision=revision)
        got = q.register(again, now=2)
        # Above the old leader's reserved block, as every epoch of a new leader.
        assert [c.epoch > 1 for c in got.outcome.commands] == [True] * restarts, revision
        assert (got.epoch > 1) is restarts
        if restarts:  # the reply carries it: the agent restarts without waiting for a resend
            assert got.command is not None and got.command.event_id == "e2"
            # Its renewals say the same: nothing more until it acts on epoch 2.
            assert not q.register(again, now=3).outcome.commands


def test_a_vacant_scope_keeps_its_epochs_for_the_retention_then_they_are_dropped() -> None:
    p = Policy(PolicyConfig(epoch_retention_s=100))
    p.register(reg("r1", ["d1"]), now=0)
    p.register(reg("r2", ["d2"], pid=2), now=0)
    p.on_health(failed("d1", "e1"), now=1)
    p.forget("j", "r1", None, now=10)
    assert not p.tick(now=109).deleted_epochs  # not yet
    # Comes back within the retention: continues above the epochs issued.
    p.register(reg("r1", ["d1"], pid=3), now=50)
    p.forget("j", "r1", None, now=60)
    assert not p.tick(now=159).deleted_epochs
    out = p.tick(now=161)
    assert out.deleted_epochs == [EpochKey("j", "r1")] and EpochKey("j", "r1") not in p.epochs
    assert [e.kind for e in out.events] == ["epochs_dropped"]
    assert EpochKey("j", "r2") in p.epochs  # r2 still has its worker
    assert not p.tick(now=500).deleted_epochs  # once
    # A worker of r1 that was cut off all along comes back with the epoch it saw: adopted.
    out_reg = p.register(reg("r1", ["d1"], pid=4, epoch=1), now=600)
    assert out_reg.epoch == 1
    r = p.on_health(failed("d1", "e2"), now=601)
    assert [c.epoch for c in r.outcome.commands] == [2]


def test_vacancy_after_a_restore_counts_from_the_takeover() -> None:
    p = Policy(PolicyConfig(epoch_retention_s=100))
    p.register(reg("r1", ["d1"]), now=0)
    p.forget("j", "r1", None, now=1)
    restored = Policy.restore(p.config, [], list(p.epochs.values()), [], now=1000)
    assert not restored.tick(now=1099).deleted_epochs
    assert restored.tick(now=1100).deleted_epochs == [EpochKey("j", "r1")]
