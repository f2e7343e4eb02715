"""Auth holes closed, on a real nats-server with the configuration `marduk auth` generates: revocation on
the embedded server, writes through JetStream acknowledgements, device claims across jobs,
commands moved to another destination, and permission errors as one line."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.js.errors
import pytest

import agent
from agent.library.client import AsyncClient
from marduk.controller import Controller, ControllerSettings
from marduk.controller.leadership import lease_bucket_name
from marduk.errors import RequestRejected
from marduk.transport import auth, bus
from marduk.transport.credentials import Credentials
from marduk.transport.embedded import ServerKeeper
from marduk.wire import protocol as wire
from marduk.wire.protocol import encode
from marduk.wire.subjects import Subjects
from monitor_cli import client as monitor
from tests.conftest import NatsServer, eventually, free_port, start_serving

S = Subjects()


@pytest.fixture
def auth_dir(tmp_path: Path) -> Path:
    d = tmp_path / "auth"
    auth.init(d)
    auth.add_agent(d, "jobA")
    auth.add_agent(d, "jobB")
    return d


def creds(auth_dir: Path, name: str) -> Credentials:
    return Credentials(nkey=auth_dir / f"{name}.nk")


@pytest.mark.serial  # an upper bound on time: the machine to itself
async def test_revoked_identity_is_refused_and_its_open_connection_closed_within_a_second(
    tmp_path: Path, auth_dir: Path
) -> None:
    stats: Counter[str] = Counter()
    keeper = ServerKeeper(
        f"nats://127.0.0.1:{free_port()}",
        tmp_path / "state",
        embedded=True,
        auth_dir=auth_dir,
        insecure=False,
        stats=stats,
    )
    url = await keeper.ensure()
    watching = asyncio.create_task(keeper.watch(lambda: False))
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    kept = tmp_path / "agent-jobA-old.nk"
    kept.write_bytes((auth_dir / "agent-jobA.nk").read_bytes())
    nc = await bus.connect(
        url, name="victim", credentials=creds(auth_dir, "agent-jobA"), on_closed=on_closed
    )
    try:
        revoked_at = time.monotonic()
        auth.revoke(auth_dir, "agent-jobA")
        await asyncio.wait_for(closed.wait(), 3)
        assert time.monotonic() - revoked_at < 1.5
        await eventually(lambda: stats["auth.reloads"] == 1)
        assert stats["auth.reload_failures"] == 0
        with pytest.raises(Exception, match="authorization violation"):
            await bus.connect(url, name="revoked", credentials=Credentials(nkey=kept))
        # Addition takes effect too: a new job's agent connects at once.
        auth.add_agent(auth_dir, "jobC")
        await eventually(lambda: stats["auth.reloads"] == 2, timeout=3)
        nb = await bus.connect(url, name="new", credentials=creds(auth_dir, "agent-jobC"))
        await bus.close(nb, drain=False)
        # A configuration the server refuses is said so, not assumed applied.
        conf = auth_dir / auth.CONFIG_FILE
        conf.write_text(conf.read_text() + "\nauthorization { nonsense\n")
        await eventually(lambda: stats["auth.reload_failures"] == 1, timeout=5)
    finally:
        if not nc.is_closed:
            await nats.NATS.close(nc)
        watching.cancel()
        await keeper.stop()


@pytest.fixture
async def secure(tmp_path: Path, auth_dir: Path) -> AsyncIterator[tuple[NatsServer, Controller]]:
    server = NatsServer(tmp_path / "js", args=["-c", str(auth_dir / auth.CONFIG_FILE)]).start()
    settings = ControllerSettings(
        addr=server.url,
        embedded=False,
        state_dir=tmp_path / "state",
        credentials=creds(auth_dir, "controller"),
    )
    c = await start_serving(Controller(settings))
    yield server, c
    await c.stop()
    server.stop()


async def test_no_role_writes_a_marduk_bucket_through_a_jetstream_acknowledgement(
    secure: tuple[NatsServer, Controller], auth_dir: Path
) -> None:
    """Every subject each role may publish on, with a reply subject naming the lease, another
    job's epoch and a handled-event record: JetStream would acknowledge there with its rights."""
    server, c = secure
    assert c.leadership is not None and c.store is not None
    term = c.leadership.term
    js = c.nc.jetstream()  # type: ignore[union-attr]
    targets = [
        "$KV.marduk_leader.leader",
        "$KV.marduk_state.e.jobB.b1",
        "$KV.marduk_events.attack",
    ]
    event = encode(wire.DeviceHealth(device="nowhere", state="healthy", event_id="ack-attack"))
    sent = 0
    for name in ("monitor", "admin", "agent", "agent-jobA"):
        identity = next(i for i in auth.identities(auth_dir)[1] if i.name == name)
        nc = await bus.connect(
            server.url, name=f"attacker-{name}", credentials=creds(auth_dir, name)
        )
        try:
            subjects = auth.permissions(identity.role, "marduk", identity.job, name)["publish"]
            for subject in subjects:
                subject = subject.replace("*", "jobA")
                for target in targets:
                    payload = event if subject.endswith(".health") else b"{}"
                    await nc.publish(subject, payload, reply=target)
                    sent += 1
            await nc.flush()
        finally:
            await bus.close(nc, drain=False)
    assert sent >= 3 * 9
    # The health events were stored (the controller handled them) and nothing else happened.
    await eventually(lambda: c.stats["health.unknown_device"] + c.stats["health.duplicates"] >= 1)
    await asyncio.sleep(1.0)  # acknowledgements, had there been any, are in by now
    # Every value the lease ever held (renewals included) is a lease, never a PubAck.
    info = await js.stream_info(f"KV_{lease_bucket_name('marduk')}")
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            msg = await js.get_msg(info.config.name, seq)
            assert b'"holder"' in (msg.data or b""), msg.data
    assert c.leading() and c.leadership.term == term
    assert c.stats["leader.depositions"] == 0
    for key in ("e.jobB.b1",):
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await c.store.kv.get(key)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await c.store.events.get("attack")
    # And a monitor still learns that its event is stored, and the decision.
    bus.set_default_credentials(creds(auth_dir, "monitor"))
    try:
        reply = await monitor.publish_health(server.url, "marduk", "nowhere", "failed")
        assert reply.actions == []
    finally:
        bus.set_default_credentials(Credentials())


