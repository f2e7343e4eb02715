"""Membership per epoch, pure: the rule (marduk/core/membership.py) and the policy that applies it
(first epoch, restarts, refusals, the join timeout, restore from the records)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from marduk.core import membership as rdzv
from marduk.core.drmap import WorkerKey
from marduk.core.policy import Policy, PolicyConfig, PolicyError
from marduk.core.records import EpochKey, EpochRecord
from marduk.wire.protocol import Command, Membership, Registration, Rendezvous, Report

JOB = EpochKey("j", None)


def rz(
    *, nproc: int = 2, lo: int = 2, hi: int = 2, rank: int | None = None, ports=(40001, 40002)
) -> Rendezvous:
    return Rendezvous(
        nproc=nproc, min_nodes=lo, max_nodes=hi, node_rank=rank, addr="10.0.0.1", ports=list(ports)
    )


def cand(replica: str, at: float = 0.0, **kw) -> rdzv.Candidate:
    return rdzv.Candidate(WorkerKey("j", replica, 0), rz(**kw), at)


def reg(replica: str, *, pid: int = 1, addr: str = "", **kw) -> Registration:
    r = rz(**kw)
    if addr:
        r = msgspec.structs.replace(r, addr=addr)
    return Registration(
        job="j",
        replica=replica,
        host=replica,
        devices=[f"{replica}-d0"],
        scope="job",
        pid=pid,
        rendezvous=r,
    )


# --- the rule -------------------------------------------------------------------------------------


def test_unranked_workers_get_ranks_in_order_of_registration() -> None:
    m = rdzv.form(1, [cand("b", at=2, hi=3), cand("a", at=3, hi=3), cand("c", at=1, hi=3)])
    assert m is not None
    assert [(x.replica, x.node_rank, x.first_rank) for x in m.members] == [
        ("c", 0, 0),
        ("b", 1, 2),
        ("a", 2, 4),
    ]
    assert m.world_size == 6 and m.epoch == 1
    assert (m.coordinator_addr, m.coordinator_port) == ("10.0.0.1", 40001)


def test_given_node_ranks_are_kept_and_the_others_fill_the_gaps() -> None:
    three = {"hi": 3}
    m = rdzv.form(
        1,
        [
            cand("a", at=1, **three),
            cand("b", at=2, rank=0, **three),
            cand("c", at=3, rank=2, **three),
        ],
    )
    assert m is not None
    assert [(x.replica, x.node_rank) for x in m.members] == [("b", 0), ("a", 1), ("c", 2)]


def test_a_given_rank_the_workers_cannot_fill_waits() -> None:
    assert rdzv.form(1, [cand("a", lo=1, hi=4), cand("b", lo=1, hi=4, rank=3)]) is None


def test_workers_beyond_max_are_not_members() -> None:
    m = rdzv.form(1, [cand("a", at=1), cand("b", at=2), cand("c", at=3)])
    assert m is not None and [x.replica for x in m.members] == ["a", "b"]


def test_ready_at_max_or_min_after_the_join_timeout() -> None:
    two = [cand("a", lo=2, hi=3), cand("b", lo=2, hi=3)]
    assert not rdzv.ready(two[:1], 0.0, 100.0, 30.0)  # below MIN: never
    assert not rdzv.ready(two, 0.0, 29.0, 30.0)
    assert rdzv.ready(two, 0.0, 30.0, 30.0)
    assert rdzv.ready([*two, cand("c", lo=2, hi=3)], 29.0, 29.0, 30.0)  # MAX: at once


def test_a_second_claim_of_a_node_rank_is_refused() -> None:
    with pytest.raises(rdzv.MembershipError) as e:
        rdzv.check(cand("b", rank=1), [cand("a", rank=1)], None)
    assert e.value.code == "rank_conflict" and "claimed by live worker a/0" in str(e.value)


def test_a_rank_assigned_to_a_live_member_is_refused_to_a_claimant() -> None:
    m = rdzv.form(1, [cand("a", at=1), cand("b", at=2)])
    with pytest.raises(rdzv.MembershipError, match="held by live worker b/0 since epoch 1"):
        rdzv.check(cand("c", rank=1), [cand("a"), cand("b")], m)
    rdzv.check(cand("c", rank=1), [cand("a")], m)  # b is gone: c may take its rank


def test_another_shape_is_refused() -> None:
    with pytest.raises(rdzv.MembershipError, match="runs 2 local rank") as e:
        rdzv.check(cand("b", nproc=4), [cand("a")], None)
    assert e.value.code == "shape_mismatch"
    with pytest.raises(rdzv.MembershipError, match="--nnodes 2:2"):
        rdzv.check(cand("b", lo=1, hi=2), [cand("a")], None)
    with pytest.raises(rdzv.MembershipError, match="not below"):
        rdzv.check(cand("b", rank=2), [], None)


def test_a_restart_keeps_the_ranks_and_never_reuses_the_coordinator_port() -> None:
    first = rdzv.form(1, [cand("a", at=1), cand("b", at=2)])
    assert first is not None and first.coordinator_port == 40001
    again = rdzv.renew(first, 2, "j", [cand("a", at=1), cand("b", at=2)])
    assert [(x.replica, x.node_rank) for x in again.members] == [("a", 0), ("b", 1)]
    assert again.coordinator_port == 40002 and again.epoch == 2
    # The agent reported fresh ports meanwhile: the first of those.
    later = rdzv.renew(again, 3, "j", [cand("a", ports=(40002, 40007)), cand("b")])
    assert later.coordinator_port == 40007


def test_a_gone_member_keeps_its_rank_unless_a_live_worker_claims_it() -> None:
    first = rdzv.form(1, [cand("a", at=1), cand("b", at=2)])
    assert first is not None
    kept = rdzv.renew(first, 2, "j", [cand("a")])
    assert [x.replica for x in kept.members] == ["a", "b"]
    taken = rdzv.renew(first, 3, "j", [cand("a"), cand("c", rank=1)])
    assert [(x.replica, x.node_rank) for x in taken.members] == [("a", 0), ("c", 1)]


def test_with_no_ports_reported_the_port_still_moves() -> None:
    first = rdzv.form(1, [cand("a", ports=()), cand("b", ports=())])
    assert first is not None
    second = rdzv.renew(first, 2, "j", [cand("a", ports=()), cand("b", ports=())])
    assert second.coordinator_port != first.coordinator_port


@given(
    st.lists(
        st.tuples(st.integers(1, 8), st.booleans()), min_size=1, max_size=8, unique_by=lambda t: t
    )
)
def test_no_rank_is_given_twice_and_ranks_are_contiguous(spec) -> None:
    """Whatever the workers and the ranks they were given, every global rank is held once."""
    hi = 8
    candidates, claimed = [], set()
    for i, (rank, give) in enumerate(spec):
        r = rank - 1 if give and rank - 1 not in claimed else None
        if r is not None:
            claimed.add(r)
        candidates.append(cand(f"w{i}", at=float(i), lo=1, hi=hi, rank=r))
    m = rdzv.form(1, candidates)
    if m is None:
        assert any(c.rendezvous.node_rank is not None for c in candidates)
        return
    assert [x.node_rank for x in m.members] == list(range(len(m.members)))
    ranks = [r for x in m.members for r in range(x.first_rank, x.first_rank + x.nproc)]
    assert ranks == list(range(m.world_size))
    assert len({(x.replica, x.worker) for x in m.members}) == len(m.members)


# --- the policy -------------------------------------------------------------------------------------


def test_the_controller_assigns_ranks_once_max_workers_registered() -> None:
    p = Policy()
    one = p.register(reg("a", pid=1), now=0)
    assert one.command is None and not one.outcome.commands  # waiting for the second
    two = p.register(reg("b", pid=2), now=1)
    [cmd] = two.outcome.commands
    assert cmd.kind == "restart" and cmd.replica is None and cmd.membership is not None
    m = cmd.membership
    assert [(x.replica, x.node_rank) for x in m.members] == [("a", 0), ("b", 1)]
    assert m.epoch == cmd.epoch == two.epoch and two.command == cmd
    # Written ahead: durable before the command goes out.
    state = p.epochs[JOB]
    assert state in two.outcome.write_ahead and state.membership == m
    assert any(e.kind == "membership_formed" for e in two.outcome.events)


def test_min_workers_form_after_the_join_timeout() -> None:
    p = Policy(PolicyConfig(join_timeout_s=10))
    p.register(reg("a", pid=1, lo=1, hi=3), now=0)
    assert not p.tick(now=9).commands
    [cmd] = p.tick(now=10).commands
    assert cmd.membership is not None and [x.replica for x in cmd.membership.members] == ["a"]


def test_every_restart_carries_the_same_ranks_and_a_new_port() -> None:
    p = Policy()
    p.register(reg("a", pid=1), now=0)
    first = p.register(reg("b", pid=2), now=0).command
    assert first is not None and first.membership is not None
    for w in ("a", "b"):
        p.on_report(Report(job="j", replica=w, status="running", epoch=first.epoch), now=1)
    crash = Report(job="j", replica="b", status="crashed", epoch=first.epoch)
    r = p.on_report(crash, now=2)
    [cmd] = r.outcome.commands
    m = cmd.membership
    assert m is not None and m.epoch == cmd.epoch > first.epoch
    assert [(x.replica, x.node_rank) for x in m.members] == [("a", 0), ("b", 1)]
    assert m.coordinator_port != first.membership.coordinator_port
    assert p.epochs[JOB] in r.outcome.write_ahead


def test_a_worker_beyond_max_never_holds_a_restart_in_flight() -> None:
    """It starts no trainer, so it never confirms: the members' confirmations end the restart
    (else every restart of the job would wait out the pending timeout, coalescing failures)."""
    p = Policy()
    p.register(reg("a", pid=1), now=0)
    first = p.register(reg("b", pid=2), now=0).command
    assert first is not None and first.membership is not None
    extra = p.register(reg("c", pid=3), now=0)
    assert extra.outcome.commands == [] and WorkerKey("j", "c", 0) not in p.awaiting(JOB)
    for w in ("a", "b"):
        p.on_report(Report(job="j", replica=w, status="running", epoch=first.epoch), now=1)
    assert not p.awaiting(JOB)
    [cmd] = p.on_report(
        Report(job="j", replica="a", status="crashed", epoch=first.epoch), now=2
    ).outcome.commands
    assert p.awaiting(JOB) == {WorkerKey("j", "a", 0), WorkerKey("j", "b", 0)}
    for w in ("a", "b"):
        p.on_report(Report(job="j", replica=w, status="running", epoch=cmd.epoch), now=3)
    assert not p.awaiting(JOB)  # a new failure is a new restart, not coalesced into this one
    stored = msgspec.json.decode(msgspec.json.encode(p.epochs[JOB]), type=EpochRecord)
    q = Policy.restore(PolicyConfig(), list(p.workers.values()), [stored], [], now=5)
    assert WorkerKey("j", "c", 0) not in q.awaiting(JOB)


def test_a_duplicate_rank_and_a_wrong_shape_are_refused_with_a_reason() -> None:
    p = Policy()
    p.register(reg("a", pid=1, rank=0), now=0)
    with pytest.raises(PolicyError) as e:
        p.register(reg("b", pid=2, rank=0), now=1)
    assert e.value.code == "rank_conflict"
    with pytest.raises(PolicyError) as e:
        p.register(reg("c", pid=3, nproc=1), now=1)
    assert e.value.code == "shape_mismatch"
    assert WorkerKey("j", "b", 0) not in p.workers  # a refusal leaves no trace


def test_static_and_controller_ranks_do_not_mix_in_one_job() -> None:
    p = Policy()
    p.register(reg("a", pid=1), now=0)
    plain = Registration(job="j", replica="z", devices=[], scope="job", pid=9)
    with pytest.raises(PolicyError, match="from the controller") as e:
        p.register(plain, now=1)
    assert e.value.code == "shape_mismatch"
    with pytest.raises(PolicyError, match="scope job"):
        p.register(msgspec.structs.replace(reg("q", pid=5), scope="replica", job="k"), now=1)


def test_the_membership_survives_a_restore_from_the_records() -> None:
    p = Policy()
    p.register(reg("a", pid=1), now=0)
    first = p.register(reg("b", pid=2), now=0).command
    assert first is not None
    stored = msgspec.json.decode(msgspec.json.encode(p.epochs[JOB]), type=EpochRecord)
    workers, ceiling = list(p.workers.values()), stored.ceiling
    q = Policy.restore(PolicyConfig(), workers, [stored], [], now=5)
    assert q.epochs[JOB].membership == first.membership
    again = q.register(reg("a", pid=1), now=6)
    assert again.command is not None and again.command.membership == first.membership
    r = q.on_report(Report(job="j", replica="a", status="crashed", epoch=first.epoch), now=7)
    [cmd] = r.outcome.commands
    assert cmd.membership is not None and cmd.epoch > ceiling
    assert [x.replica for x in cmd.membership.members] == ["a", "b"]
    assert cmd.membership.coordinator_port != first.membership.coordinator_port


def test_commands_and_records_of_other_jobs_carry_no_membership() -> None:
    p = Policy()
    p.register(Registration(job="k", replica="r", devices=["x"], scope="job"), now=0)
    r = p.on_report(Report(job="k", replica="r", status="crashed"), now=1)
    [cmd] = r.outcome.commands
    assert cmd.membership is None and p.epochs[EpochKey("k", None)].membership is None
    wire = msgspec.json.decode(msgspec.json.encode(cmd))
    assert wire["membership"] is None
    assert msgspec.json.decode(msgspec.json.encode(cmd), type=Command) == cmd
    assert Membership.__struct_fields__[-1] == "members"


def test_a_worker_back_from_stale_counts_as_arriving_for_the_join_timeout() -> None:
    """MIN were here at 0, but b went silent before the join timeout: MIN are here again only
    from b's return, so the job waits the timeout from then (it must not form at once, with
    the workers it had long ago), and a new leader reading b's record counts the same."""
    cfg = PolicyConfig(join_timeout_s=10, worker_ttl_s=3, worker_expiry_s=1000)
    p = Policy(cfg)
    p.register(reg("a", pid=1, lo=2, hi=3), now=0)
    p.register(reg("b", pid=2, lo=2, hi=3), now=0)
    for t in range(2, 21, 2):  # a renews; b is silent, stale from 3
        p.register(reg("a", pid=1, lo=2, hi=3), now=t)
        assert not p.tick(now=t).commands
    assert WorkerKey("j", "b", 0) in p.fleet.stale
    back = p.register(reg("b", pid=2, lo=2, hi=3), now=21)
    assert back.command is None and p.epochs[JOB].membership is None
    [rec] = [r for r in back.outcome.put_workers if r.registration.replica == "b"]
    assert rec.registered_at == 21  # written: a new leader reads the return
    stored = [
        msgspec.json.decode(msgspec.json.encode(e), type=EpochRecord) for e in p.epochs.values()
    ]
    q = Policy.restore(cfg, list(p.workers.values()), stored, [], now=22)
    for policy in (p, q):
        for t in (22, 24, 26, 28, 30, 30.9):  # both renew
            for w, pid in (("a", 1), ("b", 2)):
                assert policy.register(reg(w, pid=pid, lo=2, hi=3), now=t).command is None
            assert not policy.tick(now=t).commands
        [cmd] = policy.tick(now=31).commands
        assert cmd.membership is not None and len(cmd.membership.members) == 2


