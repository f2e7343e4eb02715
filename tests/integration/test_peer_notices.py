"""``peer_failed`` notices over a real nats-server: a controller that signs its commands, library
clients of one job; one replica's device fails, the others that asked are told, signed, once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
from nats.aio.msg import Msg

import agent
from marduk.controller import Controller, ControllerSettings
from marduk.transport import auth
from marduk.transport.credentials import Credentials
from marduk.wire.subjects import Subjects
from tests.conftest import NatsServer, eventually, health_event, start_serving

S = Subjects()


async def test_the_other_replicas_that_asked_get_one_signed_notice(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    d = tmp_path / "auth"
    auth.init(d)
    c = Controller(
        ControllerSettings(
            addr=nats_server.url,
            embedded=False,
            state_dir=tmp_path / "state",
            credentials=Credentials(nkey=d / "controller.nk"),
        )
    )
    c.credentials = Credentials()  # the server here has no auth; the controller still signs
    c.signing_seed = auth.read_seed(d / "controller.nk")
    await start_serving(c)
    key = str(d / auth.CONTROLLER_PUB)

    async def join(replica: str, notices: bool) -> agent.AsyncClient:
        return await agent.connect_async(
            replica,
            [f"{replica}-d0"],
            job="ft",
            addr=nats_server.url,
            timeout=5,
            controller_key=key,
            peer_notices=notices,
        )

    g1, g2, g4 = [await join(r, True) for r in ("g1", "g2", "g4")]
    plain = await join("g3", False)
    nc = await nats.connect(nats_server.url)
    captured: list[Msg] = []

    async def capture(msg: Msg) -> None:
        captured.append(msg)

    try:
        sub = await nc.subscribe(S.replica_commands("ft", "g1"), cb=capture)
        await health_event(nc, "g2-d0")

        # The failed replica is restarted, and told nothing else.
        own = await g2.wait(5)
        assert own is not None and (own.kind, own.epoch) == ("restart", 1)
        # The others that asked: one notice naming g2 and its epoch, verified.
        for client in (g1, g4):
            got = await client.wait(5)
            assert got is not None and got.kind == "peer_failed" and got.is_notice, got
            assert [(p.replica, p.epoch, p.kind, p.devices) for p in got.peers] == [
                ("g2", 1, "restart", ("g2-d0",))
            ]
            assert got.epoch == 0 and not client.failed and client.epoch == 0
            assert client.stats["dropped_forged"] == 0
        assert await g2.wait(0.3) is None  # no notice about itself
        assert await plain.wait(0.3) is None and plain.stats["dropped_notices.unasked"] == 0
        await eventually(lambda: len(captured) == 1)
        notice = captured[0]
        assert auth.SIG_HEADER in (notice.headers or {})
        await sub.unsubscribe()

        # A replay of the signed notice is dropped; moved to another replica, refused; unsigned,
        # refused. None of it moved an epoch.
        await nc.publish(notice.subject, notice.data, headers=notice.headers)
        await nc.publish(S.replica_commands("ft", "g4"), notice.data, headers=notice.headers)
        await nc.publish(notice.subject, notice.data)
        await nc.flush()
        await eventually(lambda: g1.stats["dropped_notices.seen"] == 1)
        await eventually(lambda: g4.stats["dropped_misdirected"] == 1)
        await eventually(lambda: g1.stats["dropped_forged"] == 1)
        assert await g1.wait(0.3) is None and await g4.wait(0.1) is None
        assert (g1.epoch, g4.epoch) == (0, 0)

        # g1's own restart still gets through (the notice fenced nothing out), and the notice
        # that goes with it reaches g2 and g4, not g1.
        await g2.ack(own)
        await health_event(nc, "g1-d0")
        mine = await g1.wait(5)
        assert mine is not None and (mine.kind, mine.epoch) == ("restart", 1)
        for client in (g2, g4):
            got = await client.wait(5)
            assert got is not None and [(p.replica, p.epoch) for p in got.peers] == [("g1", 1)]
        assert c.stats["commands.peer_failed"] == 4
    finally:
        await nc.close()
        for client in (g1, g2, g4, plain):
            await client.close()
        await c.stop()


async def test_a_replica_already_gone_causes_no_notice(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """g2 left (deregistered): a failure of its device afterwards restarts nothing, and the
    replicas still there are told nothing."""
    from tests.conftest import controller_settings

    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    g1 = await agent.connect_async(
        "g1", ["g1-d0"], job="ft", addr=nats_server.url, timeout=5, peer_notices=True
    )
    g2 = await agent.connect_async(
        "g2", ["g2-d0"], job="ft", addr=nats_server.url, timeout=5, peer_notices=True
    )
    nc = await nats.connect(nats_server.url)
    try:
        await g2.close()
        await health_event(nc, "g2-d0")
        await asyncio.sleep(0.2)
        assert await g1.wait(0.3) is None
        assert c.stats["commands.peer_failed"] == 0
    finally:
        await nc.close()
        await g1.close()
        await c.stop()
