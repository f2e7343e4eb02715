"""Roles and signed commands on a real nats-server running the configuration `marduk auth init` generates.

Each role tries what it may and may not do; forged commands, epochs, hellos and registrations
change nothing for the trainers; secrets never reach an output.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

import agent
from agent.library.client import AgentError, AsyncClient
from marduk.controller import Controller, ControllerSettings
from marduk.errors import ConnectError, PermissionDeniedError
from marduk.transport import auth, bus
from marduk.transport.credentials import Credentials
from marduk.wire import protocol as wire
from marduk.wire.protocol import encode
from marduk.wire.subjects import Subjects
from monitor_cli import client as monitor
from tests.conftest import NatsServer, eventually, marduk_cli, start_serving

S = Subjects()


@pytest.fixture
def auth_dir(tmp_path: Path) -> Path:
    d = tmp_path / "auth"
    auth.init(d)
    auth.add_agent(d, "big")
    return d


@pytest.fixture
async def secure(tmp_path: Path, auth_dir: Path) -> AsyncIterator[tuple[NatsServer, Controller]]:
    server = NatsServer(tmp_path / "js", args=["-c", str(auth_dir / auth.CONFIG_FILE)]).start()
    settings = ControllerSettings(
        addr=server.url,
        embedded=False,
        state_dir=tmp_path / "state",
        credentials=Credentials(nkey=auth_dir / "controller.nk"),
    )
    c = await start_serving(Controller(settings))
    yield server, c
    await c.stop()
    server.stop()


def creds(auth_dir: Path, name: str) -> Credentials:
    return Credentials(nkey=auth_dir / f"{name}.nk")


async def connect(server: NatsServer, credentials: Credentials) -> nats.NATS:
    return await bus.connect(server.url, name="test", credentials=credentials)


async def denied(nc: nats.NATS, subject: str, payload: bytes = b"{}") -> bool:
    """Publish; True if the server reported a permission violation for the subject."""
    await nc.publish(subject, payload)
    await nc.flush()
    for _ in range(50):
        if bus.denied(subject):
            return True
        await asyncio.sleep(0.02)
    return False


async def lib(
    server: NatsServer, auth_dir: Path, name: str, replica: str, job: str = "big"
) -> AsyncClient:
    return await agent.connect_async(
        replica,
        [f"{replica}-gpu"],
        job=job,
        addr=server.url,
        timeout=5,
        credentials=creds(auth_dir, name),
    )


def test_auth_init_writes_private_seeds_and_a_valid_server_config(auth_dir: Path) -> None:
    import subprocess

    from marduk.transport.embedded import find_binary

    assert stat.S_IMODE(auth_dir.stat().st_mode) == 0o700
    for name in ("controller", "agent", "monitor", "admin", "agent-big"):
        assert stat.S_IMODE((auth_dir / f"{name}.nk").stat().st_mode) == 0o600
        assert (auth_dir / f"{name}.nk").read_text().startswith("SU")
    r = subprocess.run(
        [find_binary(), "-c", str(auth_dir / auth.CONFIG_FILE), "-t"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    # The CLI lists identities without ever printing a seed.
    out = marduk_cli("auth", "list", str(auth_dir))
    assert out.returncode == 0 and "agent-big" in out.stdout
    for seed_file in auth_dir.glob("*.nk"):
        assert seed_file.read_text().strip() not in out.stdout


async def test_each_role_may_do_its_job_and_nothing_else(
    secure: tuple[NatsServer, Controller], auth_dir: Path
) -> None:
    server, c = secure
    # agent: registers (the legitimate path), cannot publish commands, health, hello, queries.
    a = await lib(server, auth_dir, "agent", "r1")
    nc = await connect(server, creds(auth_dir, "agent"))
    try:
        assert a.state == "registered"
        assert await denied(nc, S.job_commands("big"))
        assert await denied(nc, S.health)
        assert await denied(nc, S.hello)
        assert await denied(nc, S.forget)
        with pytest.raises(
            PermissionDeniedError,
            match=r"the agent credential may not publish on marduk\.ctl\.query",
        ):
            await bus.request(nc, S.query, wire.Query(), wire.QueryReply, timeout=1)
    finally:
        await nc.close()
    # monitor: publishes health durably and gets the decision; cannot query or register.
    bus.set_default_credentials(creds(auth_dir, "monitor"))
    try:
        reply = await monitor.publish_health(server.url, "marduk", "r1-gpu", "failed")
        assert [x.replica for x in reply.actions] == ["r1"]
        cmd = await a.wait(5)
        assert cmd is not None and cmd.kind == "restart"  # signed by the controller, verified
        with pytest.raises(PermissionDeniedError):
            await monitor.query(server.url, "marduk", "ping", timeout=1)
    finally:
        bus.set_default_credentials(Credentials())
    nc = await connect(server, creds(auth_dir, "monitor"))
    try:
        assert await denied(nc, S.register("big"))
        assert await denied(nc, S.replica_commands("big", "r1"))
    finally:
        await nc.close()
    # admin: everything `marduk monitor` does; no commands, no registrations.
    bus.set_default_credentials(creds(auth_dir, "admin"))
    try:
        status = await monitor.query(server.url, "marduk", "map")
        assert [w.replica for w in status.workers] == ["r1"]
        assert (await monitor.forget(server.url, "marduk", "nope")).removed == []
        await monitor.publish_health(server.url, "marduk", "r1-gpu", "healthy")
    finally:
        bus.set_default_credentials(Credentials())
    nc = await connect(server, creds(auth_dir, "admin"))
    try:
        events = await nc.subscribe(S.all_events)  # watch is allowed
        await nc.flush()
        assert not bus.denied(S.all_events) and events is not None
        assert await denied(nc, S.job_commands("big"))
        assert await denied(nc, S.register("big"))
    finally:
        await nc.close()
    # a job-scoped agent serves its job only; its trainer's requests are authorised like its
    # reports: its own devices only, its job's subject only.
    b = await lib(server, auth_dir, "agent-big", "r2")
    assert b.state == "registered"
    other = await b.request("device_bad", device="r1-gpu")
    assert not other and other.code == "not_own_device"
    own = await b.request("device_bad", device="r2-gpu", reason="ECC")
    assert own, own.detail
    nc = await connect(server, creds(auth_dir, "agent-big"))
    try:
        assert await denied(nc, S.request("other"))
    finally:
        await nc.close()
    with pytest.raises(AgentError, match=r"may not publish on marduk\.other\.register"):
        await lib(server, auth_dir, "agent-big", "r3", job="other")
    await a.close()
    await b.close()
    assert c.stats["errors.internal"] == 0
    assert bus.STATS["nats.permission_violations"] >= 10


async def test_no_wrong_or_revoked_credentials_are_refused(
    secure: tuple[NatsServer, Controller], auth_dir: Path, tmp_path: Path
) -> None:
    server, _ = secure
    with pytest.raises(ConnectError, match="authorization violation"):
        await connect(server, Credentials())
    stranger = tmp_path / "stranger.nk"
    stranger.write_bytes(auth.new_user_seed())
    with pytest.raises(ConnectError, match="authorization violation"):
        await connect(server, Credentials(nkey=stranger))
    nc = await connect(server, creds(auth_dir, "admin"))
    await nc.close()
    kept = (auth_dir / "admin.nk").read_bytes()
    auth.revoke(auth_dir, "admin")
    revoked = tmp_path / "admin-old.nk"
    revoked.write_bytes(kept)
    server.reload()

    async def refused() -> bool:
        try:
            nc = await connect(server, Credentials(nkey=revoked))
        except ConnectError:
            return True
        await bus.close(nc, drain=False)
        return False

    for _ in range(50):
        if await refused():
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("a revoked key still connects after the reload")
    # A missing key file is one clear line, before any connection.
    with pytest.raises(Exception, match="no such readable file"):
        await connect(server, Credentials(nkey=tmp_path / "missing.nk"))


async def test_forged_commands_hellos_and_registrations_change_nothing(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Defence in depth on an open server: what anyone on the bus could publish."""
    d = tmp_path / "auth"
    auth.init(d)
    settings = ControllerSettings(
        addr=nats_server.url,
        embedded=False,
        state_dir=tmp_path / "state",
        credentials=Credentials(nkey=d / "controller.nk"),
    )
    # The controller signs with its nkey; the server here has no auth, so it connects anyway.
    c = Controller(settings)
    c.credentials = Credentials()
    c.signing_seed = auth.read_seed(d / "controller.nk")
    await start_serving(c)
    signed = await agent.connect_async(
        "r1",
        ["g1"],
        job="big",
        addr=nats_server.url,
        timeout=5,
        controller_key=str(d / auth.CONTROLLER_PUB),
    )
    unsigned = await agent.connect_async("r2", ["g2"], job="big", addr=nats_server.url, timeout=5)
    nc = await nats.connect(nats_server.url)
    try:

        def forged(kind: str, epoch: int, replica: str | None = None) -> bytes:
            return encode(
                wire.Command(
                    command_id="x",
                    job="big",
                    replica=replica,
                    scope="job" if replica is None else "replica",
                    kind=kind,
                    epoch=epoch,
                    reason="forged",
                )
            )  # type: ignore[arg-type]

        for kind in ("stop", "restart", "fail"):
            await nc.publish(S.job_commands("big"), forged(kind, 5))
            await nc.publish(
                S.replica_commands("big", "r1"),
                forged(kind, 6, "r1"),
                headers={auth.SIG_HEADER: "AAAA"},
            )
        await nc.flush()
        await eventually(lambda: signed.stats["dropped_forged"] >= 6)
        assert await signed.wait(0.3) is None and not signed.failed
        # Without a key, a huge epoch is not believed: asked about, dropped; real ones still work.
        await nc.publish(S.replica_commands("big", "r2"), forged("restart", 10**12, "r2"))
        await nc.flush()
        await eventually(lambda: unsigned.stats["dropped_implausible"] == 1)
        while (await unsigned.wait(0.3)) is not None:  # the forged stop/restart/fail of epoch 5
            pass
        # Forged hellos: at most one re-registration a second, not fifty.
        before = signed.stats["registrations"]
        for _ in range(50):
            await nc.publish(S.hello, encode(wire.Hello(controller_id="evil", started_at=0)))
        await nc.flush()
        # Every hello is seen (one answered, the rest ignored); then count registrations.
        await eventually(
            lambda: signed.stats["hello_ignored"] + signed.stats["registrations"] - before >= 50
        )
        assert signed.stats["registrations"] - before <= 1
        assert signed.stats["hello_ignored"] >= 49
        # A forged registration for a live replica from another process is refused.
        fake = wire.Registration(job="big", replica="r1", devices=["evil"], host="attacker", pid=1)
        reply = await nc.request(S.register("big"), encode(fake), timeout=5)
        assert wire.decode(reply.data, wire.ErrorReply).code == "duplicate_worker"
        # The real controller's commands still arrive, verified, above every forged epoch.
        await monitor.publish_health(nats_server.url, "marduk", "g1", "failed")
        real = await signed.wait(5)
        assert real is not None and real.kind == "restart" and real.reason.startswith("device g1")
        await monitor.publish_health(nats_server.url, "marduk", "g2", "failed")
        real2 = await unsigned.wait(5)
        assert (
            real2 is not None and real2.kind == "restart" and real2.reason.startswith("device g2")
        )
    finally:
        await nc.close()
        await signed.close()
        await unsigned.close()
        await c.stop()


