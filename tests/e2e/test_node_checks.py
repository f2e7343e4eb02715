"""The node's checks before a start, with real processes (agent/supervise/start_checks.py):
a node the node check service calls unhealthy is kept out of a ``--nnodes`` job and a spare
takes its place, it takes part once it passes again, and a member whose node fails its checks
after a device failure is replaced; a missing storage path, or one that hangs, fails the start
with its reason."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import NatsServer, eventually_sync, marduk_cli
from tests.e2e.test_membership_failover import env_for, job_info
from tests.elastic_job import ElasticJob
from tests.processes import Proc, status

pytestmark = pytest.mark.e2e

SICK = "gpu 1: xid 79"


class NodeCheckService:
    """A node health check service on a unix socket (docs/protocol.md, *Node check*):
    unhealthy for the replicas in ``sick`` (after ``healthy_first`` healthy answers), healthy
    for the others."""

    def __init__(self, path: str, sick: set[str], healthy_first: int = 0) -> None:
        self.path, self.sick, self.healthy_first = path, sick, healthy_first
        self.asked: list[str] = []
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(path)
        self.sock.listen()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rwb") as f:
                request = json.loads(f.readline())
                self.asked.append(request["replica"])
                healthy = request["replica"] not in self.sick or (
                    self.asked.count(request["replica"]) <= self.healthy_first
                )
                f.write(json.dumps({"healthy": healthy, "reason": SICK}).encode() + b"\n")
                f.flush()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A directory with a short path (a unix socket's path has ~100 bytes at most)."""
    d = tempfile.mkdtemp(prefix="nhc-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_an_unhealthy_node_is_kept_out_and_a_spare_takes_its_place(
    tmp_path: Path, nats_server: NatsServer, short_dir: str
) -> None:
    service = NodeCheckService(os.path.join(short_dir, "nhc.sock"), sick={"b"})
    env = env_for(nats_server, MARDUK_JOIN_TIMEOUT="1")
    job = ElasticJob(env, tmp_path, "nhc", "2:2", controllers=1)
    check = ("--node-check-endpoint", service.path, "--no-prespawn", "--check-interval", "1")
    try:
        job.controllers[0].expect("serving prefix", timeout=60)
        job.start("a", *check)
        job.start("b", *check)
        job.start("s", "--spare", *check)
        job.formed(("a", "s"))  # b's place: the spare's
        assert not job.starts("b") and set(service.asked) == {"a", "b", "s"}
        assert service.asked.count("a") == service.asked.count("s") == 1  # b: every second
        job.agents["b"].expect(f"failed its checks before the first start: node check: {SICK}")
        now = status(env)
        [b] = [w for w in now["workers"] if w["replica"] == "b"]
        assert (b["part"], b["unhealthy"]) == ("unhealthy", f"node check: {SICK}")
        # Listed with the free workers as a drained one is, unusable, and why.
        [info] = [j for j in now["jobs"] if j["job"] == "nhc"]
        assert info["spares"] == [f"b/0 (unusable: node unhealthy: node check: {SICK})"]
        text = marduk_cli("monitor", "status", "--job", "nhc", env=env).stdout
        assert f"unhealthy: node check: {SICK}" in text, text

        # b passes again (it checks every --check-interval): a free worker, usable. Then a
        # device of member a fails and a's node fails its checks before the restart: a is
        # retired at once and b takes its ranks.
        service.sick = {"a"}
        job.agents["b"].expect("this node passed its checks again", timeout=30)
        eventually_sync(lambda: job_info(env, "nhc")["spares"] == ["b/0"], timeout=30)
        ranks = {r: int(job.starts(r)[-1]["GROUP_RANK"]) for r in ("a", "s")}
        r = marduk_cli("monitor", "inject-failure", "nhc-a", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        job.wait({"b": (ranks["a"], 2), "s": (ranks["s"], 2)}, timeout=60)
        assert job.agents["a"].proc.wait(timeout=60) == 71
        assert any(
            f"failed its checks after device(s) nhc-a: node check: {SICK}" in line
            for line in job.agents["a"].all
        ), job.output()
        job.check_epochs_forward()
    finally:
        job.stop()
        service.close()


def agent(env: dict[str, str], *options: str, trainer: tuple[str, ...] = ("true",)) -> Proc:
    cmd = [sys.executable, "-m", "marduk", "agent", "run", "--standalone", "--replica", "r"]
    return Proc([*cmd, "--devices", "d0", *options, "--", *trainer], env)


def test_a_node_unhealthy_after_a_device_fault_is_not_restarted_onto(
    env: dict[str, str], short_dir: str
) -> None:
    """Healthy at the start; the trainer dies of an ECC error (a device-class failure), and
    the service now says unhealthy: no restart, exit 71 (its ranks are its own: nobody else
    can take them)."""
    service = NodeCheckService(os.path.join(short_dir, "nhc.sock"), {"r"}, healthy_first=1)
    ecc = "import sys; print('uncorrectable ECC error', flush=True); sys.exit(1)"
    try:
        p = agent(
            env,
            *("--node-check-endpoint", service.path, "--no-prespawn"),
            trainer=(sys.executable, "-c", ecc),
        )
        assert p.proc.wait(timeout=60) == 71
        out = "".join(p.all)
        assert f"failed its checks after gpu_ecc: node check: {SICK}" in out, out
        assert out.count("trainer started") == 1 and service.asked == ["r", "r"]
    finally:
        service.close()


def test_a_missing_storage_path_fails_the_start_with_its_reason(
    env: dict[str, str], tmp_path: Path
) -> None:
    missing = tmp_path / "ckpt"
    p = agent(env, "--storage-check", f"{tmp_path}:rw", "--storage-check", str(missing))
    assert p.proc.wait(timeout=60) == 71
    out = "".join(p.all)
    assert f"failed its checks before the first start: storage: {missing}: missing" in out, out
    assert "Traceback" not in out and "trainer started" not in out


def test_a_hung_storage_check_times_out(env: dict[str, str], short_dir: str) -> None:
    """Opening a FIFO nobody writes blocks, as a hung NFS mount does: the check's child is
    killed at --check-timeout and the start fails, the agent never hung."""
    fifo = os.path.join(short_dir, "hung")
    os.mkfifo(fifo)
    p = agent(env, "--storage-check", fifo, "--check-timeout", "1")
    assert p.proc.wait(timeout=60) == 71
    out = "".join(p.all)
    assert f"storage: {fifo}: no answer within 1s (a hung mount?)" in out, out
    eventually_sync(lambda: not _probes_left(fifo), timeout=10)


def _probes_left(fifo: str) -> list[int]:
    """Storage probes still running on ``fifo`` (none: the killed one was reaped)."""
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"storage_probe" in cmdline and fifo.encode() in cmdline:
            left.append(int(pid))
    return left