async def test_every_monitor_command_refused_a_permission_says_so_in_one_line(
    secure: tuple[NatsServer, Controller], auth_dir: Path
) -> None:
    server, _ = secure
    env = {**os.environ, "MARDUK_ADDR": server.url, "MARDUK_NKEY": str(auth_dir / "agent.nk")}
    commands = {
        # Checked before publishing: it could not tell a published event was stored.
        ("inject-failure", "d1"): "subscribe to marduk.health.stored, so it cannot tell",
        ("mark-healthy", "d1"): "subscribe to marduk.health.stored, so it cannot tell",
        ("status",): "publish on marduk.ctl.query",
        ("drain", "--host", "h1"): "publish on marduk.ctl.drain",
        ("forget", "jobA"): "publish on marduk.ctl.forget",
        ("watch",): "subscribe to marduk.*.events",
        ("top",): "subscribe to marduk.*.events",
    }

    two_at_a_time = asyncio.Semaphore(2)

    async def run(args: tuple[str, ...]) -> tuple[int | None, str]:
        async with two_at_a_time:
            return await run_one(args)

    async def run_one(args: tuple[str, ...]) -> tuple[int | None, str]:
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "marduk", "monitor", *args, "--timeout", "2",
            env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await asyncio.wait_for(p.communicate(), 60)
        return p.returncode, stderr.decode()

    results = await asyncio.gather(*(run(args) for args in commands))
    for (args, permission), (code, stderr) in zip(commands.items(), results, strict=True):
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1, (args, stderr)
        assert lines[0].startswith(
            f"error: authorization violation: the agent credential may not {permission}"
        )


