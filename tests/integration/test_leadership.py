"""Leadership and takeover, pinned down: each test kills a hand-made mutant that once survived the suite.

A fake clock (``time.monotonic`` as ``marduk.controller.leadership`` sees it) and a real lease bucket: two
candidates racing for an expired lease, two for an absent one, the key overwritten under a
leader, a renewal whose reply is slow, an election whose reply is slow, a standby whose mirror is behind at election, an event stored before the first
consumer exists, a batch decided before the lease lapsed and committed after. Each test names
the mutant it kills; each was checked by applying that mutant by hand.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from marduk.controller import Controller
from marduk.controller import leadership as leadership_module
from marduk.controller.commit import CommitPipeline, NotServing, Steps
from marduk.controller.leadership import KEY, Leadership
from marduk.core.decisions import Outcome
from marduk.core.lease import FENCE
from marduk.core.records import EpochRecord
from marduk.store.health_stream import HealthConsumer, ensure_stream
from marduk.store.mirror import StateMirror
from marduk.store.state import StateStore
from marduk.wire.protocol import Command
from marduk.wire.subjects import Subjects
from tests.conftest import NatsServer, controller_settings, eventually, start_serving, store_health
from tests.integration.test_commit_ordering import health_reply_task, register
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(30)

TTL = 2.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(leadership_module.time, "monotonic", c)
    return c


def answer_late(kv: Any, method: str, clock: Clock, late: float) -> None:
    """``kv.<method>`` answers ``late`` seconds (of the fake clock) after it was sent: a slow
    server, a full socket."""
    call = getattr(kv, method)

    async def answered_late(*args: Any, **kw: Any) -> Any:
        result = await call(*args, **kw)
        clock.now += late
        return result

    setattr(kv, method, answered_late)


class Candidate:
    def __init__(self, nc: NATS, name: str) -> None:
        self.elected: list[int] = []
        self.deposed: list[str] = []

        async def on_elected(term: int) -> None:
            self.elected.append(term)

        async def on_deposed(why: str) -> None:
            self.deposed.append(why)

        self.lead = Leadership(
            nc, "marduk", name, ttl=TTL, on_elected=on_elected, on_deposed=on_deposed
        )


async def candidates(url: str, *names: str) -> tuple[list[NATS], list[Candidate]]:
    conns = [await nats.connect(url) for _ in names]
    out = [Candidate(nc, name) for nc, name in zip(conns, names, strict=True)]
    for c in out:
        await c.lead.open()
    return conns, out


async def close(conns: list[NATS]) -> None:
    for nc in conns:
        await nc.close()


async def test_two_candidates_racing_for_an_expired_lease_one_wins(
    nats_server: NatsServer, clock: Clock
) -> None:
    """The holder stops renewing; two standbys saw the same revision, a TTL passes on their
    clocks, and both campaign at once: exactly one takes the lease.

    Kills: the lease taken with a plain put instead of compare-and-set."""
    conns, (old, a, b) = await candidates(nats_server.url, "old", "a", "b")
    try:
        await old.lead._campaign()
        assert old.elected == [1]
        for c in (a, b):
            await c.lead._campaign()  # observe the holder's revision
            assert not c.elected
        clock.now += TTL
        await asyncio.gather(a.lead._campaign(), b.lead._campaign())
        assert sorted(a.elected + b.elected) == [2]
        assert a.lead.is_leader != b.lead.is_leader
        winner = a if a.lead.is_leader else b
        stored = await winner.lead.kv.get(KEY)  # type: ignore[union-attr]
        assert stored.value and winner.lead.holder.encode() in stored.value
    finally:
        await close(conns)


async def test_two_candidates_campaigning_at_once_on_an_empty_bucket_one_wins(
    nats_server: NatsServer, clock: Clock
) -> None:
    """No lease key yet (a fresh deployment, or the holder resigned): two candidates both read
    it absent before either writes, then both claim term 1: exactly one is elected.

    Kills: the absent lease taken with a plain put instead of a create (both elected at 1)."""
    conns, (a, b) = await candidates(nats_server.url, "a", "b")
    both_read = asyncio.Barrier(2)
    try:
        for c in (a, b):
            kv: Any = c.lead.kv
            get = kv.get

            async def read_then_wait(*args: Any, _get: Any = get, _kv: Any = kv, **kw: Any) -> Any:
                _kv.get = _get  # once: a create that meets the key reads it again
                try:
                    return await _get(*args, **kw)
                finally:
                    await both_read.wait()

            kv.get = read_then_wait
        await asyncio.gather(a.lead._campaign(), b.lead._campaign())
        assert sorted(a.elected + b.elected) == [1]
        assert a.lead.is_leader != b.lead.is_leader
        winner = a if a.lead.is_leader else b
        stored = await winner.lead.kv.get(KEY)  # type: ignore[union-attr]
        assert stored.revision == winner.lead._revision
        assert stored.value and winner.lead.holder.encode() in stored.value
    finally:
        await close(conns)


async def test_a_leader_whose_lease_key_was_overwritten_steps_down(
    nats_server: NatsServer, clock: Clock
) -> None:
    """Someone else wrote the lease under the leader (a standby that took it over while the
    leader was paused): the leader's next renewal fails its compare-and-set and it steps down,
    rather than adopting the new revision as if it were its own renewal.

    Kills: a failed renewal compare-and-set adopting whoever holds the lease."""
    conns, (a, b) = await candidates(nats_server.url, "a", "b")
    try:
        await a.lead._campaign()
        assert a.lead.is_leader
        await b.lead._campaign()
        clock.now += TTL
        await b.lead._campaign()  # a's renewals "lost": b takes it over
        assert b.lead.is_leader and b.lead.term == 2
        await a.lead._renew()
        assert not a.lead.is_leader and a.deposed
        assert not a.lead.serving()
    finally:
        await close(conns)


async def test_the_fence_is_three_quarters_of_the_ttl_counted_from_the_renewals_send(
    nats_server: NatsServer, clock: Clock
) -> None:
    """A renewal whose reply takes half a TTL (a slow server, a full socket): the leader's fence
    counts from when it *sent* it, because a standby's TTL may count from when it was stored;
    and it ends at FENCE (0.75) x TTL, leaving a quarter TTL between the leader stopping and
    anyone taking over.

    Kills: the fence at 1.0 x TTL; the fence counted from the renewal's reply."""
    assert FENCE == 0.75
    conns, (a,) = await candidates(nats_server.url, "a")
    try:
        await a.lead._campaign()
        assert a.lead.is_leader
        answer_late(a.lead.kv, "update", clock, TTL / 2)
        clock.now += 0.1
        sent = clock.now
        await a.lead._renew()
        assert a.lead.is_leader and a.lead.renew_failures == 0
        clock.now = sent + FENCE * TTL - 0.01
        assert a.lead.serving()
        clock.now = sent + FENCE * TTL + 0.01
        assert not a.lead.serving()  # under 1.0 x TTL, and counted from the send
        clock.now = sent + 0.9 * TTL
        assert not a.lead.serving()
    finally:
        await close(conns)


