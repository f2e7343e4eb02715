"""The acceptance scenario with real processes, as a new user would run it.

``marduk controller`` on its embedded NATS; two demo trainers register r1 on d1,d2 and r2 on
d2,d3; the real ``marduk monitor`` CLI injects failures; then the controller is SIGKILLed and
started again.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import free_port, marduk_cli
from tests.processes import Proc, commands_seen, controller, inject, status, trainer

pytestmark = pytest.mark.e2e


commands = commands_seen


def test_acceptance_targeted_notices_and_restart(env: dict[str, str]) -> None:
    ctl = controller(env)
    r1 = trainer(env, "r1", "d1,d2")
    r2 = trainer(env, "r2", "d2,d3")
    try:
        workers = {(w["replica"], tuple(w["devices"])) for w in status(env)["workers"]}
        assert workers == {("r1", ("d1", "d2")), ("r2", ("d2", "d3"))}

        out = inject(env, "d3")
        assert "r2" in out and "r1" not in out
        r2.expect("COMMAND restart epoch=1 devices=d3")

        out = inject(env, "d2")
        assert "r1" in out and "r2" in out
        r1.expect("COMMAND restart epoch=1 devices=d2")
        r2.expect("COMMAND restart epoch=2 devices=d2")

        r = marduk_cli("monitor", "inject-failure", "d-unknown", env=env)
        assert r.returncode == 3 and "unknown" in r.stdout  # exit 3: nobody uses it

        # SIGKILL the controller (and so its embedded NATS): no orphaned server is left.
        server_pids = [
            c.pid for c in psutil.Process(ctl.proc.pid).children() if "nats-server" in c.name()
        ]
        assert server_pids
        ctl.stop(signal.SIGKILL)
        for pid in server_pids:
            try:
                psutil.Process(pid).wait(10)
            except psutil.NoSuchProcess:
                pass

        ctl = controller(env)
        workers = {(w["replica"], tuple(w["devices"])) for w in status(env)["workers"]}
        assert workers == {("r1", ("d1", "d2")), ("r2", ("d2", "d3"))}
        out = inject(env, "d1")
        assert "r1" in out and "r2" not in out
        # Epochs continue above the block reserved before the kill (no reuse, gaps allowed).
        r1.expect("COMMAND restart epoch=101 devices=d1")
        out = inject(env, "d3")
        r2.expect("COMMAND restart epoch=101 devices=d3")
        # Each trainer got exactly its own commands, in order: had d3 reached r1, or the
        # unknown device anyone, an extra line would stand here (no sleep needed to see it).
        assert commands(r1) == ["epoch=1 devices=d2", "epoch=101 devices=d1"]
        assert commands(r2) == ["epoch=1 devices=d3", "epoch=2 devices=d2", "epoch=101 devices=d3"]
    finally:
        r1.stop()
        r2.stop()
        ctl.stop()
    assert ctl.proc.returncode == 0, "".join(ctl.all)


def test_cli_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    env = {"MARDUK_ADDR": f"nats://127.0.0.1:{free_port()}"}
    for args in (
        ["monitor", "status"],
        ["monitor", "inject-failure", "d1"],
        ["monitor", "watch", "--count", "1"],
    ):
        r = marduk_cli(*args, env=env)
        assert r.returncode == 1
        assert "Traceback" not in r.stderr
        assert r.stderr.strip().startswith("error: cannot connect to NATS")


def test_cli_without_controller_says_so(tmp_path: Path) -> None:
    from tests.conftest import NatsServer

    server = NatsServer(tmp_path / "js").start()
    try:
        r = marduk_cli(
            "monitor", "inject-failure", "d1", "--timeout", "1", env={"MARDUK_ADDR": server.url}
        )
        assert r.returncode == 1 and "Traceback" not in r.stderr
        # No controller ever ran here, so nothing stores health events: said in one line.
        assert "has a Marduk controller ever run" in r.stderr
        r = marduk_cli("monitor", "status", "--timeout", "1", env={"MARDUK_ADDR": server.url})
        assert r.returncode == 1 and "no Marduk controller answered" in r.stderr
    finally:
        server.stop()


def test_controller_refuses_remote_address_without_server(tmp_path: Path) -> None:
    r = marduk_cli(
        "controller",
        env={"MARDUK_ADDR": "nats://192.0.2.1:4222", "MARDUK_STATE_DIR": str(tmp_path)},
        timeout=30,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "not on this machine" in r.stderr


def test_controller_no_embedded_and_second_controller_on_same_state(env: dict[str, str]) -> None:
    r = marduk_cli("controller", "--no-embedded", env=env)
    assert r.returncode == 1 and "--no-embedded" in r.stderr
    ctl = controller(env)
    try:
        # Same address now answers: a second controller joins that server (no second embedded).
        second = Proc([sys.executable, "-m", "marduk", "controller"], env)
        second.expect("using the NATS server")
        second.stop()
    finally:
        ctl.stop()


def test_watch_streams_registrations_and_restarts(env: dict[str, str]) -> None:
    ctl = controller(env)
    watch = Proc(
        [sys.executable, "-m", "marduk", "monitor", "watch", "--json", "--count", "2"], env
    )
    watch.expect("watching controller events")  # subscribed: nothing after this is missed
    r1 = trainer(env, "r1", "d1")
    try:
        inject(env, "d1")
        assert watch.proc.wait(20) == 0
        kinds = [json.loads(line)["kind"] for line in watch.all if line.startswith("{")]
        assert kinds == ["registered", "restart_issued"]
    finally:
        r1.stop()
        watch.stop()
        ctl.stop()