async def test_a_signed_command_moved_to_another_destination_is_dropped_and_counted(
    nats_server: NatsServer, tmp_path: Path, auth_dir: Path
) -> None:
    """Defence in depth on an open server: a command the controller really signed for job A's
    replica a1, replayed on job B's subjects or on job A's job-wide subject."""
    settings = ControllerSettings(
        addr=nats_server.url, embedded=False, state_dir=tmp_path / "state"
    )
    c = Controller(settings)
    seed = auth.read_seed(auth_dir / "controller.nk")
    c.signing_seed = seed
    await start_serving(c)
    key = str(auth_dir / auth.CONTROLLER_PUB)

    async def join(job: str, replica: str) -> AsyncClient:
        return await agent.connect_async(
            replica, [f"{replica}-gpu"], job=job, addr=nats_server.url, timeout=5,
            controller_key=key,
        )  # fmt: skip

    a1, a2, b1 = await join("jobA", "a1"), await join("jobA", "a2"), await join("jobB", "b1")
    nc = await nats.connect(nats_server.url)
    try:
        signed = encode(
            wire.Command(
                command_id="real", job="jobA", replica="a1", kind="fail", epoch=7, reason="x"
            )
        )
        headers = {auth.SIG_HEADER: auth.sign(seed, signed)}
        for subject in (
            S.replica_commands("jobB", "b1"),
            S.job_commands("jobB"),
            S.job_commands("jobA"),  # a2 would take a1's command
            S.replica_commands("jobA", "a2"),
        ):
            await nc.publish(subject, signed, headers=headers)
        await nc.flush()
        await eventually(
            lambda: b1.stats["dropped_misdirected"] == 2 and a2.stats["dropped_misdirected"] == 2
        )
        assert a1.stats["dropped_misdirected"] == 1  # the job-wide copy
        for client in (a1, a2, b1):
            assert await client.wait(0.2) is None and not client.failed
            assert client.stats["dropped_forged"] == 0  # the signature was good
        assert any("not for jobB/b1" in e for e in b1.errors)
        # On its own subject the same bytes are obeyed.
        await nc.publish(S.replica_commands("jobA", "a1"), signed, headers=headers)
        got = await a1.wait(5)
        assert got is not None and got.kind == "fail" and got.epoch == 7
    finally:
        await nc.close()
        for client in (a1, a2, b1):
            await client.close()
        await c.stop()


async def test_a_job_cannot_claim_another_jobs_device_nor_get_it_drained_by_host(
    secure: tuple[NatsServer, Controller], auth_dir: Path
) -> None:
    server, c = secure
    b1 = await agent.connect_async(
        "b1", ["dB"], job="jobB", addr=server.url, timeout=5,
        credentials=creds(auth_dir, "agent-jobB"),
    )  # fmt: skip
    nc = await bus.connect(server.url, name="attacker", credentials=creds(auth_dir, "agent-jobA"))
    try:

        async def register(replica: str, devices: list[str], host: str) -> wire.RegisterReply:
            reg = wire.Registration(
                job="jobA", replica=replica, devices=devices, host=host, pid=4242
            )
            return await bus.request(nc, S.register("jobA"), reg, wire.RegisterReply, timeout=5)

        # Job A's identity claims job B's device from its own host: refused, said why.
        with pytest.raises(RequestRejected, match=r"device dB is held by worker jobB/b1/0") as e:
            await register("a1", ["dA", "dB"], "nodeA-attacker")
        assert e.value.code == "device_claimed"
        assert c.stats["rejected.device_claimed"] == 1
        # Its own devices are fine; a second job-A worker on another host claims dA as well.
        await register("a1", ["dA"], "nodeA-attacker")
        await register("a2", ["dA"], "nodeA2")
        # Drain by the attacker's host: neither job B's device nor the contested one.
        bus.set_default_credentials(creds(auth_dir, "admin"))
        try:
            reply = await monitor.drain(server.url, "marduk", [], host="nodeA-attacker")
            status = await monitor.query(server.url, "marduk", "map")
        finally:
            bus.set_default_credentials(Credentials())
        assert reply.devices == [] and reply.actions == []
        assert reply.conflicts == [
            "dA: also claimed by jobA/a2/0 on nodeA2; not drained by host (name it to drain it)"
        ]
        assert await b1.wait(0.5) is None and not b1.failed
        assert not any(d.drained for d in status.devices)
    finally:
        await bus.close(nc, drain=False)
        await b1.close()


