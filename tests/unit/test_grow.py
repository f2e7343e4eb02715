"""Growing a job back towards MAX, pure: the rules (``membership.grow``, ``marduk.core.grow``)
and the policy that applies them: a checkpoint first, then one restart with the new workers
(after a shrink, after forming at MIN), the wait bounded, damping, flapping workers, a member
lost mid-grow, a restart in flight, a new leader finishing it."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from marduk.core import grow as rule
from marduk.core import membership as rdzv
from marduk.core.policy import Outcome, Policy, PolicyConfig
from marduk.core.records import EpochKey
from marduk.wire.protocol import Command, DeviceHealth, QueryReply, Registration, Report
from monitor_cli.status_jobs import summarize
from tests.unit.test_spares import cand, key, rz
from tests.unit.test_spares import reg as spares_reg
from tests.unit.test_status_view import controller

JOB = EpochKey("j", None)
PIDS = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "s": 9}


def reg(replica: str, *, pid: int = 0, **kw) -> Registration:
    return spares_reg(replica, pid=pid or PIDS[replica], **kw)


def ranks(cmd: Command | None) -> list[tuple[str, int, int]]:
    assert cmd is not None and cmd.membership is not None
    return [(m.replica, m.node_rank, m.first_rank) for m in cmd.membership.members]


def kinds(out: Outcome) -> list[str]:
    return [e.kind for e in out.events]


def config(**kw) -> PolicyConfig:
    base = {
        "worker_ttl_s": 1000.0,
        "worker_expiry_s": 10_000.0,
        "device_max_failures": 0,
        "join_timeout_s": 5.0,
        "resize_interval_s": 20.0,
        "grow_settle_s": 5.0,
        "grow_checkpoint_timeout_s": 30.0,
    }
    return PolicyConfig(**{**base, **kw})  # type: ignore[arg-type]


def running(p: Policy, now: float, *names: str) -> None:
    for w in names:
        p.on_report(Report(job="j", replica=w, status="running", epoch=p.epochs[JOB].epoch), now)


def checkpointed(p: Policy, w: str, now: float) -> Outcome:
    report = Report(job="j", replica=w, status="checkpointed", epoch=p.epochs[JOB].epoch, step=40)
    return p.on_report(report, now).outcome


def shrunk(p: Policy, *, lo: int = 1, hi: int = 2) -> Command:
    """``a`` .. at MAX, stepping; then ``a``'s device is spent at 3: the others go on."""
    names = "abc"[:hi]
    for w in names:
        p.register(reg(w, lo=lo, hi=hi), now=0)
    running(p, 1, *names)
    [cmd] = p.on_health(
        DeviceHealth(device="a-d0", state="failed", event_id="x"), now=3
    ).outcome.commands
    assert ranks(cmd) == [(w, i, 2 * i) for i, w in enumerate(names[1:])]
    return cmd


def restored(p: Policy, now: float, **kw) -> Policy:
    """A new leader at ``now``, from what ``p`` stored (its records, through JSON)."""

    def again(rec):  # type: ignore[no-untyped-def]
        return msgspec.json.decode(msgspec.json.encode(rec), type=type(rec))

    epochs = [again(e) for e in p.epochs.values()]
    workers = [again(w) for w in p.workers.values()]
    return Policy.restore(config(**kw), workers, epochs, list(p.devices.values()), now=now)


# --- the rules ---------------------------------------------------------------------------------


def test_new_workers_take_the_next_node_ranks_and_the_port_moves() -> None:
    m = rdzv.form(1, [cand("a", 1, hi=4), cand("b", 2, hi=4)])
    assert m is not None
    grown = rdzv.grow(m, 2, "j", [cand("a", 1, hi=4, port=41000)], [cand("d", 4), cand("c", 3)])
    assert [(x.replica, x.node_rank, x.first_rank) for x in grown.members] == [
        ("a", 0, 0),
        ("b", 1, 2),
        ("d", 2, 4),
        ("c", 3, 6),
    ]
    assert grown.world_size == 8 and grown.epoch == 2
    assert grown.coordinator_port == 41000 != m.coordinator_port
    with pytest.raises(ValueError, match="member already"):
        rdzv.grow(m, 3, "j", [], [cand("a")])