async def test_the_fence_of_an_election_counts_from_the_claim_s_send(
    nats_server: NatsServer, clock: Clock
) -> None:
    """An election whose claim is answered half a TTL after it was sent: the new leader's
    fence counts from the send, as a renewal's does (a standby that saw the claim stored
    starts its TTL then), so it ends FENCE x TTL after the send, not after the reply.

    Kills: the election's fence counted from the create's reply instead of its send."""
    conns, (a,) = await candidates(nats_server.url, "a")
    try:
        answer_late(a.lead.kv, "create", clock, TTL / 2)
        sent = clock.now
        await a.lead._campaign()
        assert a.elected == [1] and clock.now == sent + TTL / 2
        clock.now = sent + FENCE * TTL - 0.01
        assert a.lead.serving()
        clock.now = sent + FENCE * TTL + 0.01
        assert not a.lead.serving()
    finally:
        await close(conns)


async def test_a_standby_whose_mirror_is_behind_at_election_waits_for_it(
    nats_server: NatsServer,
) -> None:
    """The standby's mirror reads through a link that holds its bytes (the mirror is behind
    the bucket): ``caught_up`` must not say it has seen the old leader's last writes until it
    has; once the link passes, it does and the records are there.

    Kills: ``caught_up`` returning without waiting for the mirror."""
    proxy = await TcpProxy(nats_server.port).start()
    writer: NATS = await nats.connect(nats_server.url)
    behind: NATS = await nats.connect(proxy.url)
    try:
        store = await StateStore.open(behind, "marduk")
        mirror = StateMirror(store)
        await mirror.start()
        old = await StateStore.open(writer, "marduk")
        proxy.hold()
        await old.write_ahead([EpochRecord(job="j", replica="r1", epoch=7, ceiling=107)])
        assert not await mirror.caught_up(writer.jetstream(), stall=0.5)
        assert not mirror.snapshot().epochs
        proxy.pass_()
        assert await mirror.caught_up(writer.jetstream(), stall=2.0)
        [epoch] = mirror.snapshot().epochs
        assert epoch.ceiling == 107
        await mirror.stop()
    finally:
        await proxy.stop()
        await writer.close()
        await behind.close()


