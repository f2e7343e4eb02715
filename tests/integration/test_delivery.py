"""Delivery on a real server, in one process: notices that join a restart, resends, liveness."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import nats
import pytest
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from agent.library.client import AsyncClient, connect_async
from marduk.controller import Controller
from marduk.core.policy import PolicyConfig
from marduk.core.records import EpochKey
from marduk.store.health_stream import HealthConsumer
from marduk.wire import protocol as wire
from marduk.wire.protocol import decode, encode
from marduk.wire.subjects import Subjects
from monitor_cli import client as monitor
from tests.conftest import NatsServer, controller_settings, eventually, health_event, start_serving
from tests.tcp_proxy import TcpProxy

S = Subjects()


async def agent(server: NatsServer, replica: str, devices: list[str]) -> AsyncClient:
    return await connect_async(replica, devices, addr=server.url, timeout=10)


async def serve(server: NatsServer, tmp_path: Path, **policy: object) -> Controller:
    settings = controller_settings(server, tmp_path)
    settings.policy = PolicyConfig(**policy)  # type: ignore[arg-type]
    return await start_serving(Controller(settings))


async def test_a_failure_joining_a_restart_in_flight_reaches_every_replica(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The scenario: r1 on d1,d2, r2 on d2,d3; trainers that wait() and do not ack."""
    c = await serve(nats_server, tmp_path)
    r1 = await agent(nats_server, "r1", ["d1", "d2"])
    r2 = await agent(nats_server, "r2", ["d2", "d3"])
    nc = await nats.connect(nats_server.url)
    try:
        await health_event(nc, "d3")
        first = await r2.wait(5)
        assert first is not None and (first.epoch, first.devices) == (1, ("d3",))
        reply = await health_event(nc, "d2")
        assert {(a.replica, a.coalesced) for a in reply.actions} == {("r1", False), ("r2", True)}
        got1, got2 = await r1.wait(5), await r2.wait(5)
        assert got1 is not None and (got1.epoch, got1.devices) == (1, ("d2",))
        # r2 learns d2 failed too: same epoch (it restarts once), the devices merged.
        assert got2 is not None and (got2.epoch, got2.devices) == (1, ("d3", "d2"))
        assert r2.stats["updates"] == 1 and r2.last_failure is not None
        assert r2.last_failure.devices == ("d3", "d2")
        # Resends of the same command (r2 has still not acked) are not delivered again.
        await eventually(lambda: c.stats["commands.resent"] >= 3, timeout=10)
        assert await r2.wait(0.2) is None and r2.stats["dropped_stale"] >= 1
    finally:
        await nc.close()
        await r1.close()
        await r2.close()
        await c.stop()


@pytest.mark.parametrize("second", ["d2", "d3"])
async def test_a_failure_merged_while_the_ack_travels_restarts_the_replica_again(
    nats_server: NatsServer, tmp_path: Path, second: str
) -> None:
    """r2 acts on epoch 1 (d3) and acks; ``second`` (another of its devices, or d3 again)
    fails while that ack is held on its way to the leader (a TCP proxy holds what r2 sends)
    and is merged into epoch 1, at revision 1. The update reaches r2 after it acted: not
    delivered. Its ack says its incarnation started at revision 0, before that failure: the
    leader restarts r2 again at epoch 2, for that event (issue 24: a repeat of d3 was answered
    "coalesced" and never acted on)."""
    c = await serve(nats_server, tmp_path)
    proxy = await TcpProxy(nats_server.port).start()
    r2 = await connect_async("r2", ["d2", "d3"], addr=proxy.url, timeout=10)
    nc = await nats.connect(nats_server.url)
    try:
        await health_event(nc, "d3", event_id="e1")
        first = await r2.wait(5)
        assert first is not None and (first.epoch, first.devices) == (1, ("d3",))
        proxy.hold(down=False)  # what r2 sends waits in the proxy; it still receives
        acking = asyncio.create_task(r2.ack(first))
        await eventually(lambda: r2.fence.acked == 1)  # acted on: the ack is on its way
        reply = await health_event(nc, second, event_id="e2")
        assert [(a.replica, a.epoch, a.coalesced) for a in reply.actions] == [("r2", 1, True)]
        await eventually(lambda: r2.fence.revision == 1)  # the update came, after the ack
        assert r2.stats["updates"] == 0 and await r2.wait(0.1) is None
        proxy.pass_()
        assert await acking
        again = await r2.wait(5)
        assert again is not None and (again.kind, again.epoch, again.devices) == (
            "restart",
            2,
            (second,),
        )
        command = c.policy.epochs[EpochKey("default", "r2")].command
        assert command is not None and command.event_id == "e2"
        assert await r2.ack(again)
        assert await r2.wait(0.3) is None  # acted on at its latest revision: nothing more
    finally:
        await nc.close()
        await r2.close()
        await proxy.stop()
        await c.stop()


