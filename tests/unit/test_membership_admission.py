"""Admission by size: a worker whose entry could make its job's membership command exceed
``COMMAND_BUDGET`` is refused at its first registration (``membership_too_large``), before the
job forms a membership no agent could read; workers already registered are never refused nor
evicted. The bound (``command_size``) is exact for the entries and conservative by at most
``FRAME_RESERVE`` for the rest of the command."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marduk.core.command_size import FRAME_RESERVE, MembershipSizes
from marduk.core.drmap import WorkerKey
from marduk.core.issuer import COMMAND_BUDGET
from marduk.core.policy import Policy, PolicyConfig, PolicyError
from marduk.wire.protocol import (
    MAX_MEMBERS,
    Member,
    Membership,
    Registration,
    Rendezvous,
    encode,
)

# Entries of about 245 bytes (a 24-character replica name, a 147-character address): 1,023 of
# them leave room for one of about 120 bytes under the budget, not for another like them.
PAD = "x" * 121


def reg(
    i: int,
    replica: str = "",
    addr: str = "",
    *,
    spare: bool = False,
    n: int = MAX_MEMBERS,
    job: str = "llama",
    pool: str | None = None,
) -> Registration:
    replica = replica or f"llama-405b-pretrain-{i:04d}"
    return Registration(
        job=job,
        replica=replica,
        host=f"h{i}",
        devices=[f"h{i}-gpu{d}" for d in range(8)],
        scope="job",
        pid=i + 1,
        rendezvous=Rendezvous(
            nproc=8,
            min_nodes=n,
            max_nodes=n,
            addr=addr or f"{replica}.{PAD}",
            ports=[40000],
            spare=spare,
            pool=pool,
        ),
    )


def almost_full(pool: str | None = None) -> Policy:
    """1,023 workers of a 1,024-node job with long names, admitted."""
    p = Policy(PolicyConfig(worker_ttl_s=1000, worker_expiry_s=10_000, device_max_failures=0))
    for i in range(MAX_MEMBERS - 1):
        assert p.register(reg(i, pool=pool), now=i / 1000).result == "new"
    return p


def refused(p: Policy, r: Registration) -> str:
    with pytest.raises(PolicyError) as e:
        p.register(r, now=5.0)
    assert e.value.code == "membership_too_large"
    assert WorkerKey(r.job, r.replica, r.worker) not in p.workers  # a refusal leaves no trace
    return str(e.value)


def test_the_worker_that_would_tip_a_1024_node_job_is_refused_and_a_shorter_one_admitted() -> None:
    p = almost_full()
    message = refused(p, reg(1023))
    assert "1024 node(s)" in message and f"over the {COMMAND_BUDGET}-byte budget" in message
    assert "bytes" in message.split("could encode to ")[1]
    assert "shorten the replica names" in message and "--local-addr" in message
    assert "(this one's is 24 characters)" in message and "--local-addr (146)" in message

    formed = p.register(reg(1023, "n1023", "10.0.3.255"), now=6.0)
    [cmd] = formed.outcome.commands
    assert cmd.membership is not None and len(cmd.membership.members) == MAX_MEMBERS
    assert len(encode(cmd)) <= COMMAND_BUDGET
    assert "command_oversized" not in {e.kind for e in formed.outcome.events}


def test_admitted_workers_are_never_refused_for_the_size() -> None:
    """Renewals, and an admitted worker back with a longer address (a new pod under its name),
    are admitted: only a first registration is checked. The backstop (``command_oversized``)
    speaks for what that makes (tests/unit/test_command_size.py)."""
    p = almost_full()
    p.register(reg(1023, "n1023", "10.0.3.255"), now=6.0)
    for i in range(MAX_MEMBERS - 1):
        assert p.register(reg(i), now=7.0).result == "unchanged"
    longer = reg(5, addr="node-5." + "a" * 240)
    assert p.register(longer, now=8.0).result == "updated"
    assert len(p.workers) == MAX_MEMBERS


def test_a_spare_that_would_overflow_the_membership_when_it_swaps_in_is_refused() -> None:
    """A spare (``--spare``, or a worker beyond MAX) may take any member's place: one whose
    entry is larger than the room the smallest member would leave is refused; one no larger is
    admitted, and takes a lost member's ranks in a command that still fits."""
    p = almost_full()
    p.register(reg(1023, "n1023", "10.0.3.255"), now=6.0)
    assert "1024 node(s)" in refused(p, reg(2000, spare=True))
    refused(p, reg(2001))  # beyond MAX: a spare too
    assert p.register(reg(2002, "s2002", "10.0.7.210", spare=True), now=7.0).result == "new"
    swap = p.drain(["h7-gpu0"], "", False, "bad node", now=8.0).outcome
    [cmd] = swap.commands
    assert cmd.membership is not None
    assert cmd.membership.members[7].replica == "s2002"
    assert len(encode(cmd)) <= COMMAND_BUDGET
    assert "command_oversized" not in {e.kind for e in swap.events}