@given(n=st.integers(1, 5), free=st.lists(st.floats(0, 100), max_size=6), hi=st.integers(1, 8))
def test_a_grow_never_gives_a_rank_twice_nor_passes_max(n: int, free: list[float], hi: int) -> None:
    members = [cand(f"m{i}", i, hi=8) for i in range(n)]
    m = rdzv.form(1, members)
    assert m is not None
    pool = [cand(f"f{i}", 10 + i, hi=8) for i in range(len(free))]
    since = {c.key: t for c, t in zip(pool, free, strict=True)}
    heard = dict.fromkeys(since, 99.0)
    joining = rule.joining(m, "j", [*members, *pool], since, heard, 100, 50, 5, hi)
    assert len(m.members) + len(joining) <= max(hi, n)
    assert all(100 - since[c.key] >= 50 for c in joining)
    grown = rdzv.grow(m, 2, "j", members, joining)
    assert [x.node_rank for x in grown.members] == list(range(len(grown.members)))
    flat = [r for x in grown.members for r in range(x.first_rank, x.first_rank + x.nproc)]
    assert flat == list(range(grown.world_size))
    assert len({(x.replica, x.worker) for x in grown.members}) == len(grown.members)


def test_declared_spares_and_other_shapes_never_join() -> None:
    m = rdzv.form(1, [cand("a", hi=3)])
    assert m is not None
    odd = rdzv.Candidate(key("o"), msgspec.structs.replace(rz(hi=3), nproc=1), 1)
    free = rule.free_workers(m, "j", [cand("a", hi=3), cand("s", 2, spare=True), odd, cand("c", 3)])
    assert [c.key.replica for c in free] == ["c"]


def test_a_grow_waits_for_a_restart_in_flight_and_the_resize_interval() -> None:
    assert rule.wait_reason(10, None, 60, in_flight=True) == "a restart is in flight"
    assert "interval 60s" in rule.wait_reason(10, 0, 60, in_flight=False)
    assert rule.wait_reason(60, 0, 60, in_flight=False) == ""


# --- the policy --------------------------------------------------------------------------------


def test_a_new_worker_grows_a_shrunk_job_back_after_a_checkpoint() -> None:
    p = Policy(config())
    shrink = shrunk(p)
    running(p, 4, "b")
    p.register(reg("c"), now=5)  # the replacement pod, not a spare
    assert not p.tick(now=22).commands  # settled, but the shrink was 19s ago
    out = p.tick(now=23)
    [ask] = out.commands
    assert ask.kind == "checkpoint" and ask.epoch > shrink.epoch and ranks(ask) == [("b", 0, 0)]
    assert {"grow_started", "checkpoint_issued"} <= set(kinds(out))
    grow = p.epochs[JOB].grow
    assert grow is not None and [w.replica for w in grow.joining] == ["c"]
    assert p.epochs[JOB] in out.put_epochs  # a new leader finishes it
    assert not p.awaiting(JOB)  # a checkpoint holds nothing in flight
    assert not p.tick(now=24).commands
    done = checkpointed(p, "b", now=25)
    [restart] = done.commands
    assert restart.kind == "restart" and restart.epoch > ask.epoch
    assert ranks(restart) == [("b", 0, 0), ("c", 1, 2)]
    assert restart.membership is not None and restart.membership.world_size == 4
    assert "every member saved the checkpoint" in restart.reason
    assert p.epochs[JOB] in done.write_ahead and p.epochs[JOB].grow is None
    added = [e for e in done.events if e.kind == "member_added"]
    assert [(e.replica, e.epoch) for e in added] == [("c", restart.epoch)]
    assert p.awaiting(JOB) == {key("b"), key("c")}
    # At MAX now: nothing more.
    running(p, 26, "b", "c")
    assert not p.tick(now=100).commands


def test_a_job_formed_at_min_grows_when_another_worker_comes() -> None:
    p = Policy(config(join_timeout_s=5))
    p.register(reg("a"), now=0)
    [first] = p.tick(now=6).commands  # MIN for the join timeout
    assert ranks(first) == [("a", 0, 0)]
    running(p, 7, "a")
    p.register(reg("b"), now=8)
    assert not p.tick(now=25).commands  # formed 19s ago
    [ask] = p.tick(now=26).commands
    assert ask.kind == "checkpoint"
    [restart] = checkpointed(p, "a", now=27).commands
    assert ranks(restart) == [("a", 0, 0), ("b", 1, 2)]


