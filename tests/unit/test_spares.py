"""Hot spares and shrink, pure: the rule (``membership.replace``) and the policy that applies it
when a member goes out of service (failure budget spent, quarantine or drain, silence)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from marduk.core import membership as rdzv
from marduk.core.drmap import WorkerKey
from marduk.core.policy import Policy, PolicyConfig, PolicyError
from marduk.core.records import EpochKey, EpochRecord
from marduk.wire.protocol import Command, DeviceHealth, Registration, Rendezvous, Report, WorkerRef

JOB = EpochKey("j", None)


def rz(
    *,
    nproc: int = 2,
    lo: int = 1,
    hi: int = 2,
    spare: bool = False,
    port: int = 40001,
    rank: int | None = None,
):
    return Rendezvous(
        nproc=nproc,
        min_nodes=lo,
        max_nodes=hi,
        node_rank=rank,
        addr="10.0.0.1",
        ports=[port, port + 1],
        spare=spare,
    )


def cand(replica: str, at: float = 0.0, **kw) -> rdzv.Candidate:
    return rdzv.Candidate(WorkerKey("j", replica, 0), rz(**kw), at)


def key(replica: str) -> WorkerKey:
    return WorkerKey("j", replica, 0)


def reg(replica: str, *, pid: int = 1, **kw) -> Registration:
    return Registration(
        job="j",
        replica=replica,
        host=replica,
        devices=[f"{replica}-d0"],
        scope="job",
        pid=pid,
        rendezvous=rz(**kw),
    )


def ranks(cmd: Command | None) -> list[tuple[str, int, int]]:
    assert cmd is not None and cmd.membership is not None
    return [(m.replica, m.node_rank, m.first_rank) for m in cmd.membership.members]


# --- the rule -------------------------------------------------------------------------------------


def three() -> tuple[rdzv.Candidate, ...]:
    return cand("a", 1, hi=3), cand("b", 2, hi=3), cand("c", 3, hi=3)


def test_a_spare_of_the_same_shape_takes_the_lost_members_ranks() -> None:
    m = rdzv.form(1, three())
    assert m is not None
    s = cand("s", 4, hi=3, spare=True, port=41000)
    change = rdzv.replace(m, 2, "j", {key("b")}, [*three(), s], min_nodes=1)
    assert change.membership is not None and not change.dropped
    assert [(x.replica, x.node_rank, x.first_rank) for x in change.membership.members] == [
        ("a", 0, 0),
        ("s", 1, 2),
        ("c", 2, 4),
    ]
    assert change.membership.world_size == m.world_size
    assert [(lost.replica, c.key.replica) for lost, c in change.replaced] == [("b", "s")]


def test_a_spare_of_another_shape_is_never_chosen_and_the_job_shrinks() -> None:
    m = rdzv.form(1, three())
    assert m is not None
    odd = cand("s", 4, nproc=1, hi=3, spare=True)
    change = rdzv.replace(m, 2, "j", {key("a")}, [*three(), odd], min_nodes=1)
    assert change.membership is not None and not change.replaced
    # Contiguous again, and the coordinator moved to the new node 0 (b's address and port).
    assert [(x.replica, x.node_rank, x.first_rank) for x in change.membership.members] == [
        ("b", 0, 0),
        ("c", 1, 2),
    ]
    assert change.membership.world_size == 4 and [d.replica for d in change.dropped] == ["a"]


def test_below_min_there_is_no_membership() -> None:
    m = rdzv.form(1, three())
    assert m is not None
    change = rdzv.replace(m, 2, "j", {key("a"), key("b")}, three(), min_nodes=2)
    assert change.membership is None and len(change.dropped) == 2


def test_two_lost_members_take_two_spares_never_one() -> None:
    m = rdzv.form(1, three())
    assert m is not None
    spares = [cand("s", 5, hi=3, spare=True), cand("t", 4, hi=3, spare=True)]
    change = rdzv.replace(m, 2, "j", {key("a"), key("c")}, [*three(), *spares], min_nodes=1)
    assert change.membership is not None
    # Spares by time of registration: t came first.
    assert [(x.replica, x.node_rank) for x in change.membership.members] == [
        ("t", 0),
        ("b", 1),
        ("s", 2),
    ]


@given(
    n=st.integers(1, 6),
    lost=st.sets(st.integers(0, 5)),
    spares=st.lists(st.integers(1, 2), max_size=4),
    lo=st.integers(1, 6),
)
def test_no_rank_is_given_twice_after_a_change(
    n: int, lost: set[int], spares: list[int], lo: int
) -> None:
    members = [cand(f"m{i}", i, hi=6) for i in range(n)]
    m = rdzv.form(1, members)
    assert m is not None
    pool = [cand(f"s{i}", 10 + i, nproc=p, hi=6, spare=True) for i, p in enumerate(spares)]
    gone = {key(f"m{i}") for i in lost if i < n}
    change = rdzv.replace(m, 2, "j", gone, [*members, *pool], min_nodes=lo)
    new = change.membership
    if new is None:
        assert n - len(change.dropped) < lo
        return
    assert [x.node_rank for x in new.members] == list(range(len(new.members)))
    flat = [r for x in new.members for r in range(x.first_rank, x.first_rank + x.nproc)]
    assert flat == list(range(new.world_size))
    names = [(x.replica, x.worker) for x in new.members]
    assert len(set(names)) == len(names)
    assert not {key(r) for r, _ in names} & gone
    assert all(x.nproc == 2 for x in new.members)  # a 1-rank spare never took a 2-rank place


# --- the policy ---------------------------------------------------------------------------------


def formed(p: Policy, *, hi: int = 2, lo: int = 1, spares: int = 1) -> Command:
    p.register(reg("a", pid=1, lo=lo, hi=hi), now=0)
    cmd = p.register(reg("b", pid=2, lo=lo, hi=hi), now=0).command
    for i in range(spares):
        p.register(reg(f"s{i}", pid=10 + i, lo=lo, hi=hi, spare=True), now=1)
    assert cmd is not None and cmd.membership is not None
    for w in ("a", "b"):
        p.on_report(Report(job="j", replica=w, status="running", epoch=cmd.epoch), now=2)
    return cmd


def fail(device: str, n: int) -> DeviceHealth:
    return DeviceHealth(device=device, state="failed", event_id=f"{device}-{n}", reason="ecc")


def test_spares_never_form_the_first_membership_nor_restart_the_job() -> None:
    p = Policy()
    p.register(reg("s0", pid=10, spare=True), now=0)
    p.register(reg("a", pid=1), now=0)
    assert p.epochs[JOB].membership is None  # one non-spare of MAX 2: not yet
    first = p.register(reg("b", pid=2), now=0).command
    assert ranks(first) == [("a", 0, 0), ("b", 1, 2)]
    # A spare's device failing restarts nothing: it runs no trainer.
    r = p.on_health(fail("s0-d0", 1), now=1)
    assert not r.outcome.commands


def test_a_device_past_its_budget_hands_its_members_ranks_to_a_spare() -> None:
    p = Policy(PolicyConfig(device_max_failures=1))
    first = formed(p)
    [again] = p.on_health(fail("b-d0", 1), now=3).outcome.commands  # within the budget
    assert again.kind == "restart" and ranks(again) == ranks(first)
    for w in ("a", "b"):
        p.on_report(Report(job="j", replica=w, status="running", epoch=again.epoch), now=3)
    r = p.on_health(fail("b-d0", 2), now=4)
    [cmd] = r.outcome.commands
    assert cmd.kind == "restart" and cmd.epoch > first.epoch
    assert ranks(cmd) == [("a", 0, 0), ("s0", 1, 2)]
    assert cmd.retired == [WorkerRef(replica="b")]
    assert p.epochs[JOB] in r.outcome.write_ahead  # the membership is durable first
    assert {e.kind for e in r.outcome.events} >= {"member_replaced", "restart_issued"}
    assert p.workers[key("b")].retired and p.workers[key("b")] in r.outcome.put_workers
    # The spare is awaited now; the retired member is not.
    assert p.awaiting(JOB) == {key("a"), key("s0")}
    # The retired member re-registering (same process) is still told; a new pod is a spare.
    again = p.register(reg("b", pid=2), now=5)
    assert again.command is not None and again.command.retired == [WorkerRef(replica="b")]
    with_new_pod = p.register(reg("b", pid=99), now=100)
    assert not p.workers[key("b")].retired and with_new_pod.outcome.put_workers


def test_a_renewal_checks_its_rank_claim_but_scans_no_other_worker(monkeypatch) -> None:
    """A live worker renewing the registration it was admitted with is not checked against the
    job's other workers again (each admitted since was checked against it: at 1,024 nodes that
    scan was most of a renewal's cost), but its --node-rank still is, against the membership:
    a spare may hold that rank now."""
    p = Policy(PolicyConfig(device_max_failures=0))
    p.register(reg("a", pid=1, rank=0), now=0)
    p.register(reg("b", pid=2, rank=1), now=0)
    p.register(reg("s0", pid=10, spare=True), now=1)
    [swap] = p.on_health(fail("b-d0", 1), now=3).outcome.commands
    assert ranks(swap) == [("a", 0, 0), ("s0", 1, 2)]

    def no_scan(*_a: object) -> None:
        raise AssertionError("a renewal scanned the job's workers")

    monkeypatch.setattr("marduk.core.membership.check", no_scan)
    assert p.register(reg("a", pid=1, rank=0), now=4).result == "unchanged"
    with pytest.raises(PolicyError) as e:  # b, retired, still claims node rank 1: s0 holds it
        p.register(reg("b", pid=2, rank=1), now=4)
    assert e.value.code == "rank_conflict" and "s0/0" in str(e.value)


def test_a_replaced_container_with_the_same_host_and_pid_is_not_retired() -> None:
    """A StatefulSet pod's agent is PID 1 on the same host name after every replacement: its
    instance token tells the new process from the retired one, and it takes over at once."""
    p = Policy(PolicyConfig(device_max_failures=1))
    formed(p)
    p.on_health(fail("b-d0", 1), now=3)
    for w in ("a", "b"):
        p.on_report(Report(job="j", replica=w, status="running", epoch=p.epochs[JOB].epoch), now=3)
    p.on_health(fail("b-d0", 2), now=4)
    assert p.workers[key("b")].retired
    old = p.workers[key("b")].registration
    same = msgspec.structs.replace(old, instance=old.instance)
    assert p.register(same, now=5).command is not None and p.workers[key("b")].retired
    replaced = msgspec.structs.replace(old, instance="new-container")
    r = p.register(replaced, now=6)  # no duplicate_worker: the old process is gone
    assert not p.workers[key("b")].retired and r.outcome.put_workers


def test_without_a_spare_the_job_shrinks_and_the_coordinator_moves() -> None:
    p = Policy(PolicyConfig(device_max_failures=0))
    formed(p, spares=0)
    r = p.on_health(fail("a-d0", 1), now=3)
    [cmd] = r.outcome.commands
    assert ranks(cmd) == [("b", 0, 0)]
    assert cmd.membership is not None and cmd.membership.world_size == 2
    assert cmd.membership.coordinator_addr == "10.0.0.1" and cmd.retired == [WorkerRef(replica="a")]
    assert "job_shrunk" in {e.kind for e in r.outcome.events}


def test_below_min_the_job_is_held_then_forms_again() -> None:
    p = Policy(PolicyConfig(device_max_failures=0, join_timeout_s=0))
    formed(p, lo=2, spares=0)
    r = p.on_health(fail("a-d0", 1), now=3)
    [cmd] = r.outcome.commands
    assert cmd.kind == "restart" and cmd.membership is None and p.epochs[JOB].membership is None
    assert p.epochs[JOB] in r.outcome.write_ahead
    assert "job_held" in {e.kind for e in r.outcome.events}
    # The retired member is no candidate; a new worker brings the job back to MIN.
    back = p.register(reg("c", pid=3, lo=2), now=4)
    assert ranks(back.command) == [("b", 0, 0), ("c", 1, 2)]


def test_the_held_jobs_reason_counts_its_workers_in_words() -> None:
    p = Policy(PolicyConfig(device_max_failures=0, join_timeout_s=0))
    formed(p, lo=1, spares=0)
    p.on_health(fail("a-d0", 1), now=3)  # shrinks to b alone
    r = p.on_health(fail("b-d0", 2), now=4)
    [why] = [e.detail for e in r.outcome.events if e.kind == "job_held"]
    assert why.endswith(
        "job held: 0 node(s) left, below MIN 1; its trainers wait until 1 worker is "
        "registered, then the membership forms again"
    )


def test_a_quarantine_or_drain_takes_out_only_the_member_using_it() -> None:
    p = Policy()
    first = formed(p)
    d = p.drain(["a-d0"], "", False, "bad host", now=3)
    [cmd] = d.outcome.commands
    assert [a.kind for a in d.actions] == ["restart"]
    assert ranks(cmd) == [("s0", 0, 0), ("b", 1, 2)]
    assert first.membership is not None and cmd.membership is not None
    assert cmd.membership.coordinator_port != first.membership.coordinator_port
    # A drained spare is not chosen: the next loss shrinks.
    p.register(reg("s1", pid=11, spare=True), now=3)
    p.drain(["s1-d0"], "", False, "", now=4)
    assert not p.epochs[JOB].command or p.epochs[JOB].command.epoch == cmd.epoch
    [shrink] = p.drain(["b-d0"], "", False, "", now=5).outcome.commands
    assert ranks(shrink) == [("s0", 0, 0)]


def test_a_silent_member_is_replaced_at_the_next_tick() -> None:
    p = Policy(PolicyConfig(worker_ttl_s=10))
    formed(p)
    for w, pid in (("a", 1), ("s0", 10)):
        p.register(reg(w, pid=pid, spare=w == "s0"), now=9)
    out = p.tick(now=13)  # b last heard at 2
    [cmd] = out.commands
    assert ranks(cmd) == [("a", 0, 0), ("s0", 1, 2)]
    assert "member_replaced" in {e.kind for e in out.events}


def test_a_spare_of_another_shape_registers_but_is_never_chosen() -> None:
    p = Policy(PolicyConfig(device_max_failures=0))
    formed(p, spares=0)
    p.register(reg("odd", pid=7, nproc=1, spare=True), now=2)
    [cmd] = p.on_health(fail("b-d0", 1), now=3).outcome.commands
    assert ranks(cmd) == [("a", 0, 0)]
    # Only spares may bring another shape.
    try:
        p.register(reg("z", pid=8, nproc=1), now=4)
    except PolicyError as e:
        assert e.code == "shape_mismatch"
    else:
        raise AssertionError("a member of another shape was admitted")


def test_the_change_survives_a_restore_and_the_retired_stay_retired() -> None:
    p = Policy(PolicyConfig(device_max_failures=0))
    formed(p)
    [cmd] = p.on_health(fail("b-d0", 1), now=3).outcome.commands
    stored = msgspec.json.decode(msgspec.json.encode(p.epochs[JOB]), type=EpochRecord)
    workers = [
        msgspec.json.decode(msgspec.json.encode(w), type=type(w)) for w in p.workers.values()
    ]
    q = Policy.restore(PolicyConfig(), workers, [stored], list(p.devices.values()), now=5)
    assert q.epochs[JOB].membership == cmd.membership and q.workers[key("b")].retired
    again = q.register(reg("s0", pid=10, spare=True), now=6)
    assert again.command == cmd


def test_a_failure_that_spends_the_budget_retires_the_member_during_a_restart_in_flight() -> None:
    """A restart is in flight (``a`` crashed) when ``b``'s device fails past its budget: the
    failure is not merged into that restart (which would let ``b`` restart on the bad device,
    uncounted) but takes ``b`` out at once, as it would with no restart in flight."""
    p = Policy(PolicyConfig(device_max_failures=1, worker_ttl_s=1000))
    first = formed(p)
    [again] = p.on_health(fail("b-d0", 1), now=3).outcome.commands  # within the budget
    for w in ("a", "b"):
        p.on_report(Report(job="j", replica=w, status="running", epoch=again.epoch), now=3)
    crash = Report(job="j", replica="a", status="crashed", epoch=again.epoch)
    [restart] = p.on_report(crash, now=4).outcome.commands
    assert restart.kind == "restart" and ranks(restart) == ranks(first)
    r = p.on_health(fail("b-d0", 2), now=5)  # b has not confirmed the crash's restart
    [cmd] = r.outcome.commands
    assert cmd.epoch > restart.epoch and ranks(cmd) == [("a", 0, 0), ("s0", 1, 2)]
    assert cmd.retired == [WorkerRef(replica="b")] and p.workers[key("b")].retired
    assert [a.coalesced for a in r.reply.actions] == [False]
    assert "member_replaced" in {e.kind for e in r.outcome.events}


def test_a_failure_within_the_budget_or_a_repeat_still_joins_the_restart_in_flight() -> None:
    p = Policy(PolicyConfig(device_max_failures=1, worker_ttl_s=1000))
    formed(p)
    [first] = p.on_health(fail("b-d0", 1), now=3).outcome.commands
    # The same device again before b restarted: the incident the restart is for, merged.
    again = p.on_health(fail("b-d0", 2), now=3.5)
    assert not again.outcome.commands and [a.coalesced for a in again.reply.actions] == [True]
    # Another member's device within its budget: merged into the same restart.
    other = p.on_health(fail("a-d0", 1), now=3.6)
    assert not other.outcome.commands and [a.coalesced for a in other.reply.actions] == [True]
    assert p.epochs[JOB].epoch == first.epoch and not p.workers[key("b")].retired


def test_a_free_spares_own_failure_report_restarts_nothing_a_holding_one_as_any_member() -> None:
    """A free spare runs no trainer: its agent reporting ``preempted`` (its pod evicted) or
    ``crashed`` must not restart the job's members. Once it holds a lost member's ranks it is a
    member, and its report restarts the job like any member's."""
    p = Policy(PolicyConfig(device_max_failures=0))
    first = formed(p)
    for status in ("preempted", "crashed", "gave_up"):
        r = p.on_report(Report(job="j", replica="s0", status=status, epoch=first.epoch), now=3)
        assert not r.actions and not r.outcome.commands, status
        assert f"worker_{status}" in {e.kind for e in r.outcome.events}
    assert p.epochs[JOB].epoch == first.epoch
    [swap] = p.on_health(fail("b-d0", 1), now=4).outcome.commands  # s0 takes b's ranks
    assert ranks(swap) == [("a", 0, 0), ("s0", 1, 2)]
    for w in ("a", "s0"):
        p.on_report(Report(job="j", replica=w, status="running", epoch=swap.epoch), now=5)
    r = p.on_report(Report(job="j", replica="s0", status="preempted", epoch=swap.epoch), now=6)
    [action] = r.actions
    assert action.kind == "restart" and not action.coalesced and action.epoch > swap.epoch