@pytest.mark.parametrize("second", ["d2", "d3"])
async def test_a_failure_merged_before_the_agent_acted_is_covered_by_its_restart(
    nats_server: NatsServer, tmp_path: Path, second: str
) -> None:
    """The same failures, but the update reaches r2 before its trainer acts (a library
    trainer acks, then exits or starts over): the incarnation that follows starts after the
    second failure, so the one restart covers both. Its ack says revision 1: no epoch 2. A
    new device is delivered to the trainer again; a repeat of one it was told of is not."""
    c = await serve(nats_server, tmp_path)
    r2 = await agent(nats_server, "r2", ["d2", "d3"])
    nc = await nats.connect(nats_server.url)
    try:
        await health_event(nc, "d3", event_id="e1")
        first = await r2.wait(5)
        assert first is not None and first.epoch == 1
        reply = await health_event(nc, second, event_id="e2")
        assert [(a.epoch, a.coalesced) for a in reply.actions] == [(1, True)]
        if second == "d2":  # a new device: delivered, the trainer has not acted yet
            update = await r2.wait(5)
            assert update is not None and update.epoch == 1 and second in update.devices
        else:  # a repeat: taken in (its revision), not delivered again
            await eventually(lambda: r2.fence.revision == 1)
            assert await r2.wait(0.3) is None
        assert await r2.ack(first)
        await eventually(lambda: c.stats["received.ack"] >= 1)
        assert await r2.wait(1.5) is None  # resends stop; no second restart
        assert c.policy.epoch_of(EpochKey("default", "r2")) == 1
        assert not c.policy.awaiting(EpochKey("default", "r2"))
    finally:
        await nc.close()
        await r2.close()
        await c.stop()