def test_the_checkpoint_wait_is_bounded() -> None:
    p = Policy(config(grow_checkpoint_timeout_s=30))
    shrunk(p, hi=3)
    running(p, 4, "b", "c")
    p.register(reg("d", hi=3), now=5)
    assert [c.kind for c in p.tick(now=23).commands] == ["checkpoint"]
    checkpointed(p, "b", now=24)  # c never confirms
    assert not p.tick(now=52).commands
    [restart] = p.tick(now=53).commands
    assert ranks(restart) == [("b", 0, 0), ("c", 1, 2), ("d", 2, 4)]
    assert "no checkpoint confirmed by c/0 within 30s" in restart.reason


def test_one_resize_per_interval_but_a_lost_member_is_taken_out_at_once() -> None:
    p = Policy(config(resize_interval_s=20))
    shrunk(p, hi=3)  # at 3
    running(p, 4, "b", "c")
    p.register(reg("d", hi=3), now=5)
    p.tick(now=23)
    [grow] = checkpointed(p, "b", now=24).commands + checkpointed(p, "c", now=24).commands
    assert ranks(grow) == [("b", 0, 0), ("c", 1, 2), ("d", 2, 4)]
    running(p, 25, "b", "c", "d")
    # A lost member right after the grow: no waiting.
    [shrink] = p.on_health(
        DeviceHealth(device="d-d0", state="failed", event_id="y"), now=26
    ).outcome.commands
    assert ranks(shrink) == [("b", 0, 0), ("c", 1, 2)]
    running(p, 27, "b", "c")
    p.register(reg("e", hi=3), now=28)
    assert not p.tick(now=45).commands  # settled at 33; the shrink was at 26
    [ask] = p.tick(now=46).commands
    assert ask.kind == "checkpoint"


def test_a_flapping_worker_does_not_bounce_the_job() -> None:
    p = Policy(config(worker_ttl_s=10, grow_settle_s=15))

    def at(now: float, *live: str) -> Outcome:
        outs = [p.register(reg(w), now=now).outcome for w in live]  # renewals
        out = p.tick(now)
        for o in outs:
            out.commands += o.commands
            out.events += o.events
        return out

    shrunk(p)
    running(p, 4, "b")
    for t in (4, 24):  # c comes and goes: it registers, goes silent, comes back ...
        at(t, "b", "c")
        assert not at(t + 8, "b").commands
        assert "worker_stale" in kinds(at(t + 16, "b"))
    assert not at(44, "b", "c").commands  # live again, for less than 15s
    for t in (50, 55):
        assert not at(t, "b", "c").commands
    [ask] = at(59, "b", "c").commands  # live since 44
    assert ask.kind == "checkpoint"


def test_a_worker_gone_during_the_wait_is_left_out() -> None:
    p = Policy(config(worker_ttl_s=10, grow_settle_s=5, grow_checkpoint_timeout_s=30))
    shrunk(p)
    running(p, 4, "b")
    for t in (5, 12, 19):
        p.register(reg("b"), now=t)
        p.register(reg("c"), now=t)
        p.tick(t)
    [ask] = p.tick(now=23).commands
    assert ask.kind == "checkpoint"
    p.register(reg("b"), now=30)
    out = p.tick(now=31)  # c silent since 19: stale
    assert "worker_stale" in kinds(out) and not out.commands
    out = checkpointed(p, "b", now=32)
    assert not out.commands and "grow_abandoned" in kinds(out)
    assert p.epochs[JOB].grow is None


def test_a_member_lost_mid_grow_hands_its_ranks_to_the_new_worker() -> None:
    p = Policy(config())
    shrunk(p, lo=2, hi=3)  # [b, c], MIN 2
    running(p, 4, "b", "c")
    p.register(reg("d", lo=2, hi=3), now=5)
    [ask] = p.tick(now=23).commands
    assert ask.kind == "checkpoint"
    r = p.on_health(DeviceHealth(device="b-d0", state="failed", event_id="z"), now=24)
    [swap] = r.outcome.commands
    assert ranks(swap) == [("d", 0, 0), ("c", 1, 2)]  # d takes b's ranks: never below MIN
    assert {"grow_abandoned", "member_replaced"} <= set(kinds(r.outcome))
    assert p.epochs[JOB].grow is None
    assert not checkpointed(p, "c", now=25).commands
    running(p, 26, "c", "d")
    assert not p.tick(now=200).commands  # nobody left to join