def test_a_spares_report_restarts_nothing_while_the_job_forms_or_is_held() -> None:
    """Before the first membership (and while held) nobody runs a trainer, a declared spare
    least of all: its report (or its device failing) must not restart the job either."""
    p = Policy(PolicyConfig(device_max_failures=0))
    p.register(reg("a", pid=1, lo=2, hi=3), now=0)
    p.register(reg("s0", pid=10, lo=2, hi=3, spare=True), now=0)
    assert p.epochs[JOB].membership is None
    r = p.on_report(Report(job="j", replica="s0", status="preempted", epoch=0), now=1)
    assert not r.actions and not r.outcome.commands
    assert not p.on_health(fail("s0-d0", 1), now=2).outcome.commands
    assert p.epochs[JOB].epoch == 0


def test_a_members_failure_report_restarts_nothing_while_the_job_forms() -> None:
    """A non-spare of a job below MIN runs no trainer yet: its supervisor's failure report is
    recorded and announced (saying nothing restarts), and the job forms as before."""
    p = Policy(PolicyConfig(join_timeout_s=5))
    p.register(reg("a", pid=1, lo=2, hi=3), now=0)
    assert p.epochs[JOB].membership is None
    for status in ("crashed", "preempted", "hung", "gave_up"):
        r = p.on_report(Report(job="j", replica="a", status=status, epoch=0), now=1)
        assert not r.actions and not r.outcome.commands, status
        [event] = [e for e in r.outcome.events if e.kind == f"worker_{status}"]
        assert "nothing restarted" in event.detail and "forming" in event.detail
    assert p.epochs[JOB].epoch == 0 and p.epochs[JOB].command is None
    first = p.register(reg("b", pid=2, lo=2, hi=3), now=2).command  # MIN: the join timeout
    assert first is None
    p.tick(now=8)
    assert ranks(p.epochs[JOB].command) == [("a", 0, 0), ("b", 1, 2)]