def test_secrets_never_reach_an_output(tmp_path: Path) -> None:
    secret = "s3cr3t-pa55word"
    server = NatsServer(tmp_path / "js", args=["--user", "marduk", "--pass", secret]).start()
    try:
        good = f"nats://marduk:{secret}@127.0.0.1:{server.port}"
        bad = f"nats://marduk:wrong-{secret}@127.0.0.1:{server.port}"
        outputs = []
        for env in (
            {"MARDUK_ADDR": bad},
            {"MARDUK_ADDR": good},
            {
                "MARDUK_ADDR": f"nats://127.0.0.1:{server.port}",
                "MARDUK_USER": "marduk",
                "MARDUK_PASSWORD": "wrong",
            },
        ):
            for args in (
                ("monitor", "status", "--timeout", "1"),
                ("monitor", "inject-failure", "d1", "--timeout", "1"),
            ):
                r = marduk_cli(*args, env=env)
                assert r.returncode != 0 and "Traceback" not in r.stderr
                outputs.append(r.stdout + r.stderr)
        assert any("authorization violation" in o for o in outputs)
        assert any("marduk:***@" in o for o in outputs)
        # The controller's log, started with the password in its address.
        r = marduk_cli(
            "controller",
            "--no-embedded",
            "--lease-ttl",
            "0.5",
            env={"MARDUK_ADDR": bad},
            timeout=30,
        )
        outputs.append(r.stdout + r.stderr)
        assert r.returncode == 1
        for out in outputs:
            assert secret not in out, out
    finally:
        server.stop()