# --- admission stands on a few workers of the job, not all of them ----------------------------


def _reference_check(p: Policy, reg: Registration) -> str:
    """The admission of a first registration as it was, against every other worker of the job
    (``MembershipRules.check`` before it took a few to stand for all): the refusal's code."""
    from marduk.core import pools

    fleet = p.fleet
    key = WorkerKey(reg.job, reg.replica, reg.worker)
    others = [k for k in fleet.job_workers.get(reg.job, ()) if k != key]
    regs = [fleet.workers[k].registration for k in others]
    try:
        if reg.rendezvous is None:
            if any(r.rendezvous is not None for r in regs):
                return "shape_mismatch"
            return ""
        pools.check(reg, regs)
        if any(r.rendezvous is None for r in regs):
            return "shape_mismatch"
        state = p.epochs.get(JOB)
        rdzv.check(
            rdzv.Candidate(key, reg.rendezvous),
            fleet.candidates(reg.job),
            state.membership if state is not None else None,
        )
    except (PolicyError, rdzv.MembershipError) as e:
        return e.code
    return ""


worker_shape = st.fixed_dictionaries(
    {
        "nproc": st.sampled_from([1, 2]),
        "hi": st.sampled_from([3, 4]),
        "rank": st.one_of(st.none(), st.integers(0, 3)),
        "spare": st.booleans(),
        "static": st.integers(0, 9),
        "stale": st.booleans(),
        "pool": st.sampled_from([None, "p", "q"]),
    }
)


