"""Real processes, SIGKILL: one leader at a time, takeover, durable events, NATS death.

Controllers here are ``marduk controller`` processes against one nats-server (external, so the
leader can die without taking the server along), trainers are the demo trainer (the library).
"""

from __future__ import annotations

import json
import signal
import sys

import psutil
import pytest

from tests.conftest import NatsServer, eventually_sync, marduk_cli
from tests.processes import Proc, commands_seen, inject, status, trainer

pytestmark = pytest.mark.e2e


def start_controller(env: dict[str, str], name: str, tmp: str) -> Proc:
    return Proc(
        [
            sys.executable,
            "-m",
            "marduk",
            "controller",
            "--no-embedded",
            "--state-dir",
            f"{tmp}/{name}",
        ],
        env,
    )


def leader_pid(env: dict[str, str]) -> int | None:
    r = marduk_cli("monitor", "status", "--json", "--timeout", "1", env=env)
    if r.returncode != 0:
        return None
    return int(json.loads(r.stdout)["controller"]["pid"])


def test_two_controllers_one_serves_and_a_standby_takes_over(
    tmp_path, nats_server: NatsServer
) -> None:  # type: ignore[no-untyped-def]
    env = {"MARDUK_ADDR": nats_server.url, "PYTHONUNBUFFERED": "1"}
    # Started at once: exactly one wins the lease.
    a, b = start_controller(env, "a", str(tmp_path)), start_controller(env, "b", str(tmp_path))
    by_pid = {a.proc.pid: a, b.proc.pid: b}
    t = trainer(env, "r1", "d1,d2")
    try:
        eventually_sync(lambda: len(status(env)["standbys"]) == 1, timeout=20)
        s = status(env)
        first = s["controller"]
        assert first["role"] == "leader" and first["term"] >= 1
        assert s["standbys"][0]["role"] == "standby"
        assert s["standbys"][0]["pid"] != first["pid"]
        # One event, one decision, one command: the standby does not serve.
        out = inject(env, "d1")
        assert out.count("r1") == 1
        t.expect("COMMAND restart epoch=1 devices=d1")

        leader = by_pid[first["pid"]]
        standby = b if leader is a else a
        leader.stop(signal.SIGKILL)
        # The standby takes over (the lease lapses after its TTL, 2 s by default).
        eventually_sync(lambda: leader_pid(env) == standby.proc.pid, timeout=20)
        standby.expect("serving prefix")
        assert status(env)["controller"]["term"] > first["term"]
        # Targeted notices work again; the epoch continues above everything issued before.
        inject(env, "d2")
        line = t.expect("COMMAND restart epoch=")
        assert "devices=d2" in line and "epoch=1 " not in line
        assert len(commands_seen(t)) == 2, "".join(t.all)
        assert "Traceback" not in "".join(standby.all)
    finally:
        t.stop()
        a.stop()
        b.stop()


def test_events_published_while_no_controller_runs_are_handled_when_one_starts(
    tmp_path, nats_server: NatsServer
) -> None:  # type: ignore[no-untyped-def]
    import asyncio

    import nats

    env = {"MARDUK_ADDR": nats_server.url, "PYTHONUNBUFFERED": "1"}
    c1 = start_controller(env, "c1", str(tmp_path))
    c1.expect("serving prefix")
    t = trainer(env, "r1", "d1")
    c1.stop(signal.SIGKILL)

    async def publish() -> None:  # a plain publish, as `nats pub marduk.health '{...}'` does
        nc = await nats.connect(nats_server.url)
        await nc.publish(
            "marduk.health", b'{"device": "d1", "state": "failed", "reason": "XID 79"}'
        )
        await nc.flush()
        await nc.close()

    try:
        asyncio.run(publish())
        c2 = start_controller(env, "c2", str(tmp_path))
        c2.expect("serving prefix")
        line = t.expect("COMMAND restart epoch=")
        assert "devices=d1" in line
        c2.expect("restart_issued default/r1 device d1")
        c2.stop()
    finally:
        t.stop()


def test_embedded_nats_sigkill_is_survived(env: dict[str, str]) -> None:
    from tests.processes import controller

    controller_env = env
    ctl = controller(env)
    t = trainer(controller_env, "r1", "d1,d2")
    try:
        servers = [p for p in psutil.Process(ctl.proc.pid).children() if "nats-server" in p.name()]
        assert len(servers) == 1
        servers[0].kill()
        ctl.expect("starting it again")
        ctl.expect("embedded nats-server is back")
        # Agents reconnect and the controller leads again; notices work; nothing restarted.
        eventually_sync(lambda: leader_pid(controller_env) == ctl.proc.pid, timeout=20)
        workers = status(controller_env)["workers"]
        assert [w["replica"] for w in workers] == ["r1"]
        inject(controller_env, "d2")
        t.expect("COMMAND restart epoch=1 devices=d2")
        assert ctl.proc.poll() is None
        assert "Traceback" not in "".join(ctl.all)
    finally:
        t.stop()
        ctl.stop()


def test_a_controller_starts_when_the_first_listed_node_is_down(
    tmp_path, nats_server: NatsServer
) -> None:  # type: ignore[no-untyped-def]
    """On a cluster MARDUK_ADDR lists every node; a restarted controller must not crash-loop
    because the first one is down."""
    from tests.conftest import free_port

    dead = f"nats://127.0.0.1:{free_port()}"
    env = {"MARDUK_ADDR": f"{dead},{nats_server.url}", "PYTHONUNBUFFERED": "1"}
    c = start_controller(env, "c", str(tmp_path))
    try:
        c.expect("serving prefix")
    finally:
        c.stop()