async def test_a_missed_command_arrives_by_resend_without_waiting_for_renewal(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A dropped core message costs about a resend interval (1 s), not the renewal period."""
    c = await serve(nats_server, tmp_path, worker_ttl_s=300)  # renewals every 100 s
    r1 = await agent(nats_server, "r1", ["d1"])
    assert r1._nc is not None
    subs = [s for s in r1._nc._subs.values() if ".cmd." in s.subject]
    for sub in subs:  # lose the command subscription, as a slow consumer or a blip would
        await sub.unsubscribe()
    nc = await nats.connect(nats_server.url)
    try:
        await health_event(nc, "d1")
        assert await r1.wait(0.3) is None
        await r1._nc.subscribe(S.replica_commands("default", "r1"), cb=r1._on_msg)
        got = await r1.wait(5)  # the next resend, ~1 s later
        assert got is not None and (got.kind, got.epoch) == ("restart", 1)
        assert r1.stats["registrations"] == 1  # no re-registration was needed
        assert c.stats["commands.resent"] >= 1
        await r1.ack()
        resent = c.stats["commands.resent"]
        await eventually(lambda: c.stats["received.ack"] >= 1)
        assert await r1.wait(1.5) is None and c.stats["commands.resent"] <= resent + 1
    finally:
        await nc.close()
        await r1.close()
        await c.stop()


async def test_stale_worker_is_shown_releases_its_restart_and_expires(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    c = await serve(nats_server, tmp_path, worker_ttl_s=1.0, worker_expiry_s=3.0)
    r1 = await agent(nats_server, "r1", ["d1"])
    assert r1.renew_interval == pytest.approx(1 / 3)  # told by the controller
    silent = await agent(nats_server, "r2", ["d2"])
    for task in list(silent._tasks):  # its renewals stop, as if the process hung
        task.cancel()
    try:
        await eventually(lambda: ("default", "r2", 0) in c.policy.stale, timeout=10)
        status = await monitor.query(nats_server.url, "marduk", "map")
        assert {w.replica: w.state for w in status.workers} == {"r1": "live", "r2": "stale"}
        await eventually(lambda: not c.policy.drmap.has_device("d2"), timeout=15)
        status = await monitor.query(nats_server.url, "marduk", "map")
        assert [w.replica for w in status.workers] == ["r1"]
        assert "d2" not in [d.device for d in status.devices]
        assert c.stats["rejected"] == 0
    finally:
        await r1.close()
        await silent.close(deregister=False)
        await c.stop()


async def test_a_second_live_process_is_refused_with_duplicate_worker(
    controller: Controller, nats_server: NatsServer
) -> None:
    r1 = await agent(nats_server, "r1", ["d1"])
    nc = await nats.connect(nats_server.url)
    try:
        events = await nc.subscribe(S.all_events)
        other = wire.Registration(
            job="default", replica="r1", devices=["d9"], host="elsewhere", pid=os.getpid() + 1
        )
        msg = await nc.request(S.register("default"), encode(other), timeout=5)
        err = decode(msg.data, wire.ErrorReply)
        assert err.code == "duplicate_worker" and "is held by pid" in err.message
        assert controller.stats["rejected.duplicate_worker"] == 1
        ev = decode((await events.next_msg(timeout=5)).data, wire.ControllerEvent)
        assert ev.kind == "duplicate_worker"
        assert (ev.job, ev.replica, ev.worker) == ("default", "r1", 0)  # who was refused
        # Not merged: the map still has the live holder's devices only.
        assert controller.policy.drmap.devices_for_worker(("default", "r1", 0)) == {"d1"}  # type: ignore[arg-type]
    finally:
        await nc.close()
        await r1.close()


def test_forget_and_mark_healthy_all_from_the_cli(controller_env: dict[str, str]) -> None:
    from tests.conftest import marduk_cli
    from tests.processes import inject, status, trainer

    t = trainer(controller_env, "r1", "d1,d2")
    try:
        inject(controller_env, "d1")
        r = marduk_cli("monitor", "mark-healthy", "--all", env=controller_env)
        assert r.returncode == 0 and "d1" in r.stdout and "healthy" in r.stdout
        assert {d["device"]: d["state"] for d in status(controller_env)["devices"]} == {
            "d1": "healthy",
            "d2": "healthy",
        }
        r = marduk_cli("monitor", "forget", "bad/", env=controller_env)
        assert r.returncode == 2 and "is not JOB" in r.stderr and "Traceback" not in r.stderr
        # Gone without a goodbye: its registration stays until the worker TTL, and nothing
        # renews it between the two forgets (a live trainer re-registers every few seconds).
        t.stop(signal.SIGKILL)
        r = marduk_cli("monitor", "forget", "default/r1", env=controller_env)
        assert r.returncode == 0 and "removed 1 worker: default/r1/0" in r.stdout, r.stdout
        assert status(controller_env)["workers"] == []
        r = marduk_cli("monitor", "forget", "default", env=controller_env)
        assert r.returncode == 0 and "nothing registered" in r.stdout
    finally:
        t.stop()


async def test_a_new_leader_handles_the_stored_backlog_on_first_delivery(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events stored while no controller runs are handled as the consumer delivers them.

    A leader that ignored deliveries arriving before it marked itself serving left them for
    redelivery after ack_wait: they would then be delivered twice (counted here).
    """
    first = await serve(nats_server, tmp_path)
    r1 = await agent(nats_server, "r1", ["g1"])
    await first.stop()
    nc = await nats.connect(nats_server.url)
    backlog = 300
    try:
        for i in range(backlog):  # a backlog: devices nobody uses, then one that r1 uses
            await nc.publish(S.health, f'{{"device": "x{i}", "state": "degraded"}}'.encode())
        await nc.publish(S.health, b'{"device": "g1", "state": "failed"}')
        await nc.flush()
        # Widen the moment between subscribing and the rest of taking over, so deliveries
        # surely arrive in it (on loopback it is a round trip, and was hit 3 times in 24).
        original = HealthConsumer.start

        async def slow_start(self, cb, **kw):  # type: ignore[no-untyped-def]
            await original(self, cb, **kw)
            await asyncio.sleep(0.3)

        monkeypatch.setattr(HealthConsumer, "start", slow_start)
        second = await serve(nats_server, tmp_path)
        got = await r1.wait(10)
        assert got is not None and got.kind == "restart"
        await eventually(lambda: second.stats["health.unknown_device"] == backlog)
        assert second.stats["received.devicehealth"] == backlog + 1, dict(second.stats)
        await second.stop()
    finally:
        await nc.close()
        await r1.close(deregister=False)


async def test_a_vacant_replica_s_epoch_record_is_deleted_after_the_retention(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Every job ever run used to leave its epoch records in the state bucket for good."""
    c = await serve(nats_server, tmp_path, epoch_retention_s=1.0)
    kept = await agent(nats_server, "kept", ["d1"])
    gone = await agent(nats_server, "gone", ["d2"])
    nc = await nats.connect(nats_server.url)
    try:
        kv = await nc.jetstream().key_value(c.store.bucket)
        assert (await kv.get("e.default.gone")).value
        await gone.close()  # deregisters: the replica is vacant
        await eventually(lambda: EpochKey("default", "gone") not in c.policy.epochs, timeout=10)
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # written by the commit that follows the decision
            try:
                await kv.get("e.default.gone")
            except (KeyDeletedError, KeyNotFoundError):
                break
            assert asyncio.get_running_loop().time() < deadline, "the record is still there"
            await asyncio.sleep(0.05)
        assert (await kv.get("e.default.kept")).value  # its worker is still there
    finally:
        await nc.close()
        await kept.close()
        await c.stop()