def test_a_grow_waits_for_a_restart_in_flight_to_settle() -> None:
    p = Policy(config())
    shrunk(p)  # b has not confirmed the shrink's restart
    p.register(reg("c"), now=5)
    assert not p.tick(now=30).commands
    running(p, 31, "b")
    [ask] = p.tick(now=32).commands
    assert ask.kind == "checkpoint"
    # A crash during the checkpoint wait comes first: the grow starts again once it settles.
    crash = Report(job="j", replica="b", status="crashed", epoch=ask.epoch)
    r = p.on_report(crash, now=33)
    [restart] = r.outcome.commands
    assert restart.kind == "restart" and ranks(restart) == [("b", 0, 0)]
    out = p.tick(now=34)
    assert "grow_abandoned" in kinds(out) and not out.commands
    assert not checkpointed(p, "b", now=35).commands
    running(p, 36, "b")
    [again] = p.tick(now=37).commands
    assert again.kind == "checkpoint" and again.epoch > restart.epoch


def test_a_spare_stays_a_spare_in_a_job_below_max() -> None:
    p = Policy(config())
    shrunk(p)
    running(p, 4, "b")
    p.register(reg("s", spare=True), now=5)
    assert not p.tick(now=500).commands
    # ... kept for the next loss.
    [swap] = p.on_health(
        DeviceHealth(device="b-d0", state="failed", event_id="w"), now=501
    ).outcome.commands
    assert ranks(swap) == [("s", 0, 0)]


def test_a_new_leader_finishes_a_grow_and_keeps_the_membership() -> None:
    p = Policy(config(grow_checkpoint_timeout_s=30))
    shrunk(p)
    running(p, 4, "b")
    p.register(reg("c"), now=5)
    [ask] = p.tick(now=23).commands

    def reborn(now: float) -> Policy:
        return restored(p, now)

    q = reborn(24)
    assert q.epochs[JOB].grow == p.epochs[JOB].grow
    assert not q.tick(now=40).commands  # the reports it never saw: it waits out the bound
    [restart] = q.tick(now=53).commands
    assert restart.kind == "restart" and restart.epoch > ask.epoch
    assert ranks(restart) == [("b", 0, 0), ("c", 1, 2)]
    p = q
    r = reborn(54)  # killed right after: the membership written ahead stands
    assert r.epochs[JOB].membership == restart.membership and r.epochs[JOB].grow is None
    assert r.register(reg("c"), now=55).command == restart


def test_the_join_timeout_goes_on_counting_on_a_new_leader() -> None:
    """The join timeout counts from when MIN workers had registered (their records say when),
    not from a new leader's start; a held job's counts from the hold at the earliest."""
    p = Policy(config(join_timeout_s=30))
    p.register(reg("a", lo=2, hi=3), now=0)
    p.register(reg("b", lo=2, hi=3), now=2)  # MIN from 2: forms at 32 without a third
    assert not p.tick(now=20).commands
    q = restored(p, 25, join_timeout_s=30)
    [info] = q.job_infos(25)
    assert (info.resize, info.resize_since) == ("forming", 2)
    for w in ("a", "b"):  # the agents answer the new leader's hello
        assert q.register(reg(w, lo=2, hi=3), now=26).command is None
    assert not q.tick(now=31).commands
    [first] = q.tick(now=32).commands
    assert ranks(first) == [("a", 0, 0), ("b", 1, 2)]
    # Held below MIN at 40; a worker back at 50: the timeout counts from 50, on any leader.
    running(q, 33, "a", "b")
    [held] = q.on_health(
        DeviceHealth(device="a-d0", state="failed", event_id="x"), now=40
    ).outcome.commands
    assert held.membership is None
    q.register(reg("c", lo=2, hi=3), now=50)
    r = restored(q, 60, join_timeout_s=30)
    for w in ("b", "c"):
        r.register(reg(w, lo=2, hi=3), now=61)
    assert not r.tick(now=79).commands
    [again] = r.tick(now=80).commands
    assert ranks(again) == [("b", 0, 0), ("c", 1, 2)]


def test_the_last_resize_survives_a_new_leader() -> None:
    """The resize interval counts from the last resize, which the job's epoch record keeps
    (written ahead with the membership it changed), and status shows that change."""
    p = Policy(config(resize_interval_s=20, grow_settle_s=5))
    shrunk_at = shrunk(p)  # at 3
    running(p, 4, "b")
    p.register(reg("c"), now=5)
    q = restored(p, 10, resize_interval_s=20, grow_settle_s=5)
    [info] = q.job_infos(10)
    assert (info.last_resize, info.last_resize_epoch) == ("job_shrunk", shrunk_at.epoch)
    assert info.last_resize_at == 3
    for t in (10, 16, 22):
        q.register(reg("b"), now=t)
        q.register(reg("c"), now=t)
        assert not q.tick(now=t).commands
    [ask] = q.tick(now=23).commands  # 20 s after the shrink at 3, not after the takeover at 10
    assert ask.kind == "checkpoint"