def _shaped(replica: str, pid: int, w: dict) -> Registration:  # type: ignore[type-arg]
    r = reg(replica, pid=pid, nproc=w["nproc"], lo=1, hi=w["hi"], rank=w["rank"])
    if w["static"] == 0:
        return msgspec.structs.replace(r, rendezvous=None)
    assert r.rendezvous is not None
    spare = w["spare"] and w["rank"] is None
    rz_ = msgspec.structs.replace(r.rendezvous, spare=spare, pool=w["pool"])
    return msgspec.structs.replace(r, rendezvous=rz_)


@given(there=st.lists(worker_shape, max_size=7), new=worker_shape)
def test_a_first_registration_is_refused_exactly_as_against_every_worker(
    there: list[dict],
    new: dict,  # type: ignore[type-arg]
) -> None:
    p = Policy(PolicyConfig(join_timeout_s=1e9))
    for i, w in enumerate(there):
        try:
            p.register(_shaped(f"w{i}", i + 1, w), now=0)
        except PolicyError:
            continue
        if w["stale"]:
            p.fleet.stale.add(WorkerKey("j", f"w{i}", 0))
    candidate = _shaped("new", 99, new)
    expected = _reference_check(p, candidate)
    try:
        p._membership.check(candidate, p.epochs.get(JOB))
        got = ""
    except PolicyError as e:
        got = e.code
    assert got == expected


def test_first_registrations_of_a_big_job_look_at_each_worker_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each first registration used to scan every worker already there, twice (admission, and
    whether the membership forms): 1,024 of them took a second. Now the work grows with the
    job, not with its square."""
    from marduk.core.fleet import Fleet

    looked = 0
    is_candidate = Fleet.is_candidate

    def counted(self: Fleet, key: WorkerKey) -> bool:
        nonlocal looked
        looked += 1
        return is_candidate(self, key)

    monkeypatch.setattr(Fleet, "is_candidate", counted)
    n = 256
    p = Policy()
    for i in range(n):
        p.register(reg(f"n{i:04d}", pid=i + 1, lo=n, hi=n), now=0)
    assert p.epochs[JOB].membership is not None and len(p.epochs[JOB].membership.members) == n
    assert looked < 20 * n  # it was about n * n