async def test_an_event_stored_before_the_first_consumer_exists_is_delivered(
    nats_server: NatsServer,
) -> None:
    """A monitor's event lands while no controller ever ran (no consumer yet): the first
    leader's consumer delivers it.

    Kills: the health consumer delivering only new messages (DeliverPolicy.NEW)."""
    nc: NATS = await nats.connect(nats_server.url)
    try:
        s = Subjects()
        await ensure_stream(nc, s.prefix, s.health)
        await store_health(nc, b'{"v":1,"device":"d1","state":"failed"}')
        got: asyncio.Queue[Msg] = asyncio.Queue()

        async def on_msg(msg: Msg) -> None:
            await got.put(msg)

        consumer = HealthConsumer(nc, s.prefix, s.health)
        await consumer.start(on_msg)
        msg = await asyncio.wait_for(got.get(), 5.0)
        assert b"d1" in msg.data
        await consumer.stop()
    finally:
        await nc.close()


async def test_a_batch_is_fenced_before_it_goes_out_even_without_a_new_ceiling() -> None:
    """A batch decided while leading, committed after the lease lapsed, that needs no new
    ceiling (most restarts: the block is reserved): nothing of it is published.

    Kills: the commit pipeline's first fence of a batch removed."""
    published: list[Outcome] = []
    stopped: list[str] = []

    async def write_ahead(records: list[EpochRecord]) -> bool:
        return True

    async def publish(o: Outcome) -> None:
        published.append(o)

    async def nothing(o: Any) -> None:
        return None

    pipeline = CommitPipeline(
        Steps(
            leading=lambda: False,
            write_ahead=write_ahead,
            publish=publish,
            persist=nothing,
            announce=nothing,
            stop=lambda counter, why: stopped.append(counter),
        )
    )
    command = Command(
        command_id="j/r1/2", job="j", replica="r1", scope="replica", kind="restart", epoch=2
    )
    commit = pipeline.submit(Outcome(commands=[command]))
    with pytest.raises(NotServing):
        await commit.published
    assert not published and stopped == ["fenced"]