# --- a joiner warming up (its fork server imports the framework) ---------------------------------


def warming(replica: str, *, ready: bool = False, **kw) -> Registration:
    """``replica`` registering while its fork server imports (``ready``: once it has)."""
    r = reg(replica, **kw)
    assert r.rendezvous is not None
    return msgspec.structs.replace(r, rendezvous=msgspec.structs.replace(r.rendezvous, ready=ready))


def test_the_settle_counts_from_when_the_joiner_can_start_its_trainer() -> None:
    p = Policy(config(grow_settle_s=5))
    shrunk(p)
    running(p, 4, "b")
    p.register(warming("c"), now=5)
    for t in (23, 30, 40):  # settled and past the interval, but c would keep b waiting
        p.register(warming("c"), now=t)
        assert not p.tick(now=t).commands
    assert p.register(warming("c", ready=True), now=41).result == "updated"  # warm now
    p.register(reg("c"), now=45)  # renewals as any agent's (ready is the default)
    assert not p.tick(now=45.9).commands
    [ask] = p.tick(now=46).commands  # ready since 41
    assert ask.kind == "checkpoint"
    [restart] = checkpointed(p, "b", now=47).commands
    assert ranks(restart) == [("b", 0, 0), ("c", 1, 2)]


def test_a_joiner_that_never_warms_up_is_taken_after_a_bound() -> None:
    p = Policy(config(grow_settle_s=5))
    shrunk(p)
    running(p, 4, "b")
    bound = 5 + 5 + rule.WARM_UP_CAP_S  # registered at 5: settle, then the cap
    for t in (5, 30, bound - 1):
        p.register(warming("c"), now=t)
        assert not p.tick(now=t).commands
    [ask] = p.register(warming("c"), now=bound).outcome.commands  # its renewal: it starts cold
    assert ask.kind == "checkpoint"


def test_a_joiner_warming_again_after_a_new_process_starts_over() -> None:
    """Ready, then its pod restarts (a new process, warming again): not taken until ready."""
    p = Policy(config(grow_settle_s=5, resize_interval_s=1))
    shrunk(p)
    running(p, 4, "b")
    p.register(warming("c", ready=True), now=5)
    again = msgspec.structs.replace(warming("c"), instance="2")  # a new process (a pod's PID 1)
    p.register(again, now=9)  # live and warming from 9
    assert not p.tick(now=12).commands
    p.register(msgspec.structs.replace(warming("c", ready=True), instance="2"), now=13)
    assert not p.tick(now=17).commands
    [ask] = p.tick(now=18).commands
    assert ask.kind == "checkpoint"


@pytest.mark.parametrize(
    ("ready", "live", "ready_at", "now", "taken"),
    [
        (True, 0.0, None, 5.0, True),  # ready on registration (an older agent too)
        (True, 0.0, 3.0, 7.9, False),  # warmed at 3: settles at 8
        (True, 0.0, 3.0, 8.0, True),
        (True, 10.0, 3.0, 15.0, True),  # a stale readiness of an earlier life counts from live
        (False, 0.0, None, 64.9, False),  # warming: settle + cap
        (False, 0.0, None, 65.0, True),
        (True, None, 0.0, 100.0, False),  # not live
    ],
)
def test_settled(
    ready: bool, live: float | None, ready_at: float | None, now: float, taken: bool
) -> None:
    c = cand("c")
    c = rdzv.Candidate(c.key, msgspec.structs.replace(c.rendezvous, ready=ready), 0.0)
    live_since = {} if live is None else {c.key: live}
    ready_since = {} if ready_at is None else {c.key: ready_at}
    assert rule.settled(c, live_since, ready_since, now, 5.0) is taken