def test_embedded_server_is_loopback_only_without_auth(tmp_path: Path) -> None:
    r = marduk_cli(
        "controller",
        env={"MARDUK_ADDR": "nats://0.0.0.0:47999", "MARDUK_STATE_DIR": str(tmp_path / "s")},
        timeout=30,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "refusing to serve NATS without authentication on 0.0.0.0" in r.stderr
    assert "--insecure" in r.stderr


@pytest.mark.e2e
def test_supervised_trainer_under_auth_end_to_end(env: dict[str, str], tmp_path: Path) -> None:
    """`marduk controller --auth DIR`, `marduk agent run --nkey agent.nk`, admin injects."""
    import sys

    from tests.processes import Proc, agent_run

    d = tmp_path / "auth"
    assert marduk_cli("auth", "init", str(d)).returncode == 0
    ctl = Proc([sys.executable, "-m", "marduk", "controller", "--auth", str(d)], env)
    ctl.expect("serving prefix")
    assert stat.S_IMODE(Path(env["MARDUK_STATE_DIR"]).stat().st_mode) == 0o700
    trainer = agent_run(
        {**env, "MARDUK_NKEY": str(d / "agent.nk")},
        "--replica",
        "r1",
        "--devices",
        "gpu-a,gpu-b",
        "--startup-timeout",
        "60",
        cmd=[sys.executable, "tests/trainers/toy.py", "--step-seconds", "0.05"],
    )
    try:
        trainer.expect("START r1/0 epoch=0")
        sockets = [
            p for p in Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp").glob("marduk-agent-*")
        ]
        assert sockets and all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in sockets)
        r = marduk_cli("monitor", "inject-failure", "gpu-b", env=env)
        assert r.returncode == 1 and "authorization violation" in r.stderr
        r = marduk_cli("monitor", "inject-failure", "gpu-b", "--nkey", str(d / "admin.nk"), env=env)
        assert r.returncode == 0 and "r1" in r.stdout, r.stderr
        trainer.expect("restart command epoch 1")
        trainer.expect("START r1/0 epoch=1")
    finally:
        trainer.stop()
        ctl.stop()