def test_a_pool_spare_too_large_for_the_job_is_skipped_when_a_member_is_lost() -> None:
    """A pool's spare is admitted by its pool (which forms nothing), so it is reckoned when a
    job would claim it: the oldest free one, too large, is skipped with an event; the next,
    small enough, takes the lost member's ranks in a command that fits."""
    p = almost_full(pool="gpus")
    p.register(reg(1023, "n1023", "10.0.3.255", pool="gpus"), now=6.0)
    big = reg(3000, addr="x" * 256, spare=True, job="gpus", pool="gpus")
    small = reg(3001, "s3001", "10.0.11.185", spare=True, job="gpus", pool="gpus")
    assert p.register(big, now=7.0).result == "new"  # the pool admits it
    assert p.register(small, now=7.5).result == "new"
    swap = p.drain(["h7-gpu0"], "", False, "bad node", now=8.0).outcome
    [cmd] = swap.commands
    assert cmd.membership is not None and cmd.membership.members[7].replica == "s3001"
    assert len(encode(cmd)) <= COMMAND_BUDGET
    [skipped] = [e for e in swap.events if e.kind == "spare_skipped"]
    assert skipped.job == "llama" and skipped.replica == big.replica
    assert f"{COMMAND_BUDGET}-byte budget" in skipped.detail and "1024 node(s)" in skipped.detail
    assert "command_oversized" not in {e.kind for e in swap.events}


def test_a_member_that_left_keeps_its_entry_while_the_membership_lists_it() -> None:
    """It keeps its node rank in every restart (``membership.renew``) until a membership
    without it is issued; a new leader counts the members it reads the same way."""
    sizes = MembershipSizes()
    r = Rendezvous(nproc=2, min_nodes=1, max_nodes=3, addr="a" * 200)
    keys = [WorkerKey("j", f"w{i}", 0) for i in range(3)]
    for k in keys:
        sizes.put(k, r)
    m = Membership(
        epoch=1,
        world_size=6,
        coordinator_addr=r.addr,
        coordinator_port=1,
        members=[
            Member(replica=k.replica, node_rank=i, first_rank=2 * i, nproc=2, addr=r.addr)
            for i, k in enumerate(keys)
        ],
    )
    sizes.settle("j", m)
    new = WorkerKey("j", "new", 0)
    full = sizes.bound(new, r, max_nodes=4)
    sizes.remove(keys[0])
    assert sizes.bound(new, r, max_nodes=4) == full  # still listed
    sizes.settle("j", Membership(**{**_fields(m), "epoch": 2, "members": m.members[1:]}))
    assert sizes.bound(new, r, max_nodes=4).size < full.size

    restored = MembershipSizes()  # a new leader: w0 is gone, the membership lists it
    for k in keys[1:]:
        restored.put(k, r)
    restored.settle("j", m)
    assert restored.bound(new, r, max_nodes=4) == full


def test_a_job_gone_leaves_no_entries_behind() -> None:
    """Its members keep their entries while its epoch record (and membership) stays; once the
    record is dropped, nothing of the job is kept."""
    p = Policy(PolicyConfig(worker_ttl_s=1000, worker_expiry_s=10_000, epoch_retention_s=60))
    for i in range(2):
        p.register(reg(i, n=2), now=0.0)
    probe = reg(9, n=2).rendezvous
    assert probe is not None
    for i in range(2):
        p.deregister(WorkerKey("llama", reg(i).replica, 0), "done", now=1.0)
    assert p.fleet.sizes.bound(WorkerKey("llama", "new", 0), probe, 2).nodes == 2  # listed
    p.tick(now=100.0)
    assert p.fleet.sizes.bound(WorkerKey("llama", "new", 0), probe, 2).nodes == 1


def _fields(m: Membership) -> dict[str, object]:
    return {f: getattr(m, f) for f in m.__struct_fields__}


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    nproc=st.sampled_from([1, 3, 8, 128]),
    names=st.lists(st.integers(1, 128), min_size=40, max_size=40),
    addrs=st.lists(st.integers(0, 256), min_size=40, max_size=40),
)
def test_the_bound_holds_the_forming_command_within_the_reserve(
    n: int, nproc: int, names: list[int], addrs: list[int]
) -> None:
    """The bound before the last worker registers is never below the command that forms the
    membership, and above it by no more than the reserve (the entries, their commas and the
    digits of their ranks are exact)."""
    p = Policy(PolicyConfig(worker_ttl_s=1000, worker_expiry_s=10_000))
    regs = []
    for i in range(n):
        replica = f"r{i}".ljust(names[i], "x")
        r = Rendezvous(nproc=nproc, min_nodes=n, max_nodes=n, addr="é" * addrs[i], ports=[1])
        regs.append(
            Registration(
                job="j", replica=replica, devices=[f"d{i}"], scope="job", pid=i + 1, rendezvous=r
            )
        )
    for r in regs[:-1]:
        p.register(r, now=0.0)
    last = regs[-1]
    assert last.rendezvous is not None
    bound = p.fleet.sizes.bound(WorkerKey("j", last.replica, 0), last.rendezvous, n)
    [cmd] = p.register(last, now=1.0).outcome.commands
    size = len(encode(cmd))
    assert bound.nodes == n and size <= bound.size <= size + FRAME_RESERVE + 64
