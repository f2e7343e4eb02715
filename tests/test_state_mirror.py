"""The hot standby's state mirror and the batched store writes, against a real nats-server."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig
from nats.js.errors import InvalidKeyError, KeyNotFoundError

from marduk.decisions import Outcome
from marduk.drmap import WorkerKey
from marduk.protocol import HealthReply, Registration
from marduk.records import DeviceRecord, EpochKey, EpochRecord, WorkerRecord
from marduk.store import BatchWriter, StateMirror, StateStore, WriteError, device_kv_key
from tests.conftest import NatsServer, eventually

pytestmark = pytest.mark.timeout(30)


def worker(replica: str, devices: list[str]) -> WorkerRecord:
    reg = Registration(job="j", replica=replica, devices=devices, pid=1, host="h", incarnation=0)
    return WorkerRecord(registration=reg, registered_at=1.0, updated_at=1.0)


def as_set(loaded_records: list[object]) -> set[bytes]:
    import msgspec

    return {msgspec.json.encode(r) for r in loaded_records}


async def test_a_mirror_holds_what_a_full_read_of_the_bucket_finds(
    nats_server: NatsServer,
) -> None:
    nc: NATS = await nats.connect(nats_server.url)
    try:
        store = await StateStore.open(nc, "m")
        # Written before the mirror starts (a fresh controller's replay) and after (a watch).
        await store.apply([Outcome(put_workers=[worker("r1", ["d1"]), worker("r2", ["d2"])])])
        mirror = StateMirror(store)
        await mirror.start()
        await store.write_ahead([EpochRecord(job="j", replica="r1", ceiling=100)])
        later = Outcome(
            put_workers=[worker("r3", ["d3"])],
            deleted_workers=[WorkerKey("j", "r2", 0)],
            put_epochs=[EpochRecord(job="j", replica="r1", epoch=1, ceiling=100)],
            put_devices=[DeviceRecord(device="d1", state="failed")],
            handled=[HealthReply(event_id="e1", device="d1", state="failed", known=True)],
        )
        await store.apply([later])
        await store.kv.put(device_kv_key("bad"), b"{not json")  # unreadable: skipped, counted
        assert await mirror.caught_up(nc.jetstream())
        full, mirrored = await store.load(), mirror.snapshot()
        assert as_set(mirrored.workers) == as_set(full.workers)
        assert {w.registration.replica for w in mirrored.workers} == {"r1", "r3"}
        assert as_set(mirrored.epochs) == as_set(full.epochs)
        assert [e.epoch for e in mirrored.epochs] == [1]
        assert as_set(mirrored.devices) == as_set(full.devices)
        assert mirrored.skipped == full.skipped == 1
        assert [h.event_id for h in await store.load_handled()] == ["e1"]
        # A record made readable again is no longer counted as skipped.
        await store.apply([Outcome(put_devices=[DeviceRecord(device="bad")])])
        await eventually(lambda: mirror.snapshot().skipped == 0)
        await mirror.stop()
        assert not await mirror.caught_up(nc.jetstream())  # a stopped mirror is not used
    finally:
        await nc.close()


async def test_batched_writes_keep_the_last_decision_per_key(nats_server: NatsServer) -> None:
    """Outcomes written together: where two write one key, the later decision wins (a put
    then a delete deletes; a delete then a put puts), whatever order the writes land in."""
    nc: NATS = await nats.connect(nats_server.url)
    try:
        store = await StateStore.open(nc, "b")
        r1, r2 = WorkerKey("j", "r1", 0), WorkerKey("j", "r2", 0)
        await store.apply([Outcome(put_workers=[worker("r2", ["d2"])])])
        many = [Outcome(put_workers=[worker(f"x{i}", [f"dx{i}"])]) for i in range(300)]
        await store.apply(
            [
                Outcome(put_workers=[worker("r1", ["d1"])]),
                Outcome(deleted_workers=[r2]),
                *many,
                Outcome(deleted_workers=[r1]),
                Outcome(put_workers=[worker("r2", ["d9"])]),
                Outcome(put_epochs=[EpochRecord(job="j", replica="r2", epoch=3, ceiling=9)]),
                Outcome(deleted_epochs=[EpochKey("j", "r2")]),
            ]
        )
        loaded = await store.load()
        replicas = {w.registration.replica: w.registration.devices for w in loaded.workers}
        assert "r1" not in replicas and replicas["r2"] == ["d9"] and len(replicas) == 301
        assert not loaded.epochs
    finally:
        await nc.close()


async def test_a_refused_write_in_a_batch_is_an_error(nats_server: NatsServer) -> None:
    """The server's refusal of one write of a batch (here: a value over the bucket's limit)
    reaches the caller, which retries or steps down; the others are made."""
    nc: NATS = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        kv = await js.create_key_value(KeyValueConfig(bucket="small", max_value_size=64))
        write_many = BatchWriter(nc).write
        with pytest.raises(WriteError, match="1 of 3 writes refused"):
            await write_many(kv, {"a": b"1", "b": b"x" * 100, "c": b"3"})
        assert (await kv.get("a")).value == b"1" and (await kv.get("c")).value == b"3"
        await write_many(kv, {"a": None, "c": b"4"})
        with pytest.raises(KeyNotFoundError):
            await kv.get("a")
        assert (await kv.get("c")).value == b"4"
        with pytest.raises(InvalidKeyError):
            await write_many(kv, {"no spaces": b"1"})
        # Batches in flight at once are told apart (one subscription for all of them).
        many = [{f"k{b}.{i}": b"%d" % b for i in range(50)} for b in range(20)]
        await asyncio.gather(*(write_many(kv, w) for w in many))
        assert (await kv.get("k7.49")).value == b"7"
    finally:
        await nc.close()