async def test_no_caller_makes_the_controller_write_where_it_should_not(
    secure: tuple[NatsServer, Controller], auth_dir: Path
) -> None:
    """The confused deputy: a reply subject naming the lease, a state key or hello would have
    the controller write there with its own rights. And no identity reads another's replies."""
    from marduk.wire.subjects import REPLY_HEADER

    server, c = secure
    assert c.leadership is not None
    term = c.leadership.term
    agent_nc = await connect(server, creds(auth_dir, "agent"))
    monitor_nc = await connect(server, creds(auth_dir, "monitor"))
    admin_nc = await connect(server, creds(auth_dir, "admin"))
    try:
        reg = wire.Registration(job="big", replica="rx", devices=["x1"], host="h", pid=1)
        await agent_nc.publish(S.register("big"), encode(reg), reply="$KV.marduk_leader.leader")
        await agent_nc.publish(S.register("big"), encode(reg), reply="marduk.ctl.hello")
        event = wire.DeviceHealth(device="x1", state="failed", event_id="deputy")
        await monitor_nc.publish(
            S.health, encode(event), headers={REPLY_HEADER: "$KV.marduk_state.w.big.rx.0"}
        )
        await eventually(lambda: c.stats["rejected.reply_subject"] >= 3)
        # The micro library answers $SRV requests on any reply subject: admin may not ask.
        assert await denied(admin_nc, "$SRV.INFO.marduk")
        # The lease and the state are untouched: still the same leader, same term.
        assert c.leading() and c.leadership.term == term
        assert c.stats["leader.depositions"] == 0
        assert c.store is not None
        entry = await c.store.kv.get("w.big.rx.0")
        assert b'"registration"' in (entry.value or b"")
        # Replies are per identity: an agent cannot read the monitor's, nor all of them.
        for subject in ("_INBOX.monitor.>", "_INBOX.>", "_INBOX.admin.x"):
            await agent_nc.subscribe(subject)
            await agent_nc.flush()
            await eventually(lambda subject=subject: bus.denied(subject) is not None)
    finally:
        for nc in (agent_nc, monitor_nc, admin_nc):
            await bus.close(nc, drain=False)
