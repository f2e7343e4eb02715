"""The controller as the job's rendezvous, against a real nats-server: it assigns node ranks,
refuses a second claim of a rank and a worker of another shape, writes the membership ahead
and keeps it across a controller restart (the store)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import nats
import pytest

from marduk.controller import Controller
from marduk.core.drmap import WorkerKey
from marduk.store.state import StateStore
from marduk.wire import protocol as wire
from marduk.wire.protocol import decode, encode
from marduk.wire.subjects import Subjects
from tests.conftest import NatsServer, controller_settings, eventually, start_serving

S = Subjects()


def registration(replica: str, pid: int, *, rank: int | None = None, nproc: int = 2) -> bytes:
    return encode(
        wire.Registration(
            job="mesh",
            replica=replica,
            host=f"host-{replica}",
            devices=[f"{replica}-d0"],
            scope="job",
            pid=pid,
            role="supervisor",
            rendezvous=wire.Rendezvous(
                nproc=nproc,
                min_nodes=2,
                max_nodes=2,
                node_rank=rank,
                addr="127.0.0.1",
                ports=[30000 + pid, 31000 + pid],
            ),
        )
    )


async def register(nc, replica: str, pid: int, **kw) -> wire.RegisterReply | wire.ErrorReply:  # type: ignore[no-untyped-def]
    msg = await nc.request(S.register("mesh"), registration(replica, pid, **kw), timeout=5)
    if b'"type":"error"' in msg.data:
        return decode(msg.data, wire.ErrorReply)
    return decode(msg.data, wire.RegisterReply)


async def commands(nc) -> asyncio.Queue[wire.Command]:  # type: ignore[no-untyped-def]
    queue: asyncio.Queue[wire.Command] = asyncio.Queue()

    async def on(msg) -> None:  # type: ignore[no-untyped-def]
        queue.put_nowait(wire.decode(msg.data, wire.Command))

    await nc.subscribe(S.job_commands("mesh"), cb=on)
    return queue


async def test_the_controller_assigns_ranks_and_refuses_duplicates_and_other_shapes(
    controller: Controller, nats_server: NatsServer
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        sent = await commands(nc)
        first = await register(nc, "a", 1)
        assert isinstance(first, wire.RegisterReply) and first.command is None  # 1 of 2
        second = await register(nc, "b", 2)
        assert isinstance(second, wire.RegisterReply) and second.command is not None
        cmd = await asyncio.wait_for(sent.get(), 5)
        assert cmd == second.command and cmd.kind == "restart" and cmd.replica is None
        m = cmd.membership
        assert m is not None and m.epoch == cmd.epoch and m.world_size == 4
        assert [(x.replica, x.node_rank, x.first_rank) for x in m.members] == [
            ("a", 0, 0),
            ("b", 1, 2),
        ]
        assert (m.coordinator_addr, m.coordinator_port) == ("127.0.0.1", 30001)

        dup = await register(nc, "c", 3, rank=1)
        assert isinstance(dup, wire.ErrorReply) and dup.code == "rank_conflict"
        assert "held by live worker b/0" in dup.message
        shape = await register(nc, "d", 4, nproc=1)
        assert isinstance(shape, wire.ErrorReply) and shape.code == "shape_mismatch"
        assert "runs 2 local rank(s) per node" in shape.message
        # The first worker converges by its next registration too (level-triggered).
        again = await register(nc, "a", 1)
        assert isinstance(again, wire.RegisterReply) and again.command == cmd
    finally:
        await nc.close()


async def test_the_membership_is_durable_before_its_command_and_survives_a_restart(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    c1 = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    nc = await nats.connect(nats_server.url)
    try:
        sent = await commands(nc)
        await register(nc, "a", 1)
        await register(nc, "b", 2)
        formed = await asyncio.wait_for(sent.get(), 5)
        assert formed.membership is not None
        # In the store by the time the command is out (written ahead with the epoch).
        store = await StateStore.open(nc, "marduk")
        loaded = await store.load()
        [record] = [e for e in loaded.epochs if e.job == "mesh"]
        assert record.membership == formed.membership
        await c1.stop()  # gone; the store holds the membership

        c2 = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
        try:
            reply = await register(nc, "b", 2)
            assert isinstance(reply, wire.RegisterReply) and reply.command is not None
            assert reply.command.membership == formed.membership
            report = wire.Report(
                job="mesh", replica="b", status="crashed", epoch=formed.epoch, exit_code=1
            )
            msg = await nc.request(S.report("mesh"), encode(report), timeout=5)
            assert decode(msg.data, wire.ReportReply).actions
            restart = await asyncio.wait_for(sent.get(), 5)
            m = restart.membership
            assert m is not None and restart.epoch > formed.epoch and m.epoch == restart.epoch
            assert [x.replica for x in m.members] == ["a", "b"]
            assert m.coordinator_port == 31001 != formed.membership.coordinator_port
        finally:
            await c2.stop()
    finally:
        await nc.close()


@pytest.mark.parametrize("join_timeout", [0.3])
async def test_min_workers_form_after_the_join_timeout(
    nats_server: NatsServer, tmp_path: Path, join_timeout: float
) -> None:
    c = await start_serving(
        Controller(controller_settings(nats_server, tmp_path, join_timeout_s=join_timeout))
    )
    nc = await nats.connect(nats_server.url)
    try:
        sent = await commands(nc)
        reg = wire.decode(registration("a", 1), wire.Registration)
        assert reg.rendezvous is not None
        lone = wire.Registration(
            **{
                **{f: getattr(reg, f) for f in reg.__struct_fields__},
                "job": "solo",
                "rendezvous": wire.Rendezvous(
                    nproc=1, min_nodes=1, max_nodes=3, addr="127.0.0.1", ports=[30500]
                ),
            }
        )
        solo: asyncio.Queue[wire.Command] = asyncio.Queue()

        async def on(msg) -> None:  # type: ignore[no-untyped-def]
            solo.put_nowait(wire.decode(msg.data, wire.Command))

        await nc.subscribe(S.job_commands("solo"), cb=on)
        await nc.request(S.register("solo"), encode(lone), timeout=5)
        cmd = await asyncio.wait_for(solo.get(), 5)
        assert cmd.membership is not None and cmd.membership.world_size == 1
        assert sent.empty()
    finally:
        await nc.close()
        await c.stop()


def elastic(replica: str, pid: int) -> bytes:
    """A worker of job ``back``, MIN 2, MAX 3 (so MIN forms only after the join timeout)."""
    reg = wire.decode(registration(replica, pid), wire.Registration)
    assert reg.rendezvous is not None
    rz = msgspec.structs.replace(reg.rendezvous, min_nodes=2, max_nodes=3)
    return encode(msgspec.structs.replace(reg, job="back", rendezvous=rz))


async def test_a_worker_back_from_stale_restarts_the_join_timeout_across_a_takeover(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """MIN were here, then b went stale before the join timeout: its return is written as a
    new arrival, so neither the leader nor a new one forms at once from the old times."""
    join = 2.0
    settings = controller_settings(
        nats_server, tmp_path, join_timeout_s=join, worker_ttl_s=0.5, worker_expiry_s=100.0
    )
    c1 = await start_serving(Controller(settings))
    nc = await nats.connect(nats_server.url)
    sent: asyncio.Queue[wire.Command] = asyncio.Queue()

    async def on(msg) -> None:  # type: ignore[no-untyped-def]
        sent.put_nowait(wire.decode(msg.data, wire.Command))

    async def renew(*names: str) -> None:
        while True:
            for name in names:
                try:
                    await nc.request(S.register("back"), elastic(name, ord(name)), timeout=1)
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    pass  # between two leaders, as an agent retries
            await asyncio.sleep(0.1)

    await nc.subscribe(S.job_commands("back"), cb=on)
    renewing = asyncio.create_task(renew("a"))
    c2: Controller | None = None
    try:
        await nc.request(S.register("back"), elastic("b", ord("b")), timeout=5)
        key = WorkerKey("back", "b", 0)
        await eventually(lambda: key in c1.policy.fleet.stale)  # b silent past the TTL
        back_at = time.time()
        msg = await nc.request(S.register("back"), elastic("b", ord("b")), timeout=5)
        assert decode(msg.data, wire.RegisterReply).command is None  # not at once
        store = await StateStore.open(nc, "marduk")
        [rec] = [w for w in (await store.load()).workers if w.registration.replica == "b"]
        assert rec.registered_at >= back_at  # the return is stored
        await c1.stop()
        renewing.cancel()
        renewing = asyncio.create_task(renew("a", "b"))
        c2 = await start_serving(Controller(settings))
        while time.time() < back_at + join - 0.3:
            assert sent.empty(), "formed before the join timeout counted from b's return"
            await asyncio.sleep(0.05)
        cmd = await asyncio.wait_for(sent.get(), 5)
        assert cmd.membership is not None and len(cmd.membership.members) == 2
        assert time.time() >= back_at + join - 0.05
    finally:
        renewing.cancel()
        await nc.close()
        if c2 is not None:
            await c2.stop()
        await c1.stop()