async def test_a_health_stream_made_by_an_older_controller_stops_acknowledging(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    from nats.js.api import StreamConfig

    from marduk.store.health_stream import stream_name

    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=stream_name("marduk"), subjects=[S.health]))
    c = await start_serving(
        Controller(
            ControllerSettings(addr=nats_server.url, embedded=False, state_dir=tmp_path / "s")
        )
    )
    try:
        config = (await js.stream_info(stream_name("marduk"))).config
        assert config.no_ack and config.republish is not None
        assert config.republish.dest == S.health_stored and config.republish.headers_only
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(S.health, b"{}", timeout=0.5)  # no acknowledgement any more
        reply = await monitor.publish_health(nats_server.url, "marduk", "nowhere", "failed")
        assert reply.known is False
    finally:
        await nc.close()
        await c.stop()


async def test_a_controller_started_with_another_roles_credential_names_the_permission(
    secure: tuple[NatsServer, Controller], auth_dir: Path, tmp_path: Path
) -> None:
    server, _ = secure
    env = {**os.environ, "MARDUK_ADDR": server.url, "MARDUK_STATE_DIR": str(tmp_path / "s2")}
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "marduk", "controller", "--no-embedded",
        "--nkey", str(auth_dir / "admin.nk"),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(p.communicate(), 60)
    text = stderr.decode()
    assert p.returncode == 1 and "Traceback" not in text
    # The error itself names the permission (the warning before it is not enough).
    error = next(line for line in text.splitlines() if "cannot open the JetStream state" in line)
    assert "the admin credential may not publish on $js.api." in error.lower(), error


@pytest.mark.e2e
async def test_marduk_auth_revoke_on_a_running_controller_closes_the_open_connection(
    env: dict[str, str], auth_dir: Path
) -> None:
    """What the issue's reporter did: `marduk controller --auth DIR`, then `marduk auth revoke`."""
    from tests.processes import Proc

    ctl = Proc([sys.executable, "-m", "marduk", "controller", "--auth", str(auth_dir)], env)
    try:
        await asyncio.to_thread(ctl.expect, "serving prefix", 60)
        closed = asyncio.Event()

        async def on_closed() -> None:
            closed.set()

        nc = await bus.connect(
            env["MARDUK_ADDR"], name="victim", credentials=creds(auth_dir, "agent-jobA"),
            on_closed=on_closed,
        )  # fmt: skip
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "marduk", "auth", "revoke", str(auth_dir), "agent-jobA",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(p.communicate(), 60)
        assert p.returncode == 0
        await asyncio.wait_for(closed.wait(), 5)
        assert nc.is_closed and b"applies it within a second" in out
        await asyncio.to_thread(ctl.expect, "the embedded server applied it", 5)
    finally:
        ctl.stop()