async def test_a_step_down_decided_in_one_term_does_not_end_a_later_one(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A step-down decided in term N (a slow drain, a refused write) that runs once the
    controller was deposed and re-elected (term N+1) neither stops serving nor resigns the
    new term's lease.

    Kills: a step-down not tied to its term."""
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    try:
        lead = c.leadership
        assert lead is not None and lead.kv is not None
        old = lead.term
        await lead._depose("test: as if a renewal had failed")
        await eventually(lambda: lead.term == old + 1 and c.serving.is_set())
        await c.takeover.step_down("decided in the earlier term", old)
        assert c.serving.is_set() and lead.is_leader
        assert (await lead.kv.get(KEY)).revision == lead._revision  # not resigned
        await c.takeover.step_down("decided in this term", lead.term)
        assert not c.serving.is_set() and not lead.is_leader
    finally:
        await c.stop()


async def test_a_standby_takes_over_at_once_from_a_holder_whose_connection_closed(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The leader's connection closes (as when its process is SIGKILLed: the server drops its
    subscriptions): its liveness subject gets "no responders" and the standby takes over long
    before the lease TTL (10 s here). A leader whose link only stalls (connection up, bytes
    held) still answers in the server's eyes (the probe times out): no early takeover.

    Kills: taking over on a timeout (a slow leader) as if it were gone; not probing at all."""
    proxy = await TcpProxy(nats_server.port).start()
    first = controller_settings(nats_server, tmp_path / "a")
    first.addr, first.lease_ttl = proxy.url, 10.0
    leader = await start_serving(Controller(first))
    second = controller_settings(nats_server, tmp_path / "b")
    second.lease_ttl = 10.0
    standby = Controller(second)
    await standby.start()
    try:
        lead = standby.leadership
        assert lead is not None
        await eventually(lambda: lead.lease is not None and lead.lease.holder != lead.holder)
        proxy.hold()
        await asyncio.sleep(1.5)  # probes time out: the holder may be alive
        assert not standby.serving.is_set() and lead.early_takeovers == 0
        proxy.drop(refuse=True)  # its connection closes, as at a SIGKILL
        await eventually(lambda: standby.serving.is_set(), timeout=5.0)  # TTL is 10 s
        assert lead.early_takeovers == 1 and lead.term == 2
    finally:
        await proxy.stop()
        await standby.stop()
        await leader.stop()


async def test_events_a_dead_leader_never_acked_are_delivered_at_once_to_its_successor(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The leader is delivered an event, but what it sends (records, ack) never leaves (held),
    then its connection closes, as at a SIGKILL. The standby, taking over at once, gets that
    event now, not after ``ack_wait`` (30 s here): the consumer is made again from its ack
    floor. A standby taking over from a holder that might be alive (the TTL path) does not.

    Kills: an early takeover leaving the dead leader's unacknowledged events to ack_wait."""
    proxy = await TcpProxy(nats_server.port).start()
    nc: NATS = await nats.connect(nats_server.url)
    settings = []
    for name in ("a", "b"):
        s = controller_settings(nats_server, tmp_path / name)
        s.lease_ttl, s.ack_wait_s = 10.0, 30.0
        settings.append(s)
    settings[0].addr = proxy.url
    leader = await start_serving(Controller(settings[0]))
    standby = Controller(settings[1])
    await standby.start()
    try:
        await register(nc, "r1", ["d1"])
        lead = standby.leadership
        assert lead is not None
        await eventually(lambda: lead.lease is not None and lead.lease.holder != lead.holder)
        proxy.hold(down=False)  # it hears the event; nothing it sends arrives
        answer = await health_reply_task(nc, "d1", "in-flight-at-the-kill")
        await eventually(lambda: leader.stats["received.devicehealth"] >= 1)
        proxy.drop(refuse=True)
        await eventually(lambda: standby.serving.is_set(), timeout=5.0)
        reply = msgspec.json.decode(await asyncio.wait_for(answer, 10.0))
        assert reply["actions"] and reply["actions"][0]["replica"] == "r1"
        assert standby.health is not None and standby.health.replayed_from == 1
    finally:
        await proxy.stop()
        await standby.stop()
        await leader.stop()
        await nc.close()
