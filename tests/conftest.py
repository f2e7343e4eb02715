"""Fixtures shared by the three tiers, each a folder:

* ``tests/unit``: pure rules and the shells' logic without I/O: no process, no network socket
  (``tests/unit/conftest.py`` refuses both). ``make test-unit`` is the inner loop.
* ``tests/integration``: a real nats-server per test (fixtures below), local sockets, the CLI.
* ``tests/e2e``: real processes (agents, trainers, controllers, clusters) and the slow tests;
  everything there is marked ``e2e``.

Here: a real nats-server with JetStream per test, and a controller on it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from marduk.controller import Controller, ControllerSettings
from marduk.transport.embedded import find_binary, listening
from tests.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
E2E = Path(__file__).resolve().parent / "e2e"


# Under pytest-xdist (``make test``: 4 workers) the files below, which start multi-process
# trainers that keep a core busy, run one after another on one worker per kind (``--dist
# loadgroup``), so two meshes (or two sets of torch ranks, or of torchft groups) never fight
# for the cores while the other workers run the light tests; torch and torchft are two kinds
# because together they were the run's critical path. A test that needs the machine to itself
# (an upper bound on time, the machine-wide pid counter) is marked ``serial`` and runs alone,
# after the others.
HEAVY_GROUPS = {
    "jax": (
        "e2e/test_jax_distributed.py",
        "e2e/test_jax_replicas.py",
        "e2e/test_membership.py",
        "e2e/test_grow.py",
        "e2e/test_spares.py",
        "e2e/test_torch_faults.py",
    ),
    "torch": (
        "e2e/test_launcher.py",
        "e2e/test_torch_elastic.py",
        "e2e/test_spare_pools.py",
        "e2e/test_stragglers.py",
        "integration/test_agent_defaults.py",
    ),
    "torchft": (
        "e2e/test_torchft.py",
        "e2e/test_torchft_front.py",
        "integration/test_torchft_guard.py",
        "e2e/test_membership_failover.py",
        "e2e/test_local_snapshots.py",
    ),
}
_GROUP_OF = {name: group for group, names in HEAVY_GROUPS.items() for name in names}


def pytest_itemcollected(item: pytest.Item) -> None:
    """Everything under tests/e2e is an end-to-end test (``-m "not e2e"`` leaves it out); the
    heavy files are grouped for pytest-xdist (above). Marked as each test is collected: by
    ``pytest_collection_modifyitems`` pytest-xdist's worker may have read the groups already."""
    if E2E in item.path.parents:
        item.add_marker(pytest.mark.e2e)
    group = _GROUP_OF.get(f"{item.path.parent.name}/{item.path.name}")
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))


class NatsServer:
    """A nats-server process on a loopback port, with JetStream in ``store``."""

    def __init__(self, store: Path, port: int | None = None, args: list[str] | None = None) -> None:
        self.store = store
        self.port = port or free_port()
        self.args = args or []  # e.g. ["-c", "nats-server.conf"] or ["--user", "u", ...]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        cmd = [
            find_binary(),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.store),
            *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not listening("127.0.0.1", self.port, 0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nats-server did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def reload(self) -> None:
        """Re-read the configuration (SIGHUP), as `nats-server --signal reload` does."""
        import signal

        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "js").start()
    yield server
    server.stop()


def controller_settings(server: NatsServer, tmp_path: Path, **policy: object) -> ControllerSettings:
    from marduk.core.policy import PolicyConfig

    return ControllerSettings(
        addr=server.url,
        embedded=False,
        state_dir=tmp_path / "state",
        policy=PolicyConfig(**policy),  # type: ignore[arg-type]
    )


async def start_serving(c: Controller, timeout: float = 10.0) -> Controller:
    """Start a controller and wait until it leads and serves (the lease is taken)."""
    await c.start()
    await asyncio.wait_for(c.serving.wait(), timeout)
    return c


@pytest.fixture
async def controller(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Controller]:
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    yield c
    await c.stop()


async def health_event(  # type: ignore[no-untyped-def]
    nc, device: str, state: str = "failed", event_id: str = "", timeout: float = 5.0
):
    """Publish a health event durably (as monitors do) and return the controller's HealthReply."""
    from marduk.wire.protocol import DeviceHealth
    from marduk.wire.subjects import Subjects
    from monitor_cli.health import publish_durably

    event = DeviceHealth(device=device, state=state, event_id=event_id)  # type: ignore[arg-type]
    return await publish_durably(nc, Subjects(), event, timeout=timeout)


async def store_health(nc, payload: bytes, inbox: str = "") -> int:  # type: ignore[no-untyped-def]
    """Publish to the health stream and wait until it stored the event (it sends no ack);
    the controller's answer, if any, goes to ``inbox``. Returns the stream sequence."""
    from marduk.wire.subjects import Subjects
    from monitor_cli.health import store, watch_stored

    stored = await watch_stored(nc, Subjects())
    try:
        return await store(nc, Subjects(), payload, inbox or nc.new_inbox(), stored, timeout=5)
    finally:
        await stored.unsubscribe()


