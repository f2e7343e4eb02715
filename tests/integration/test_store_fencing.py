"""Fencing by the store (docs/decisions.md #13), against a real nats-server.

A leader claims its term in the state bucket's ``term`` key; every write of its term carries
the key's revision in ``Nats-Expected-Last-Subject-Sequence(-Subject)`` headers, so once a
successor has claimed a later term the server refuses what the lapsed leader still sends.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS

from marduk.controller import Controller
from marduk.core.decisions import Outcome
from marduk.core.records import DeviceRecord, EpochRecord
from marduk.store.kv import BatchWriter, Fenced, WriteError
from marduk.store.state import TERM_KEY, StateStore, device_kv_key, handled_kv_key
from marduk.wire.protocol import HealthReply
from tests.conftest import NatsServer, controller_settings, eventually, start_serving
from tests.integration.test_commit_ordering import health_reply_task, register
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(60)


def device(name: str, state: str = "failed") -> DeviceRecord:
    return DeviceRecord(device=name, state=state)  # type: ignore[arg-type]


def handled(event_id: str) -> Outcome:
    return Outcome(
        handled=[HealthReply(event_id=event_id, device="dx", state="failed", known=False)]
    )


async def leader_a_and_b(a_url: str, b_url: str) -> tuple[NATS, StateStore, NATS, StateStore]:
    """Two controllers' stores, each on its own connection: A has claimed term 1 and written
    the record of device d1."""
    a_nc: NATS = await nats.connect(a_url, allow_reconnect=False)
    b_nc: NATS = await nats.connect(b_url)
    a = await StateStore.open(a_nc, "marduk")
    b = await StateStore.open(b_nc, "marduk")
    await a.claim_term(1, "a")
    await a.apply([Outcome(put_devices=[device("d1")])])
    return a_nc, a, b_nc, b


async def test_a_write_of_an_earlier_term_is_refused_by_the_server(
    nats_server: NatsServer,
) -> None:
    """Two leaders' stores on two connections: once B claims term 2, every write of A's term 1
    (put, delete, write-ahead, dedup records) is refused and nothing of it is stored; B's go
    on; A cannot claim term 1 again, nor claim below B.

    Catches: writes sent without the fence headers (blind puts), a claim made with a plain
    put, the dedup records written without (or before) the fenced state writes."""
    a_nc, a, b_nc, b = await leader_a_and_b(nats_server.url, nats_server.url)
    try:
        await a.apply([handled("ev-a1")])  # nothing for the state bucket: a probe is fenced
        assert (await b.kv.get(device_kv_key("d1"))).value is not None
        assert (await b.events.get(handled_kv_key("ev-a1"))).value is not None

        await b.claim_term(2, "b")
        with pytest.raises(Fenced):
            await a.apply([Outcome(put_devices=[device("d1", "healthy"), device("d2")])])
        with pytest.raises(Fenced):
            await a.write_ahead([EpochRecord(job="j", replica="r", ceiling=100)])
        with pytest.raises(Fenced):
            await a.apply([Outcome(deleted_devices=["d1"])])
        with pytest.raises(Fenced):
            await a.apply([handled("ev-a2")])
        stored = msgspec.json.decode((await b.kv.get(device_kv_key("d1"))).value, type=DeviceRecord)
        assert stored.state == "failed"  # A's later writes did not land
        for missing in (b.kv.get(device_kv_key("d2")), b.events.get(handled_kv_key("ev-a2"))):
            with pytest.raises(nats.js.errors.KeyNotFoundError):
                await missing

        await b.apply([Outcome(put_devices=[device("d2")]), handled("ev-b")])
        assert (await a.kv.get(device_kv_key("d2"))).value is not None
        with pytest.raises(Fenced):
            await a.claim_term(1, "a")  # a term already passed
        with pytest.raises(Fenced):
            await a.claim_term(2, "a")  # B's: a term has one leader
        await a.claim_term(3, "a")  # a later term (re-elected): A writes again, B does not
        await a.apply([Outcome(put_devices=[device("d3")])])
        with pytest.raises(Fenced):
            await b.apply([Outcome(put_devices=[device("d4")])])
        assert (await a.kv.get(TERM_KEY)).value is not None
    finally:
        await a_nc.close()
        await b_nc.close()


async def test_a_claim_retried_after_its_answer_was_lost_is_the_holders_own(
    nats_server: NatsServer,
) -> None:
    """A loaded server stores a claim whose answer comes too late: the same holder trying the
    same term again gets its own claim back (it stepped down before: "term 1 was claimed by"
    itself); anyone else, or a lower term, is still refused, and the fence holds."""
    a_nc, a, b_nc, b = await leader_a_and_b(nats_server.url, nats_server.url)
    try:
        await a.claim_term(2, "a")
        await a.claim_term(2, "a")  # the retry: no Fenced
        await a.apply([Outcome(put_devices=[device("d5")])])
        with pytest.raises(Fenced):
            await b.claim_term(2, "b")
        with pytest.raises(Fenced):
            await a.claim_term(1, "a")
        await b.claim_term(3, "b")
        with pytest.raises(Fenced):
            await a.apply([Outcome(put_devices=[device("d6")])])
    finally:
        await a_nc.close()
        await b_nc.close()


async def test_a_write_buffered_across_a_successors_claim_is_refused(
    nats_server: NatsServer,
) -> None:
    """A's connection through a proxy that holds its bytes: A's write is sent, B claims the
    next term meanwhile, the link heals and A's write reaches the server after B's claim: it
    is refused, not stored over B's. Held long enough, a batch is not acknowledged at all
    (``WriteError``, the BatchWriter's not-acknowledged path).

    Catches: blind puts (the write lands after the successor's claim)."""
    proxy = await TcpProxy(nats_server.port).start()
    a_nc, a, b_nc, b = await leader_a_and_b(proxy.url, nats_server.url)
    try:
        proxy.hold()
        late = asyncio.create_task(a.apply([Outcome(put_devices=[device("d1", "healthy")])]))
        with pytest.raises(WriteError, match="not acknowledged"):
            await BatchWriter(a_nc).write(a.kv, {"x": b"1"}, timeout=0.3)
        await b.claim_term(2, "b")
        await b.apply([Outcome(put_devices=[device("d1", "degraded")])])
        proxy.pass_()
        with pytest.raises(Fenced):
            await late
        stored = msgspec.json.decode((await b.kv.get(device_kv_key("d1"))).value, type=DeviceRecord)
        assert stored.state == "degraded"
    finally:
        await a_nc.close()
        await b_nc.close()
        await proxy.stop()


async def test_a_leader_whose_writes_are_refused_neither_answers_nor_acks(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A successor claims the next term under a leader that still believes it leads (its lease
    not lapsed yet, as with a paused or partitioned one): the leader's next decision is
    refused by the store, so it does not answer, does not acknowledge the event (it stays in
    the stream for whoever leads) and steps down.

    Catches: the ack sent after the records were given up, retrying a
    refused write until the budget runs out and then answering anyway."""
    nc: NATS = await nats.connect(nats_server.url)
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    try:
        await register(nc, "r1", ["d1"])
        assert c.store is not None and c.leadership is not None
        successor = await StateStore.open(nc, "marduk")
        await successor.claim_term(c.leadership.term + 1, "successor")
        answer = await health_reply_task(nc, "d1", "after-the-claim")
        await eventually(lambda: c.stats["store.fenced"] >= 1)
        await eventually(lambda: not c.serving.is_set())
        await asyncio.sleep(0.3)
        assert not answer.done()
        info = await nc.jetstream().consumer_info("marduk_health", "marduk-controller")
        assert info.ack_floor.stream_seq == 0  # the event is not consumed
        assert c.stats["store.given_up"] == 0  # refused once, not retried
        answer.cancel()
    finally:
        await c.stop()
        await nc.close()


async def test_a_recreated_lease_bucket_does_not_lock_every_leader_out(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The lease bucket is deleted (an operator, a botched migration) while the state bucket
    keeps its term key: lease terms start again at 1, below the stored term. The controller's
    claim is refused once, then it campaigns above the stored term and serves.

    Catches: a claim refused forever (no leader at all)."""
    nc: NATS = await nats.connect(nats_server.url)
    try:
        store = await StateStore.open(nc, "marduk")
        await store.claim_term(7, "an earlier deployment")
        c = await start_serving(Controller(controller_settings(nats_server, tmp_path)), 15.0)
        try:
            assert c.leadership is not None and c.leadership.term > 7
            assert c.stats["store.fenced"] == 1
        finally:
            await c.stop()
    finally:
        await nc.close()


async def test_a_lapsed_leaders_slowness_record_is_refused_once_a_successor_claimed(
    nats_server: NatsServer,
) -> None:
    """The devices' slowness records (their own bucket) are fenced by a term key of their own:
    once B claims term 2 there, A's write of term 1 (a read-modify-write of a count, landing
    late) is refused, so B's count is not overwritten; nobody writes unclaimed.

    Catches: records written with plain puts (a lost count in a leader race), a claim that
    does not check for a later term."""
    from marduk.store.slowness import SlownessStore
    from marduk.wire.perf import SlowDevice

    a_nc = await nats.connect(nats_server.url)
    b_nc = await nats.connect(nats_server.url)
    try:
        a = await SlownessStore.open(a_nc, "marduk")
        b = await SlownessStore.open(b_nc, "marduk")
        with pytest.raises(RuntimeError, match="no term claimed"):
            await a.put(SlowDevice(device="gpu-0", detections=1))
        await a.claim_term(1, "a")
        await a.put(SlowDevice(device="gpu-0", detections=1))
        await b.claim_term(2, "b")
        seen = await b.get("gpu-0")
        assert seen is not None and seen.detections == 1
        await b.put(SlowDevice(device="gpu-0", detections=seen.detections + 1))
        with pytest.raises(Fenced):
            await a.put(SlowDevice(device="gpu-0", detections=2))  # A's late write
        with pytest.raises(Fenced):
            await a.claim_term(2, "a")
        [only] = await b.load()  # the term key is not a record
        assert (only.device, only.detections) == ("gpu-0", 2)
    finally:
        await a_nc.close()
        await b_nc.close()
