"""The size of a command that carries a membership (it is sent in full, with every resend and in
every registration reply): measured at MAX_MEMBERS nodes (the most a job may have), and one that
agents would refuse as oversized is announced when it is issued (``command_oversized``), not
found at publish."""

from __future__ import annotations

import msgspec
import pytest

from marduk.core import membership as rdzv
from marduk.core.drmap import WorkerKey
from marduk.core.issuer import COMMAND_BUDGET, Issuer
from marduk.core.policy import Outcome, Policy, PolicyConfig
from marduk.core.records import EpochKey
from marduk.wire.protocol import (
    MAX_MEMBERS,
    MAX_TEXT,
    Command,
    ControllerEvent,
    Registration,
    Rendezvous,
    Report,
    decode,
    encode,
)


def registration(n: int, i: int, replica: str, addr: str) -> Registration:
    """Node ``i`` of a job of ``n`` nodes of 8 ranks whose ranks the controller assigns."""
    return Registration(
        job="llama",
        replica=replica.format(i),
        host=f"h{i}",
        devices=[f"h{i}-gpu{d}" for d in range(8)],
        scope="job",
        pid=i + 1,
        rendezvous=Rendezvous(
            nproc=8, min_nodes=n, max_nodes=n, addr=addr.format(i), ports=[40000]
        ),
    )


def formed(n: int, replica: str, addr: str) -> tuple[Policy, Command, Outcome]:
    """A job of ``n`` nodes of 8 ranks whose ranks the controller assigns, formed at MAX."""
    p = Policy(PolicyConfig(worker_ttl_s=1000, worker_expiry_s=10_000))
    out = Outcome()
    for i in range(n):
        out = p.register(registration(n, i, replica, addr), now=i / 1000).outcome
    [cmd] = out.commands
    assert cmd.membership is not None and len(cmd.membership.members) == n
    return p, cmd, out


def test_a_membership_of_max_members_with_usual_names_fits_with_room() -> None:
    """About 105 bytes a member (a pod name and an IPv4 address): 1,024 nodes, the most a job
    may have, are about 107 KB, under half the cap agents read. 4,096 cannot be asked for."""
    r = Rendezvous(nproc=8, min_nodes=1, max_nodes=MAX_MEMBERS, addr="", ports=[40000])
    candidates = [
        rdzv.Candidate(
            WorkerKey("llama", f"llama-70b-{i:05d}", 0),
            msgspec.structs.replace(r, addr=f"10.0.{i // 256}.{i % 256}"),
            float(i),
        )
        for i in range(MAX_MEMBERS)
    ]
    m = rdzv.form(123_456, candidates)
    assert m is not None and len(m.members) == MAX_MEMBERS
    reason = f"membership formed: {MAX_MEMBERS} node(s), world size {m.world_size}, ..."
    cmd = Command(
        command_id="llama/*/123456",
        job="llama",
        replica=None,
        scope="job",
        kind="restart",
        epoch=123_456,
        reason=reason,
        event_id="rendezvous",
        issued_at=1.8e9,
        membership=m,
    )
    size = len(encode(cmd))
    assert 90_000 < size < 120_000 and size < COMMAND_BUDGET / 2
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"nproc": 8, "min_nodes": 1, "max_nodes": 4096, "addr": "h"}, Rendezvous)


def test_a_command_agents_would_refuse_is_announced_when_issued_not_at_publish() -> None:
    """The backstop behind admission (``membership_too_large``): 620 nodes with replica names
    as long as the wire allows (128 characters) fit while their addresses are short; admitted,
    they are never refused, and each comes back with an address of 256 characters (a new pod
    under its name). The next restart renews the membership with those and encodes past the
    budget: the policy says so, once, with the size, the budget and what to shorten (the
    resends are the same bytes)."""
    p, first, _ = formed(620, "r{:04d}" + "x" * 123, "10.0.{}.1")
    for i in range(620):
        reg = registration(620, i, "r{:04d}" + "x" * 123, "node-{:04d}." + "a" * 246)
        assert p.register(reg, now=1.0).result == "updated"  # never refused once admitted
    assert first.membership is not None
    for m in first.membership.members:  # the first restart is confirmed: the next is new
        p.on_report(
            Report(job="llama", replica=m.replica, status="running", epoch=first.epoch), 1.5
        )
    crash = Report(job="llama", replica=m.replica, status="crashed", epoch=first.epoch)
    out = p.on_report(crash, now=2.0).outcome
    [cmd] = out.commands
    size = len(encode(cmd))
    assert size > COMMAND_BUDGET
    [event] = [e for e in out.events if e.kind == "command_oversized"]
    assert event.job == "llama" and event.epoch == cmd.epoch
    assert f"{size} bytes" in event.detail and f"{COMMAND_BUDGET}" in event.detail
    assert "620 node(s)" in event.detail and "--local-addr" in event.detail
    resend = p.tick(now=3.0)
    assert resend.resent == [cmd] and "command_oversized" not in {e.kind for e in resend.events}


def test_a_reason_longer_than_the_wire_allows_is_clipped_so_agents_can_read_the_command() -> None:
    """A reason that lists workers or devices grows with the job: past the wire's text limit
    the agents would refuse the whole command. The Issuer clips it and says how much it cut."""
    p, _, _ = formed(4, "r{}", "10.0.{}.1")
    issuer = Issuer(p.fleet)
    long = "lost " + ", ".join(f"worker-{i:05d}/0" for i in range(1000))
    assert len(long) > MAX_TEXT
    out = Outcome()
    cmd = issuer.issue(EpochKey("llama", None), "restart", long, [], "", 5.0, out)
    assert len(cmd.reason) <= MAX_TEXT and cmd.reason.startswith("lost worker-00000/0")
    assert cmd.reason.endswith(f"({len(long) - MAX_TEXT + 64} more characters)")
    assert decode(encode(cmd), Command) == cmd  # what an agent does with it


def test_an_event_detail_longer_than_the_wire_allows_is_clipped_for_the_monitors() -> None:
    """``marduk monitor watch`` decodes every event: one detail past the limit would be
    refused whole (a grow or a loss naming a thousand workers)."""
    long = ", ".join(f"worker-{i:05d}/0" for i in range(1000))
    event = ControllerEvent(kind="grow_started", ts=1.0, job="llama", detail=long)
    assert len(event.detail) <= MAX_TEXT
    assert decode(encode(event), ControllerEvent) == event