async def health_raw(nc, payload: bytes, timeout: float = 5.0) -> bytes:  # type: ignore[no-untyped-def]
    """Publish raw bytes to the health stream with a reply header; return the controller's answer."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=1)
    await store_health(nc, payload, inbox)
    msg = await sub.next_msg(timeout=timeout)
    return msg.data  # type: ignore[no-any-return]


async def eventually(predicate, timeout: float = 10.0, interval: float = 0.02) -> None:  # type: ignore[no-untyped-def]
    """Wait until ``predicate()`` is true; fail the test after ``timeout`` (no timing asserts)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)


def eventually_sync(predicate, timeout: float = 10.0, interval: float = 0.1) -> None:  # type: ignore[no-untyped-def]
    """``eventually`` for tests that drive real processes from plain (non-async) code."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


def marduk_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run the real ``marduk`` CLI in a subprocess."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "marduk", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for Marduk processes: a free loopback address and a private state dir."""
    yield {
        "MARDUK_ADDR": f"nats://127.0.0.1:{free_port()}",
        "MARDUK_STATE_DIR": str(tmp_path / "state"),
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture
def controller_env(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """``env`` with a ``marduk controller`` (embedded NATS) running for the test."""
    from tests.processes import controller

    ctl = controller(env)
    yield env
    ctl.stop()


@pytest.fixture(autouse=True)
def _no_framework_preload(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent's pre-spawned trainer imports jax by default (torch for a torch script): 4 s of
    a core per agent start, for trainers here that are plain python. So the agents these tests
    start preload nothing unless a test says ``--preload``; the jax files keep the default (their
    trainers import jax, their restarts are meant to be warm), and so does a test marked
    ``framework_preload`` (one that checks the default itself)."""
    jax_file = _GROUP_OF.get(f"{request.path.parent.name}/{request.path.name}") == "jax"
    if not jax_file and request.node.get_closest_marker("framework_preload") is None:
        monkeypatch.setenv("MARDUK_PRELOAD", "none")


@pytest.fixture(autouse=True)
def _reap_processes() -> Iterator[None]:
    """No test leaves a process behind, even one that failed before its own cleanup."""
    yield
    from tests.processes import Proc

    Proc.reap_all()


# --- what a hung test was waiting for -------------------------------------------------------
# pytest-timeout's report shows the threads' stacks; in an asyncio test those end in
# selector.poll and say nothing. Shortly before the timeout, every unfinished task's await
# chain (coroutine frames down to the future it waits on) is written to stderr, which the
# failure report shows under "Captured stderr".


def _await_chain(awaitable: object) -> list[str]:
    lines, seen = [], 0
    while awaitable is not None and seen < 50:
        seen += 1
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f"    {code.co_filename}:{frame.f_lineno} {code.co_qualname}")
            awaitable = getattr(awaitable, "cr_await", None) or getattr(
                awaitable, "gi_yieldfrom", None
            )
        elif isinstance(awaitable, asyncio.Task):
            lines.append(f"    -> task {awaitable.get_name()}")
            break
        else:
            lines.append(f"    -> {awaitable!r}"[:300])
            break
    return lines


def _dump_tasks(test: str) -> None:
    from asyncio import tasks as _tasks

    for _ in range(5):
        try:
            pending = [t for t in list(_tasks._all_tasks) if not t.done()]  # type: ignore[attr-defined]
            break
        except RuntimeError:  # the set changed while copied
            continue
    else:
        pending = []
    out = [f"=== {len(pending)} unfinished asyncio tasks in {test}, near its timeout ==="]
    for task in pending:
        out.append(f"task {task.get_name()}:")
        out.extend(_await_chain(task.get_coro()))
    sys.stderr.write("\n".join(out) + "\n")
    sys.stderr.flush()


@pytest.fixture(autouse=True)
def _dump_tasks_before_timeout(request: pytest.FixtureRequest) -> Iterator[None]:
    import threading

    marker = request.node.get_closest_marker("timeout")
    limit = (
        float(marker.args[0])
        if marker and marker.args
        else float(request.config.getini("timeout") or 0)
    )
    if limit <= 15:
        yield
        return
    timer = threading.Timer(limit - 8, _dump_tasks, args=(request.node.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# --- where the suite's CPU goes --------------------------------------------------------------
# MARDUK_TEST_CPU=FILE appends, per test: its id, wall seconds, and the CPU seconds of the test
# process and of the processes it started and reaped (servers, agents, their trainers: a
# process's reaped descendants count in its children's times). The suite is CPU-bound on 2
# cores, so this, not --durations, says which tests to make cheaper.


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = os.environ.get("MARDUK_TEST_CPU")
    if not path:
        yield
        return
    before, t0 = os.times(), time.monotonic()
    yield
    after, wall = os.times(), time.monotonic() - t0
    own = after.user + after.system - before.user - before.system
    children = (
        after.children_user + after.children_system - before.children_user - before.children_system
    )
    with open(path, "a") as f:
        f.write(f"{own + children:.2f}\t{own:.2f}\t{children:.2f}\t{wall:.2f}\t{item.nodeid}\n")
