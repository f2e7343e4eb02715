"""Pools of hot spares, pure (marduk/core/pools.py): a job's lost member takes a free spare of
its pool when none of its own fits; the claim is written ahead, survives a restore, is given to
one job only, and ends when the job lets go of the worker (never back to the pool)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from marduk.core import membership as rdzv
from marduk.core.drmap import WorkerKey
from marduk.core.policy import Policy, PolicyConfig, PolicyError
from marduk.core.records import EpochKey, EpochRecord, WorkerRecord
from marduk.wire.protocol import Command, DeviceHealth, Registration, Rendezvous, Report

POOL = "pool-a"


def reg(
    job: str,
    replica: str,
    *,
    pid: int,
    spare: bool = False,
    pool: str | None = POOL,
    nproc: int = 2,
    devices: int = 1,
) -> Registration:
    return Registration(
        job=job,
        replica=replica,
        host=replica,
        devices=[f"{replica}-d{i}" for i in range(devices)],
        scope="job",
        pid=pid,
        rendezvous=Rendezvous(
            nproc=nproc,
            min_nodes=1,
            max_nodes=2,
            addr=f"10.0.0.{pid}",
            ports=[40000 + pid],
            spare=spare,
            pool=pool,
        ),
    )


def spare(replica: str, *, pid: int, **kw) -> Registration:
    return reg(POOL, replica, pid=pid, spare=True, **kw)


def ranks(cmd: Command | None) -> list[tuple[str, int, int]]:
    assert cmd is not None and cmd.membership is not None
    return [(m.replica, m.node_rank, m.first_rank) for m in cmd.membership.members]


def form(p: Policy, job: str, names: tuple[str, str], pid: int) -> Command:
    p.register(reg(job, names[0], pid=pid), now=0)
    cmd = p.register(reg(job, names[1], pid=pid + 1), now=0).command
    assert cmd is not None and cmd.membership is not None
    for w in names:
        p.on_report(Report(job=job, replica=w, status="running", epoch=cmd.epoch), now=1)
    return cmd


def two_jobs(config: PolicyConfig | None = None) -> Policy:
    p = Policy(config or PolicyConfig(device_max_failures=0, worker_ttl_s=100))
    form(p, "ja", ("a0", "a1"), 1)
    form(p, "jb", ("b0", "b1"), 11)
    return p


def fail(device: str) -> DeviceHealth:
    return DeviceHealth(device=device, state="failed", event_id=f"e-{device}", reason="ecc")


def test_a_pool_forms_nothing_and_status_shows_its_free_spares() -> None:
    p = two_jobs()
    r = p.register(spare("s0", pid=30), now=2)
    assert r.result == "new" and not r.outcome.commands and r.claimed_by is None
    p.register(spare("s1", pid=31), now=2)
    assert p.epochs[EpochKey(POOL, None)].membership is None
    [pool] = p.job_infos(3, POOL)
    assert pool.is_pool and pool.spares == ["s0/0", "s1/0"] and pool.claimed == []
    [ja] = p.job_infos(3, "ja")
    assert ja.pool == POOL and not ja.is_pool
    # A free spare's device failing restarts nothing (it runs nothing); it is no longer free.
    r = p.on_health(fail("s1-d0"), now=4)
    assert not r.outcome.commands
    stopping = Report(job=POOL, replica="s0", status="preempted", epoch=0)
    assert not p.on_report(stopping, now=4).outcome.commands
    [pool] = p.job_infos(5, POOL)
    assert pool.spares == ["s0/0", "s1/0 (unusable: device s1-d0 failed)"]


def test_a_lost_member_takes_a_pool_spare_at_its_ranks_and_the_spare_moves_to_the_job() -> None:
    p = two_jobs()
    p.register(spare("s0", pid=30), now=2)
    before = p.epochs[EpochKey("ja", None)].membership
    r = p.on_health(fail("a1-d0"), now=3)
    [cmd] = r.outcome.commands
    assert ranks(cmd) == [("a0", 0, 0), ("s0", 1, 2)]
    assert before is not None and cmd.membership is not None
    assert cmd.membership.world_size == before.world_size
    state = p.epochs[EpochKey("ja", None)]
    assert [(c.pool, c.replica) for c in state.claims] == [(POOL, "s0")]
    assert state in r.outcome.write_ahead  # the claim is durable before the command goes out
    assert WorkerKey(POOL, "s0", 0) in r.outcome.deleted_workers
    assert WorkerKey("ja", "s0", 0) in p.workers and WorkerKey(POOL, "s0", 0) not in p.workers
    assert "spare_claimed" in {e.kind for e in r.outcome.events}
    assert p.awaiting(EpochKey("ja", None)) == {WorkerKey("ja", "a0", 0), WorkerKey("ja", "s0", 0)}
    # Still registered under the pool, the spare is told where it belongs now.
    told = p.register(spare("s0", pid=30), now=4)
    assert told.claimed_by == "ja" and not told.outcome.put_workers
    # Registered under the job, it has the membership that names it.
    there = p.register(reg("ja", "s0", pid=30, spare=True), now=5)
    assert there.command == cmd and there.claimed_by is None
    [pool] = p.job_infos(6, POOL)
    assert pool.spares == [] and pool.claimed == ["s0/0 by ja"]
    [ja] = p.job_infos(6, "ja")
    assert ja.claimed == ["s0/0"] and ja.holding == ["s0/0"]
    # Job jb, drawing from the same pool, was not touched.
    assert p.epochs[EpochKey("jb", None)].claims == []


def test_the_jobs_own_spare_comes_first() -> None:
    p = two_jobs()
    p.register(spare("s0", pid=30), now=2)
    p.register(reg("ja", "own", pid=40, spare=True), now=2)
    [cmd] = p.on_health(fail("a0-d0"), now=3).outcome.commands
    assert ranks(cmd) == [("own", 0, 0), ("a1", 1, 2)]
    assert p.epochs[EpochKey("ja", None)].claims == [] and WorkerKey(POOL, "s0", 0) in p.workers


def test_two_jobs_losing_a_member_in_one_tick_share_the_last_spare_once() -> None:
    p = two_jobs(PolicyConfig(worker_ttl_s=10))
    p.register(spare("s0", pid=30), now=5)
    for job, w, pid in (("ja", "a0", 1), ("jb", "b0", 11)):
        p.register(reg(job, w, pid=pid), now=9)
    p.register(spare("s0", pid=30), now=9)
    out = p.tick(now=13)  # a1 and b1 last heard at 1: both lost in one tick
    by_job = {c.job: c for c in out.commands}
    assert set(by_job) == {"ja", "jb"}
    got = [job for job, c in by_job.items() if c.membership and len(c.membership.members) == 2]
    assert len(got) == 1  # one job has the spare, the other shrank
    other = ({"ja", "jb"} - set(got)).pop()
    assert len(by_job[other].membership.members) == 1  # type: ignore[union-attr]
    claims = [c for j in ("ja", "jb") for c in p.epochs[EpochKey(j, None)].claims]
    assert len(claims) == 1


@pytest.mark.parametrize("shape", [{"nproc": 1}, {"devices": 2}])
def test_a_pool_spare_of_another_shape_is_never_claimed(shape: dict[str, int]) -> None:
    p = two_jobs()
    p.register(spare("odd", pid=30, **shape), now=2)
    [cmd] = p.on_health(fail("a1-d0"), now=3).outcome.commands
    assert ranks(cmd) == [("a0", 0, 0)]  # shrank
    assert WorkerKey(POOL, "odd", 0) in p.workers


def test_a_claimed_spare_that_never_arrives_is_replaced_and_never_goes_back_to_the_pool() -> None:
    p = two_jobs(PolicyConfig(device_max_failures=0, worker_ttl_s=10, worker_expiry_s=20))
    p.register(spare("s0", pid=30), now=2)
    p.on_health(fail("a1-d0"), now=3)
    p.register(reg("ja", "a0", pid=1), now=12)
    out = p.tick(now=14)  # s0 claimed at 3, silent since: lost like any member
    [cmd] = [c for c in out.commands if c.job == "ja"]
    assert ranks(cmd) == [("a0", 0, 0)]
    assert p.workers[WorkerKey("ja", "s0", 0)].retired
    for t in (20, 30, 40):
        p.register(reg("ja", "a0", pid=1), now=t)
        p.register(reg("jb", "b0", pid=11), now=t)
        p.register(reg("jb", "b1", pid=12), now=t)
        p.tick(now=t)
    assert WorkerKey("ja", "s0", 0) not in p.workers  # expired: the claim ends
    assert p.epochs[EpochKey("ja", None)].claims == []
    assert WorkerKey(POOL, "s0", 0) not in p.workers  # not given back to the pool


def test_a_new_leader_finishes_a_claim_written_ahead_but_not_its_move() -> None:
    p = two_jobs()
    p.register(spare("s0", pid=30), now=2)
    workers_before = [_copy(w) for w in p.workers.values()]  # s0 still in the pool
    [cmd] = p.on_health(fail("a1-d0"), now=3).outcome.commands
    epochs = [_copy(e) for e in p.epochs.values()]  # written ahead; the leader dies now
    q = Policy.restore(PolicyConfig(device_max_failures=0), workers_before, epochs, [], now=4)
    assert WorkerKey("ja", "s0", 0) in q.workers and WorkerKey(POOL, "s0", 0) not in q.workers
    assert q.register(spare("s0", pid=30), now=5).claimed_by == "ja"
    there = q.register(reg("ja", "s0", pid=30, spare=True), now=5)
    assert there.command == cmd
    # jb loses a member: the pool has nothing free for it.
    [shrink] = q.on_health(fail("b1-d0"), now=6).outcome.commands
    assert ranks(shrink) == [("b0", 0, 0)]
    # The new leader's first tick saves the move.
    out = q.tick(now=7)
    assert WorkerKey(POOL, "s0", 0) in out.deleted_workers
    assert any(
        w.registration.job == "ja" and w.registration.replica == "s0" for w in out.put_workers
    )


@pytest.mark.parametrize(
    ("first", "second", "code"),
    [
        (spare("s0", pid=30), reg(POOL, "w", pid=1), "invalid"),  # a job's worker under a pool
        (reg("ja", "a0", pid=1), reg("ja", "s9", pid=9, spare=True, pool="ja"), "shape_mismatch"),
        (reg("ja", "a0", pid=1), reg("ja", "a1", pid=2, pool="other"), "shape_mismatch"),
    ],
)
def test_a_pool_and_a_job_do_not_mix(first: Registration, second: Registration, code: str) -> None:
    p = Policy()
    p.register(first, now=0)
    with pytest.raises(PolicyError) as e:
        p.register(second, now=1)
    assert e.value.code == code


def _copy(x: WorkerRecord | EpochRecord):  # as the store gives it back
    return msgspec.json.decode(msgspec.json.encode(x), type=type(x))


def test_the_metrics_show_each_pools_free_and_claimed_spares() -> None:
    from marduk.controller.telemetry import gauges

    p = two_jobs()
    p.register(spare("s0", pid=30), now=2)
    p.register(spare("s1", pid=31), now=2)
    p.on_health(fail("a1-d0"), now=3)
    got = {
        m.name: {tuple(s.labels.values()): s.value for s in m.samples}
        for m in gauges(True, p, lambda: 0)
    }
    assert got["marduk_pool_spares_free"] == {(POOL,): 1.0}
    assert got["marduk_pool_spares_claimed"] == {(POOL, "ja"): 1.0}
    assert POOL not in {k[0] for k in got["marduk_job_nodes"]}


def test_a_drained_pool_spare_restarts_nothing_and_is_not_claimed() -> None:
    p = two_jobs()
    p.register(spare("s0", pid=30), now=2)
    assert not p.drain(["s0-d0"], "", False, "bad host", now=3).outcome.commands
    [cmd] = p.on_health(fail("a1-d0"), now=4).outcome.commands
    assert ranks(cmd) == [("a0", 0, 0)]


def test_a_pool_spare_keeps_a_job_at_min_instead_of_holding_it() -> None:
    p = Policy(PolicyConfig(device_max_failures=0))
    for w, pid in (("a0", 1), ("a1", 2)):
        r = reg("ja", w, pid=pid)
        assert r.rendezvous is not None
        p.register(msgspec.structs.replace(r, rendezvous=_nodes(r.rendezvous, 2)), now=0)
    p.register(spare("s0", pid=30), now=1)
    [cmd] = p.on_health(fail("a0-d0"), now=2).outcome.commands
    assert ranks(cmd) == [("s0", 0, 0), ("a1", 1, 2)]  # not held: MIN 2 kept


def test_a_pool_spare_named_like_a_worker_of_the_job_is_not_claimed() -> None:
    p = two_jobs()
    p.register(spare("a0", pid=30), now=2)  # pool spare "a0": ja has an a0 already
    [cmd] = p.on_health(fail("a1-d0"), now=3).outcome.commands
    assert ranks(cmd) == [("a0", 0, 0)] and WorkerKey(POOL, "a0", 0) in p.workers


def test_forgetting_the_job_ends_the_claim_and_the_spare_stays_out_of_the_pool() -> None:
    p = two_jobs()
    p.register(spare("s0", pid=30), now=2)
    p.on_health(fail("a1-d0"), now=3)
    out = p.forget("ja", None, None, now=4)
    assert p.epochs[EpochKey("ja", None)] in out.put_epochs
    assert p.epochs[EpochKey("ja", None)].claims == []
    assert p.job_infos(5, POOL) == []  # nothing free, nothing claimed: no pool to show
    # Its agent, moved to ja, registers there again: ja's worker (a spare), not the pool's.
    p.register(reg("ja", "s0", pid=30, spare=True), now=6)
    assert WorkerKey("ja", "s0", 0) in p.workers and WorkerKey(POOL, "s0", 0) not in p.workers


def _nodes(r: Rendezvous, lo: int) -> Rendezvous:
    return msgspec.structs.replace(r, min_nodes=lo)


@given(
    n=st.integers(1, 6),
    lost=st.sets(st.integers(0, 5)),
    own=st.lists(st.integers(1, 2), max_size=3),
    pool=st.lists(st.tuples(st.integers(1, 2), st.integers(1, 2)), max_size=4),
)
def test_with_a_pool_no_rank_is_given_twice_and_shapes_fit(
    n: int, lost: set[int], own: list[int], pool: list[tuple[int, int]]
) -> None:
    def cand(name: str, at: float, nproc: int = 2, spare: bool = False, devices: int = 0):
        r = Rendezvous(nproc=nproc, min_nodes=1, max_nodes=6, addr="h", spare=spare)
        return rdzv.Candidate(WorkerKey("j", name, 0), r, at, devices)

    members = [cand(f"m{i}", i) for i in range(n)]
    m = rdzv.form(1, members)
    assert m is not None
    spares = [cand(f"s{i}", 10 + i, p, True) for i, p in enumerate(own)]
    pooled = [cand(f"p{i}", 20 + i, p, True, d) for i, (p, d) in enumerate(pool)]
    gone = {WorkerKey("j", f"m{i}", 0) for i in lost if i < n}
    sizes = dict.fromkeys(gone, 1)  # every member had one device
    change = rdzv.replace(m, 2, "j", gone, [*members, *spares], 1, pooled, sizes)
    new = change.membership
    if new is None:
        return
    names = [x.replica for x in new.members]
    assert len(set(names)) == len(names) and not {f"m{i}" for i in lost} & set(names)
    flat = [r for x in new.members for r in range(x.first_rank, x.first_rank + x.nproc)]
    assert flat == list(range(new.world_size))
    for _, c in change.replaced:
        assert c.rendezvous.nproc == 2 and c.devices in (0, 1)
    # The job's own spares first: a pool spare only once no own spare of the shape is left.
    used_pool = [c for _, c in change.replaced if c.key.replica.startswith("p")]
    free_own = [s for s in spares if s.rendezvous.nproc == 2 and s.key.replica not in names]
    assert not (used_pool and free_own)


def test_a_held_job_claims_a_pool_spare_to_form_again_and_one_spare_serves_one_job() -> None:
    """Two jobs of MIN 2 held after losing a member with no spare free; a pool spare that
    registers later (of their shape) brings one of them back to MIN once the join timeout has
    run since it registered (as for a worker of the job's own), claimed and written ahead with the membership as in a swap; the other
    job stays held (a spare of another shape is never claimed)."""
    p = Policy(PolicyConfig(device_max_failures=0, join_timeout_s=5, worker_ttl_s=100))
    for job, names, pid in (("ja", ("a0", "a1"), 1), ("jb", ("b0", "b1"), 11)):
        for i, w in enumerate(names):
            r = reg(job, w, pid=pid + i)
            assert r.rendezvous is not None
            p.register(msgspec.structs.replace(r, rendezvous=_nodes(r.rendezvous, 2)), now=0)
        cmd = p.epochs[EpochKey(job, None)].command
        assert cmd is not None and cmd.membership is not None
        for w in names:
            p.on_report(Report(job=job, replica=w, status="running", epoch=cmd.epoch), now=1)
    for device in ("a0-d0", "b0-d0"):
        [held] = p.on_health(fail(device), now=2).outcome.commands
        assert held.membership is None
    p.register(spare("odd", pid=29, nproc=1), now=3)
    p.register(spare("big", pid=28, devices=2), now=3)
    p.register(spare("s0", pid=30), now=3)
    assert not p.tick(now=7).commands  # the join timeout runs from MIN here (s0, at 3)
    out = p.tick(now=8)
    [cmd] = out.commands
    job = cmd.job
    state = p.epochs[EpochKey(job, None)]
    first = {"ja": "a1", "jb": "b1"}[job]
    assert ranks(cmd) == [(first, 0, 0), ("s0", 1, 2)]
    assert [(c.pool, c.replica) for c in state.claims] == [(POOL, "s0")]
    assert state in out.write_ahead  # the claim is durable with the membership
    assert WorkerKey(job, "s0", 0) in p.workers and WorkerKey(POOL, "s0", 0) not in p.workers
    assert {"spare_claimed", "membership_formed"} <= {e.kind for e in out.events}
    other = ({"ja", "jb"} - {job}).pop()
    assert p.epochs[EpochKey(other, None)].membership is None
    assert p.epochs[EpochKey(other, None)].claims == []
    assert not p.tick(now=20).commands  # odd and big stay in the pool
    [pool] = p.job_infos(21, POOL)
    assert sorted(pool.spares) == ["big/0", "odd/0"] and pool.claimed == [f"s0/0 by {job}"]


def held_ja(p: Policy) -> None:
    """Job ``ja`` (MIN 2) of a0, a1 formed at 0, held at 2: a0's device spent, no spare."""
    for i, w in enumerate(("a0", "a1")):
        r = reg("ja", w, pid=1 + i)
        assert r.rendezvous is not None
        p.register(msgspec.structs.replace(r, rendezvous=_nodes(r.rendezvous, 2)), now=0)
    [held] = p.on_health(fail("a0-d0"), now=2).outcome.commands
    assert held.membership is None


def test_a_new_leader_watches_held_jobs_for_pool_spares() -> None:
    """A pool spare's registration forms nothing by itself: a new leader must look at the held
    jobs it read from the store on its ticks, as the leader that held them did."""
    p = Policy(PolicyConfig(device_max_failures=0, join_timeout_s=5, worker_ttl_s=100))
    held_ja(p)

    def again(rec):  # type: ignore[no-untyped-def]
        return msgspec.json.decode(msgspec.json.encode(rec), type=type(rec))

    q = Policy.restore(
        PolicyConfig(device_max_failures=0, join_timeout_s=5, worker_ttl_s=100),
        [again(w) for w in p.workers.values()],
        [again(e) for e in p.epochs.values()],
        list(p.devices.values()),
        now=3,
    )
    q.register(spare("s0", pid=30), now=4)
    assert not q.tick(now=8).commands
    [cmd] = q.tick(now=9).commands
    assert ranks(cmd) == [("a1", 0, 0), ("s0", 1, 2)]
    assert [c.replica for c in q.epochs[EpochKey("ja", None)].claims] == ["s0"]


@pytest.mark.parametrize("new_leader", [False, True])
def test_a_held_job_with_none_of_its_workers_left_forms_again_from_pool_spares(
    new_leader: bool,
) -> None:
    """Held below MIN, then its last worker gone too (expired): the job's epoch record keeps
    its pool and shape, so free spares of the pool still bring it back to MIN (on a new leader
    too, which has nothing of the job but that record)."""
    cfg = PolicyConfig(device_max_failures=0, join_timeout_s=5, worker_ttl_s=10, worker_expiry_s=20)
    p = Policy(cfg)
    held_ja(p)
    p.tick(now=25)  # a0 (retired) and a1 silent past the expiry: gone
    assert not p.fleet.job_workers.get("ja")
    [info] = p.job_infos(now=25, job="ja")  # status still shows the held job
    assert (info.nodes, info.min_nodes, info.max_nodes, info.pool) == (0, 2, 2, "pool-a")
    if new_leader:

        def again(rec):  # type: ignore[no-untyped-def]
            return msgspec.json.decode(msgspec.json.encode(rec), type=type(rec))

        p = Policy.restore(cfg, [], [again(e) for e in p.epochs.values()], [], now=26)
    p.register(spare("odd", pid=29, nproc=1), now=27)  # another shape: never claimed
    p.register(spare("s0", pid=30), now=27)
    assert not p.tick(now=33).commands  # one spare: still below MIN 2
    p.register(spare("s1", pid=31), now=33)
    for t in (34, 37):
        for s, pid in (("s0", 30), ("s1", 31), ("odd", 29)):
            p.register(spare(s, pid=pid, **({"nproc": 1} if s == "odd" else {})), now=t)
        assert not p.tick(now=t).commands
    out = p.tick(now=38)  # the join timeout from MIN here (s1, at 33)
    [cmd] = out.commands
    assert cmd.job == "ja" and ranks(cmd) == [("s0", 0, 0), ("s1", 1, 2)]
    state = p.epochs[EpochKey("ja", None)]
    assert sorted(c.replica for c in state.claims) == ["s0", "s1"] and state in out.write_ahead
    assert p.fleet.nnodes("ja") == (2, 2)  # the job's MIN:MAX, not the spares' --nnodes