def test_a_members_failure_report_restarts_nothing_while_the_job_is_held() -> None:
    """Held below MIN, the job runs nothing: a remaining member's trainer reporting a failure
    (it was stopped by the hold) issues no second restart."""
    p = Policy(PolicyConfig(device_max_failures=0))
    first = formed(p, lo=2, spares=0)
    [hold] = p.on_health(fail("b-d0", 1), now=3).outcome.commands
    assert hold.membership is None and p.epochs[JOB].membership is None
    r = p.on_report(Report(job="j", replica="a", status="crashed", epoch=hold.epoch), now=4)
    assert not r.actions and not r.outcome.commands
    [event] = [e for e in r.outcome.events if e.kind == "worker_crashed"]
    assert "nothing restarted" in event.detail and "held below MIN" in event.detail
    assert p.epochs[JOB].epoch == hold.epoch > first.epoch


@pytest.mark.parametrize("budget", [3, 0])
def test_a_device_failure_restarts_nothing_while_the_job_forms_and_the_worker_is_left_out(
    budget: int,
) -> None:
    """Forming, nobody runs a trainer: a worker's device failing neither restarts the job nor
    (its budget spent) fails every worker of it; the device is known failed, so the job forms
    without that worker."""
    p = Policy(PolicyConfig(device_max_failures=budget, join_timeout_s=5))
    p.register(reg("a", pid=1, lo=2, hi=3), now=0)
    r = p.on_health(fail("a-d0", 1), now=1)
    assert not r.outcome.commands and not r.reply.actions
    assert p.devices["a-d0"].state == "failed" and p.epochs[JOB].epoch == 0
    p.register(reg("b", pid=2, lo=2, hi=3), now=2)
    p.register(reg("c", pid=3, lo=2, hi=3), now=2)
    [first] = p.tick(now=7).commands  # MIN usable (b, c) for the join timeout
    assert ranks(first) == [("b", 0, 0), ("c", 1, 2)]