def test_a_worker_that_leaves_leaves_nothing_in_the_grow_rules() -> None:
    """Deregistered, forgotten or expired: the grow's live and ready times of the worker go
    with it (they grew with every worker ever seen), and its name registering again is new."""
    p = Policy(config(grow_settle_s=5, worker_ttl_s=10, worker_expiry_s=20))
    shrunk(p, hi=3)  # b, c members; a retired
    grow = p._grow
    for w, pid in (("d", 4), ("e", 5)):
        p.register(warming(w, hi=3, pid=pid), now=4)
        p.register(warming(w, hi=3, pid=pid, ready=True), now=5)
    p.register(warming("s", hi=3), now=5)  # still warming
    assert {key("d"), key("e"), key("s")} <= grow.live_since.keys()
    assert {key("d"), key("e")} <= grow.ready_since.keys() and key("s") in grow.warming
    p.deregister(key("d"), "exit", now=6)
    p.forget("j", "e", None, now=6)
    p.forget("j", "s", 0, now=6)
    for k in (key("d"), key("e"), key("s")):
        assert k not in grow.live_since and k not in grow.ready_since and k not in grow.warming
    p.register(warming("d", hi=3, pid=4), now=7)  # back, warming: live from 7, not ready
    assert grow.live_since[key("d")] == 7 and key("d") in grow.warming
    p.tick(now=40)  # everyone silent past the expiry
    assert not p.workers and not grow.live_since and not grow.ready_since and not grow.warming


def test_the_settle_goes_on_counting_on_a_new_leader() -> None:
    """A free worker's record tells since when it has been here and ready (its arrival and
    its turning ready are written; renewals are not): a new leader that hears from it on time
    counts the settle from there, not from the takeover."""
    p = Policy(config(grow_settle_s=20, resize_interval_s=1))
    shrunk(p)
    running(p, 4, "b")
    p.register(reg("c"), now=5)  # ready on arrival: settled at 25
    q = restored(p, 30, grow_settle_s=20, resize_interval_s=1)
    q.register(reg("b"), now=30.5)
    [ask] = q.register(reg("c"), now=30.5).outcome.commands  # its answer to the hello
    assert ask.kind == "checkpoint"


def test_a_joiner_warming_across_a_takeover_settles_from_when_it_is_ready() -> None:
    p = Policy(config(grow_settle_s=20, resize_interval_s=1))
    shrunk(p)
    running(p, 4, "b")
    p.register(warming("c"), now=5)
    q = restored(p, 30, grow_settle_s=20, resize_interval_s=1)
    for t in (30.5, 40):
        q.register(reg("b"), now=t)
        q.register(warming("c"), now=t)
        assert not q.tick(now=t).commands
    q.register(warming("c", ready=True), now=41)  # ready now: settled at 61
    q.register(reg("b"), now=60)
    assert not q.tick(now=60.9).commands
    [ask] = q.tick(now=61).commands
    assert ask.kind == "checkpoint"


def test_a_worker_first_heard_late_by_a_new_leader_settles_from_the_takeover() -> None:
    """Renewals are not stored: one the new leader does not hear within two renewal intervals
    may have been silent past the TTL before it, so its record's time does not count."""
    cfg = {"grow_settle_s": 20.0, "resize_interval_s": 1.0, "worker_ttl_s": 15.0}
    p = Policy(config(**cfg))
    shrunk(p)
    running(p, 4, "b")
    p.register(reg("c"), now=5)
    q = restored(p, 30, **cfg)
    q.register(reg("b"), now=30.5)
    fresh = 2 * q.config.renew_interval_s
    for t in (30 + fresh + 1, 45):
        q.register(reg("b"), now=t)
        assert not q.register(reg("c"), now=t).outcome.commands
        assert not q.tick(now=t).commands
    q.register(reg("b"), now=50)
    [ask] = q.register(reg("c"), now=50).outcome.commands  # live from the takeover at 30
    assert ask.kind == "checkpoint"


def test_status_counts_a_grow_s_checkpoint_as_no_restart() -> None:
    """operations.md: each restart adds one to `restarts` in `marduk monitor status`. The
    grow's checkpoint takes an epoch too and was counted as one (issue 24: `restarts 6` for 5
    restarts and a grow checkpoint); so is it on a new leader, from the stored record."""
    p = Policy(config())
    issued = [shrunk(p)]  # the job formed at epoch 1, then went on without `a` at 2
    running(p, 4, "b")
    p.register(reg("c"), now=5)
    [ask] = p.tick(now=23).commands
    [restart] = checkpointed(p, "b", now=25).commands
    assert (ask.kind, restart.kind) == ("checkpoint", "restart")
    assert [c.epoch for c in issued] == [2] and restart.epoch == 4
    for policy in (p, restored(p, now=26)):
        reply = QueryReply(controller=controller(), workers=policy.worker_infos(now=26))
        [job] = summarize(reply)
        assert (job.epoch, job.restarts) == (4, 3)
