"""The controller shell against a real nats-server: routing, bad input, persistence."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats
import pytest

from agent.library.client import AsyncClient, connect_async
from marduk.controller import Controller
from marduk.wire import protocol as wire
from marduk.wire.protocol import decode, encode
from marduk.wire.subjects import Subjects
from tests.conftest import (
    NatsServer,
    controller_settings,
    eventually,
    health_event,
    health_raw,
    start_serving,
)

S = Subjects()


async def agent(server: NatsServer, replica: str, devices: list[str], **kw: object) -> AsyncClient:
    return await connect_async(replica, devices, addr=server.url, timeout=10, **kw)  # type: ignore[arg-type]


async def health(nc, device: str, state: str = "failed", event_id: str = "") -> wire.HealthReply:  # type: ignore[no-untyped-def]
    return await health_event(nc, device, state, event_id)  # type: ignore[no-any-return]


async def drain_commands(client: AsyncClient) -> list[tuple[str, int]]:
    out = []
    while (c := await client.wait(0.3)) is not None:
        out.append((c.kind, c.epoch))
    return out


async def test_failure_reaches_exactly_the_affected_replicas(
    controller: Controller, nats_server: NatsServer
) -> None:
    r1 = await agent(nats_server, "r1", ["d1", "d2"])
    r2 = await agent(nats_server, "r2", ["d2", "d3"])
    nc = await nats.connect(nats_server.url)
    try:
        reply = await health(nc, "d3")
        assert reply.known and [(a.replica, a.epoch) for a in reply.actions] == [("r2", 1)]
        assert await drain_commands(r2) == [("restart", 1)]
        assert await drain_commands(r1) == []
        assert r2.failed and not r1.failed
        assert await r2.ack() is True
        assert not r2.failed and not r2.errors

        reply = await health(nc, "d2")
        assert sorted(a.replica or "" for a in reply.actions) == ["r1", "r2"]
        assert await drain_commands(r1) == [("restart", 1)]
        assert await drain_commands(r2) == [("restart", 2)]

        reply = await health(nc, "nope")
        assert not reply.known and not reply.actions
        assert await drain_commands(r1) == [] and await drain_commands(r2) == []
    finally:
        await nc.close()
        await r1.close()
        await r2.close()


async def test_event_storm_yields_one_command_per_replica(
    controller: Controller, nats_server: NatsServer
) -> None:
    r1 = await agent(nats_server, "r1", ["d1", "d2"])
    r2 = await agent(nats_server, "r2", ["d2"])
    nc = await nats.connect(nats_server.url)
    try:
        for i in range(100):
            await nc.publish(
                S.health,
                encode(wire.DeviceHealth(device="d2", state="failed", event_id=f"storm-{i % 40}")),
            )
        await nc.flush()
        await eventually(lambda: controller.stats["received.devicehealth"] >= 100)
        assert await drain_commands(r1) == [("restart", 1)]
        assert await drain_commands(r2) == [("restart", 1)]
        assert controller.stats["health.duplicates"] == 60
    finally:
        await nc.close()
        await r1.close()
        await r2.close()


async def test_job_scope_sends_one_command_every_replica_receives(
    controller: Controller, nats_server: NatsServer
) -> None:
    agents = [
        await agent(nats_server, f"r{i}", [f"dev{i}-{w}"], worker=w, scope="job", job="mesh")
        for i in range(2)
        for w in range(2)
    ]
    nc = await nats.connect(nats_server.url)
    try:
        reply = await health(nc, "dev1-0")
        assert [(a.job, a.replica, a.epoch) for a in reply.actions] == [("mesh", None, 1)]
        for a in agents:
            assert await drain_commands(a) == [("restart", 1)]
        assert controller.stats["commands.restart"] == 1
    finally:
        await nc.close()
        for a in agents:
            await a.close()


async def test_scope_conflict_is_a_clear_error(
    controller: Controller, nats_server: NatsServer
) -> None:
    a = await agent(nats_server, "r1", ["d1"], scope="job")
    from agent.library.client import AgentError

    with pytest.raises(AgentError, match="scope_conflict"):
        await agent(nats_server, "r2", ["d2"], scope="replica")
    await a.close()
    assert controller.stats["rejected.scope_conflict"] == 1


BAD_INPUTS = [
    (S.health, b"{not json", "malformed"),
    (S.health, b"", "empty"),
    (S.health, b'{"device": 42, "state": "failed"}', "invalid"),
    (S.health, b'{"device": "d1", "state": "exploded"}', "invalid"),
    (S.health, b'{"device": "has space", "state": "failed"}', "invalid"),
    (S.health, b'{"type": "register", "device": "d1", "state": "failed"}', "invalid"),
    (S.health, b'{"v": 2, "device": "d1", "state": "failed"}', "version"),
    (S.health, b"[1, 2, 3]", "invalid"),
    (
        S.health,
        b'{"device": "d1", "state": "failed", "pad": "' + b"x" * 300_000 + b'"}',
        "oversized",
    ),
    (S.register("j"), b'{"job": "j", "replica": "r.1", "devices": []}', "invalid"),
    (S.register("j"), b'{"job": "other", "replica": "r1", "devices": []}', "subject_mismatch"),
    (S.register("j"), b'{"job": "j", "replica": "r1", "worker": -1, "devices": []}', "invalid"),
    (S.query, b'{"what": "everything"}', "invalid"),
    (S.deregister("j"), b"null", "invalid"),
]


def short_id(value: object) -> str | None:
    """A 300 kB payload as its size: pytest puts the test's id in PYTEST_CURRENT_TEST, and an
    environment string that long cannot be handed to a child process (E2BIG, nats-server)."""
    return f"{len(value)}-bytes" if isinstance(value, bytes) and len(value) > 80 else None


@pytest.mark.parametrize(("subject", "payload", "code"), BAD_INPUTS, ids=short_id)
async def test_bad_input_gets_an_error_reply_and_a_counter(
    controller: Controller, nats_server: NatsServer, subject: str, payload: bytes, code: str
) -> None:
    r1 = await agent(nats_server, "r1", ["d1"])
    nc = await nats.connect(nats_server.url)
    try:
        if subject == S.health:  # durable: the answer comes to the Marduk-Reply-To subject
            data = await health_raw(nc, payload)
        else:
            data = (await nc.request(subject, payload, timeout=5)).data
        reply = decode(data, wire.ErrorReply)
        assert reply.code == code and reply.message
        assert controller.stats[f"rejected.{code}"] == 1
        # Still serving, nothing lost: the map is intact and a real event works.
        ok = await health(nc, "d1")
        assert [a.replica for a in ok.actions] == ["r1"]
        assert await drain_commands(r1) == [("restart", 1)]
    finally:
        await nc.close()
        await r1.close()


# Not JSON, whatever its first value (issue 24: each was answered `invalid`), and, for
# contrast, JSON of the wrong shape.
NOT_JSON = [
    b'[},]\\:[, {}"{"]null...',
    b"null x",
    b'"abc" garbage',
    b"[" * 2_000 + b"x",  # nested past the decoder's limit before the bad byte
    b'{"device":' + b"[" * 2_000 + b"x",
]
WRONG_SHAPE = [b"null", b'"abc"', b"[1, 2]"]


async def test_not_json_is_malformed_on_every_subject_whatever_its_first_value(
    controller: Controller, nats_server: NatsServer
) -> None:
    """The syntax check comes first (docs/protocol.md, *Strict edge*), on the health stream and
    on every request subject the leader serves, as NATS micro lists them."""
    nc = await nats.connect(nats_server.url)
    try:
        info = json.loads((await nc.request("$SRV.INFO.marduk", b"", timeout=5)).data)
        subjects = [e["subject"].replace(".*.", ".j.") for e in info["endpoints"]]
        assert len(subjects) >= 7, subjects
        sent = 0
        for payload, code in [(p, "malformed") for p in NOT_JSON] + [
            (p, "invalid") for p in WRONG_SHAPE
        ]:
            for subject in [S.health, *subjects]:
                if subject == S.health:
                    data = await health_raw(nc, payload)
                else:
                    data = (await nc.request(subject, payload, timeout=5)).data
                reply = decode(data, wire.ErrorReply)
                assert reply.code == code, (subject, payload[:30], reply.message)
                sent += 1
        assert controller.stats["rejected.malformed"] == len(NOT_JSON) * (1 + len(subjects))
        assert controller.stats["rejected"] == sent
    finally:
        await nc.close()


async def test_bad_input_without_reply_is_counted(
    controller: Controller, nats_server: NatsServer
) -> None:
    nc = await nats.connect(nats_server.url)
    await nc.publish(S.health, b"garbage")
    await nc.publish(S.ack("j"), b'{"job": "j"}')
    await nc.flush()
    await eventually(lambda: controller.stats["rejected"] == 2)
    await nc.close()


async def test_plain_publish_from_any_client_is_acted_on(
    controller: Controller, nats_server: NatsServer
) -> None:
    """A monitor in another language publishes minimal JSON, no reply inbox, no type/v/id."""
    r1 = await agent(nats_server, "r1", ["GPU-1234"])
    nc = await nats.connect(nats_server.url)
    await nc.publish(
        "marduk.health",
        json.dumps({"device": "GPU-1234", "state": "failed", "reason": "XID 79"}).encode(),
    )
    await nc.flush()
    c = await r1.wait(5)
    assert c is not None and c.kind == "restart" and c.devices == ("GPU-1234",)
    assert "XID 79" in c.reason
    await nc.close()
    await r1.close()


async def test_query_lists_map_and_devices(controller: Controller, nats_server: NatsServer) -> None:
    r1 = await agent(nats_server, "r1", ["d1", "d2"], job="a")
    r2 = await agent(nats_server, "r2", ["d2"], job="b")
    nc = await nats.connect(nats_server.url)
    try:
        msg = await nc.request(S.query, encode(wire.Query(what="map")), timeout=5)
        reply = decode(msg.data, wire.QueryReply)
        assert [(w.job, w.replica, w.devices) for w in reply.workers] == [
            ("a", "r1", ["d1", "d2"]),
            ("b", "r2", ["d2"]),
        ]
        d2 = next(d for d in reply.devices if d.device == "d2")
        assert d2.replicas == ["a/r1", "b/r2"]
        msg = await nc.request(S.query, encode(wire.Query(what="map", job="b")), timeout=5)
        assert [w.replica for w in decode(msg.data, wire.QueryReply).workers] == ["r2"]
    finally:
        await nc.close()
        await r1.close()
        await r2.close()


async def test_deregister_on_close(controller: Controller, nats_server: NatsServer) -> None:
    r1 = await agent(nats_server, "r1", ["d1"])
    assert controller.policy.drmap.has_device("d1")
    await r1.close()
    await r1.close()  # twice is fine
    assert not controller.policy.drmap.has_device("d1")


async def test_state_survives_a_controller_restart(nats_server: NatsServer, tmp_path: Path) -> None:
    c1 = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    r1 = await agent(nats_server, "r1", ["d1", "d2"])
    r2 = await agent(nats_server, "r2", ["d2", "d3"])
    nc = await nats.connect(nats_server.url)
    try:
        await health(nc, "d3")
        assert await drain_commands(r2) == [("restart", 1)]
        await c1.stop()  # gone: as if killed; the store holds the state

        c2 = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
        assert c2.policy.drmap == c1.policy.drmap
        assert await r2.ack() is True
        assert not c2.policy.awaiting(("default", "r2"))  # type: ignore[arg-type]
        reply = await health(nc, "d3")
        # No epoch reuse: the new controller issues above the reserved ceiling.
        [action] = reply.actions
        assert action.replica == "r2" and action.epoch > c1.policy.epochs[("default", "r2")].ceiling  # type: ignore[index]
        assert await drain_commands(r2) == [("restart", action.epoch)]
        assert await drain_commands(r1) == []
        await c2.stop()
    finally:
        await nc.close()
        await r1.close(deregister=False)
        await r2.close(deregister=False)


async def test_agent_that_missed_a_command_converges_on_reregistration(
    controller: Controller, nats_server: NatsServer
) -> None:
    r1 = await agent(nats_server, "r1", ["d1"])
    assert r1._nc is not None
    for sub in list(r1._nc._subs.values()):  # lose the command subscription, as in a partition
        if ".cmd." in sub.subject:
            await sub.unsubscribe()
    nc = await nats.connect(nats_server.url)
    await health(nc, "d1")
    assert await r1.wait(0.3) is None
    await r1.reregister()
    c = await r1.wait(2)
    assert c is not None and (c.kind, c.epoch) == ("restart", 1)
    assert r1.stats["converged"] == 1
    await nc.close()
    await r1.close()


async def test_stale_and_duplicate_commands_are_dropped(
    controller: Controller, nats_server: NatsServer
) -> None:
    r1 = await agent(nats_server, "r1", ["d1"])
    nc = await nats.connect(nats_server.url)
    subject = S.replica_commands("default", "r1")

    def cmd(epoch: int) -> bytes:
        return encode(
            wire.Command(
                command_id=f"x{epoch}", job="default", replica="r1", kind="restart", epoch=epoch
            )
        )

    for epoch in (3, 3, 2, 4, 1):
        await nc.publish(subject, cmd(epoch))
    await nc.publish(subject, b"junk")
    await nc.flush()
    assert await drain_commands(r1) == [("restart", 3), ("restart", 4)]
    assert r1.stats["dropped_stale"] == 3 and r1.stats["bad_commands"] == 1
    assert r1.errors
    await nc.close()
    await r1.close()


@pytest.mark.parametrize("failure", ["handled", "unexpected"])
async def test_startup_failure_still_stops_the_embedded_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Whatever ends the controller, its embedded nats-server does not outlive it."""
    import asyncio

    from marduk.controller import ControllerSettings, run_controller
    from marduk.controller import shell as controller_module
    from tests.conftest import free_port

    started: list[object] = []
    original_start = controller_module.EmbeddedServer.start

    def spy_start(self, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
        original_start(self, timeout)
        started.append(self.proc)

    def boom(*args: object, **kw: object) -> object:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(controller_module.EmbeddedServer, "start", spy_start)
    if failure == "handled":  # wrapped into StartupError: exit code 1
        monkeypatch.setattr(controller_module.StateStore, "open", boom)
    else:  # a bug while taking over: fatal (exit 1), after cleanup
        monkeypatch.setattr(controller_module.Policy, "from_records", boom)
    settings = ControllerSettings(addr=f"nats://127.0.0.1:{free_port()}", state_dir=tmp_path)
    assert await run_controller(settings, asyncio.Event()) == 1
    [proc] = started
    assert proc.poll() is not None  # type: ignore[attr-defined]


async def test_a_refused_registration_leaves_no_phantom_worker(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A registration refused as `invalid` (an epoch far beyond the scope)
    once left the worker 'heard from': a worker TTL later every tick raised KeyError
    (errors.internal) and announced worker_expired for a worker that never registered."""
    c = await start_serving(
        Controller(
            controller_settings(nats_server, tmp_path, worker_ttl_s=0.3, worker_expiry_s=0.6)
        )
    )
    nc = await nats.connect(nats_server.url)
    try:
        events = await nc.subscribe(S.all_events)
        reg = wire.Registration(job="default", replica="r1", devices=["d1"], epoch=2147483648)
        msg = await nc.request(S.register("default"), encode(reg), timeout=5)
        assert decode(msg.data, wire.ErrorReply).code == "invalid"
        await asyncio.sleep(1.5)  # past the expiry, several ticks
        assert c.stats["errors.internal"] == 0
        assert not events.pending_msgs  # no worker_stale / worker_expired about it
        assert not c.policy.workers and not c.policy.last_seen
    finally:
        await nc.close()
        await c.stop()