def test_a_device_failure_of_a_held_jobs_worker_restarts_nothing() -> None:
    p = Policy(PolicyConfig(device_max_failures=0))
    formed(p, lo=2, spares=0)
    [hold] = p.on_health(fail("b-d0", 1), now=3).outcome.commands
    assert hold.membership is None
    assert not p.on_health(fail("a-d0", 1), now=4).outcome.commands
    assert p.epochs[JOB].epoch == hold.epoch


def sick(replica: str, why: str, *, pid: int, **kw) -> Registration:
    """``replica``'s registration saying its node failed its checks (``Rendezvous.unhealthy``)."""
    r = reg(replica, pid=pid, **kw)
    assert r.rendezvous is not None
    return msgspec.structs.replace(
        r, rendezvous=msgspec.structs.replace(r.rendezvous, unhealthy=why)
    )


def test_an_unhealthy_node_takes_no_rank_and_a_spare_forms_the_job_in_its_place() -> None:
    p = Policy(PolicyConfig(join_timeout_s=5))
    p.register(reg("a", pid=1, lo=2), now=0)
    out = p.register(sick("b", "gpu 3: xid 79", pid=2, lo=2), now=0).outcome
    assert [e.detail for e in out.events if e.kind == "worker_unhealthy"] == ["gpu 3: xid 79"]
    p.register(reg("s0", pid=10, lo=2, spare=True), now=1)
    assert p.epochs[JOB].membership is None  # b counts for nothing: the spare is needed
    [cmd] = p.tick(now=7).commands  # MIN fit ones for the join timeout
    assert ranks(cmd) == [("a", 0, 0), ("s0", 1, 2)]
    [b] = [w for w in p.worker_infos("j", now=7) if w.replica == "b"]
    assert (b.part, b.unhealthy) == ("unhealthy", "gpu 3: xid 79")


def test_a_member_that_turns_unhealthy_is_retired_and_a_spare_takes_its_ranks() -> None:
    p = Policy()
    first = formed(p)
    r = p.register(sick("b", "storage /data: missing", pid=2), now=3)
    cmd = r.command
    assert cmd is not None and cmd.epoch > first.epoch
    assert ranks(cmd) == [("a", 0, 0), ("s0", 1, 2)]
    assert WorkerRef(replica="b", worker=0) in cmd.retired
    assert p.workers[key("b")].retired.endswith("unhealthy: storage /data: missing")
    # Again, unchanged: nothing more happens; healthy again, it stays retired.
    assert not p.register(sick("b", "storage /data: missing", pid=2), now=4).outcome.commands
    healed = p.register(reg("b", pid=2), now=5).outcome
    assert "worker_healthy" in {e.kind for e in healed.events} and not healed.commands