async def test_a_rotation_keeps_the_holder_working_until_it_is_finished_then_says_so(
    tmp_path: Path, auth_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rotated holder reconnected with the old public key signed by the
    new seed (nats-py re-reads the file), refused forever and silently."""
    server = NatsServer(tmp_path / "js", args=["-c", str(auth_dir / auth.CONFIG_FILE)]).start()
    closed, back = asyncio.Event(), asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    async def on_reconnected() -> None:
        back.set()

    holder = await bus.connect(
        server.url, name="holder", credentials=creds(auth_dir, "agent-jobA"),
        reconnect=True, on_closed=on_closed, on_reconnected=on_reconnected,
    )  # fmt: skip
    try:
        old_controller = auth.identities(auth_dir)[1][0].public_key
        rotated = auth.rotate(auth_dir, "agent-jobA")
        server.reload()
        await asyncio.sleep(0.3)
        server.stop()  # a reconnect: the holder presents the key it connected with
        server.start()
        await asyncio.wait_for(back.wait(), 10)
        await holder.flush()
        fresh = await bus.connect(server.url, name="new", credentials=creds(auth_dir, "agent-jobA"))
        await bus.close(fresh, drain=False)
        # A controller rotation lists both keys for agents until it is finished.
        new_controller = auth.rotate(auth_dir, "controller").public_key
        pub = str(auth_dir / auth.CONTROLLER_PUB)
        assert auth.load_public_keys(pub) == [new_controller, old_controller]
        # Finished: the previous key is refused, and the holder says so in one line and stops.
        auth.finish_rotation(auth_dir, "agent-jobA")
        auth.finish_rotation(auth_dir, "controller")
        assert auth.load_public_keys(pub) == [new_controller]
        assert rotated.previous is not None
        server.reload()
        await asyncio.sleep(0.3)
        server.stop()
        server.start()
        await asyncio.wait_for(closed.wait(), 10)
        said = [r.getMessage() for r in caplog.records if "credentials refused" in r.getMessage()]
        assert len(said) == 1 and "rotated or revoked" in said[0], said
        assert bus.refusal(holder) == said[0]
    finally:
        if not holder.is_closed:
            await nats.NATS.close(holder)
        server.stop()


async def test_a_monitor_cannot_forge_another_monitors_decision(
    secure: tuple[NatsServer, Controller], auth_dir: Path
) -> None:
    """Health.stored shows every inbox; an event naming the victim's inbox
    made the controller answer there, and the victim took the first answer it got."""
    server, _ = secure
    attacker = await bus.connect(
        server.url, name="attacker", credentials=creds(auth_dir, "monitor")
    )
    victim = await bus.connect(server.url, name="victim", credentials=creds(auth_dir, "admin"))
    forged = 0
    seen: set[str] = set()

    async def on_stored(msg: nats.aio.msg.Msg) -> None:
        nonlocal forged
        inbox = (msg.headers or {}).get("Marduk-Reply-To", "")
        if inbox.startswith("_INBOX.admin.") and inbox not in seen:  # once: ours are stored too
            seen.add(inbox)
            forged += 1
            for device in ("bad device id!", "elsewhere"):  # an ErrorReply and a HealthReply
                bad = wire.DeviceHealth(device=device, state="failed", event_id=f"atk-{forged}")
                await attacker.publish(S.health, encode(bad), headers={"Marduk-Reply-To": inbox})

    await attacker.subscribe(S.health_stored, cb=on_stored)
    await attacker.flush()
    ignored = monitor.STATS["monitor.replies_ignored"]
    try:
        for i in range(3):
            ev = wire.DeviceHealth(device=f"v{i}", state="failed", event_id=f"victim-{i}")
            reply = await monitor.publish_durably(victim, S, ev, timeout=5)
            assert reply.event_id == ev.event_id and reply.device == ev.device
            await asyncio.sleep(0.3)  # the forged answers arrive, and are ignored
        assert forged >= 3 and monitor.STATS["monitor.replies_ignored"] > ignored
    finally:
        await bus.close(attacker, drain=False)
        await bus.close(victim, drain=False)


async def test_publishes_in_flight_on_one_connection_share_one_stored_subscription(
    nats_server: NatsServer,
) -> None:
    """Each publish in flight subscribed to every stored notice, so 32 in
    flight received each one 32 times."""
    from marduk.store.health_stream import ensure_stream

    rx = await bus.connect(nats_server.url, name="rx")
    tx = await bus.connect(nats_server.url, name="tx")
    try:
        await ensure_stream(tx, S.prefix, S.health)
        watches = [await monitor.watch_stored(rx, S) for _ in range(32)]
        await rx.flush()
        before = rx.stats["in_msgs"]
        n = 200
        for i in range(n):
            ev = wire.DeviceHealth(device=f"d{i}", state="healthy", event_id=f"e{i}")
            await tx.publish(S.health, encode(ev), headers={"Marduk-Reply-To": tx.new_inbox()})
        await tx.flush()
        await eventually(lambda: rx.stats["in_msgs"] - before >= n)
        await asyncio.sleep(0.3)
        assert rx.stats["in_msgs"] - before == n
        for w in watches:
            await w.unsubscribe()
        assert rx._subs == {} or all(s.subject != S.health_stored for s in rx._subs.values())
    finally:
        await bus.close(rx, drain=False)
        await bus.close(tx, drain=False)


async def test_a_credential_that_cannot_see_health_stored_publishes_nothing(
    tmp_path: Path,
) -> None:
    """A monitor credential of an older config (health only) stored its
    event, then was told it may not subscribe to health.stored."""
    from marduk.store.health_stream import ensure_stream, stream_name

    conf = tmp_path / "old.conf"
    conf.write_text(
        "authorization { users = [\n"
        "  { user: ctl, password: ctl },\n"
        "  { user: old, password: old, permissions: {\n"
        '      publish: { allow: ["marduk.health"] }, subscribe: { allow: ["_INBOX.>"] } } }\n'
        "] }\n"
    )
    server = NatsServer(tmp_path / "js", args=["-c", str(conf)]).start()
    url = f"nats://127.0.0.1:{server.port}"
    ctl = await bus.connect(url, name="ctl", credentials=Credentials(user="ctl", password="ctl"))
    try:
        await ensure_stream(ctl, S.prefix, S.health)
        js = ctl.jetstream()
        with pytest.raises(Exception, match=r"may not subscribe to marduk\.health\.stored"):
            await _publish_as(url, Credentials(user="old", password="old"))
        await asyncio.sleep(0.3)
        assert (await js.stream_info(stream_name(S.prefix))).state.messages == 0
    finally:
        await bus.close(ctl, drain=False)
        server.stop()


async def _publish_as(url: str, credentials: Credentials) -> None:
    nc = await bus.connect(url, name="old-monitor", credentials=credentials)
    try:
        ev = wire.DeviceHealth(device="d1", state="failed", event_id="old-1")
        await monitor.publish_durably(nc, S, ev, timeout=2)
    finally:
        await bus.close(nc, drain=False)


async def test_without_auth_device_claims_are_not_exclusive_across_jobs(
    controller: Controller, nats_server: NatsServer
) -> None:
    """On Kubernetes the agent's host is its pod's name, so two pods of
    different jobs time-slicing one GPU were refused; without auth nothing binds a claim's
    host or job anyway. The drain-by-host conflict is still reported."""
    assert controller.policy.config.exclusive_devices is False
    nc = await bus.connect(nats_server.url, name="pods")
    try:
        for job, pod in (("jobB", "podB"), ("jobA", "podA")):
            reg = wire.Registration(job=job, replica="r", devices=["gpu0"], host=pod, pid=7)
            reply = await bus.request(nc, S.register(job), reg, wire.RegisterReply, timeout=5)
            assert reply.outcome == "new"
        drained = await monitor.drain(nats_server.url, "marduk", [], host="podA")
        assert drained.devices == [] and drained.conflicts == [
            "gpu0: also claimed by jobB/r/0 on podB; not drained by host (name it to drain it)"
        ]
    finally:
        await bus.close(nc, drain=False)


def test_exclusive_devices_defaults_to_on_with_auth_and_an_operator_may_turn_it_off(
    tmp_path: Path, auth_dir: Path
) -> None:
    from marduk.core.policy import PolicyConfig

    def exclusive(**kw: object) -> bool | None:
        settings = ControllerSettings(addr="nats://127.0.0.1:1", state_dir=tmp_path, **kw)  # type: ignore[arg-type]
        return Controller(settings).policy.config.exclusive_devices

    assert exclusive() is False
    assert exclusive(credentials=creds(auth_dir, "controller")) is True
    assert exclusive(auth_dir=auth_dir) is True
    shared = PolicyConfig(exclusive_devices=False)  # --shared-devices
    assert exclusive(credentials=creds(auth_dir, "controller"), policy=shared) is False


async def test_a_new_monitor_against_an_older_stream_says_the_event_may_be_stored(
    nats_server: NatsServer,
) -> None:
    """With an older controller's stream (acks, no republish) a new
    monitor said the stream "did not store the event", though it had."""
    from marduk.store.health_stream import ensure_stream, stream_name

    nc = await bus.connect(nats_server.url, name="upgrade")
    try:
        await ensure_stream(nc, S.prefix, S.health)
        js = nc.jetstream()
        config = (await js.stream_info(stream_name(S.prefix))).config
        config.no_ack, config.republish = False, None  # what /tmp/rev/oldstream.py did
        await js.update_stream(config)
        ev = wire.DeviceHealth(device="d1", state="failed", event_id="new-monitor-1")
        with pytest.raises(Exception, match=r"may have been stored.*made by an older controller"):
            await monitor.publish_durably(nc, S, ev, timeout=1.5)
        assert (await js.stream_info(stream_name(S.prefix))).state.messages >= 1
    finally:
        await bus.close(nc, drain=False)
