"""``marduk monitor run``: the pure ConditionTracker, the daemon against a real nats-server and
controller, and the CLI (in-process with typer's runner, and as a real process)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import agent
from marduk.controller import Controller
from marduk.wire.protocol import DeviceHealth, decode, encode
from monitor_cli import client, run_cli
from monitor_cli.conditions import SEVERITY, ConditionTracker
from monitor_cli.daemon import DaemonSettings, MonitorDaemon
from monitor_cli.probes.base import Condition, Emit
from tests.conftest import ROOT, NatsServer, eventually, free_port

T0 = 1_700_000_000.0


def C(device: str, state: str, key: str, reason: str = "") -> Condition:
    return Condition(device, state, key, reason or f"{key} on {device}")  # type: ignore[arg-type]


def states(events: list[DeviceHealth]) -> list[tuple[str, str]]:
    return [(e.device, e.state) for e in events]


# --- the tracker (pure) ------------------------------------------------------------------------


def test_start_then_unchanged_intervals_say_nothing() -> None:
    t = ConditionTracker("h1")
    [e] = t.observe("nvml", [C("GPU-a", "failed", "xid:79", "XID 79: off the bus")], T0)
    assert (e.device, e.state, e.reason, e.source) == (
        "GPU-a",
        "failed",
        "XID 79: off the bus",
        "nvml@h1",
    )
    assert e.event_id == f"nvml@h1:GPU-a:xid:79:{int(T0 * 1000)}" and e.timestamp == T0
    # The wire's strict decoding (what the controller applies) accepts it.
    assert decode(encode(e), DeviceHealth) == e
    assert t.observe("nvml", [C("GPU-a", "failed", "xid:79", "XID 79: off the bus")], T0 + 1) == []
    # A reworded reason of the same condition is no news either.
    assert t.observe("nvml", [C("GPU-a", "failed", "xid:79", "XID 79 again")], T0 + 2) == []


def test_worsen_improve_clear() -> None:
    t = ConditionTracker("h")
    d = "GPU-a"
    assert states(t.observe("p", [C(d, "degraded", "throttle")], T0)) == [(d, "degraded")]
    # worse: a new condition at the new worst state
    [e] = t.observe("p", [C(d, "degraded", "throttle"), C(d, "failed", "ecc")], T0 + 1)
    assert e.state == "failed" and ":ecc:" in e.event_id
    # better: the failed condition cleared, the degraded one remains
    [e] = t.observe("p", [C(d, "degraded", "throttle")], T0 + 2)
    assert e.state == "degraded" and "cleared: ecc on GPU-a" in e.reason
    assert e.event_id == f"p@h:{d}:degraded:{int((T0 + 2) * 1000)}"
    # clear: the last condition went away
    [e] = t.observe("p", [], T0 + 3)
    assert e.state == "healthy" and e.event_id == f"p@h:{d}:healthy:{int((T0 + 3) * 1000)}"
    assert t.state(d) == "healthy" and t.conditions() == []
    assert t.observe("p", [], T0 + 4) == []  # healthy stays quiet


def test_severity_order_failed_over_preempting_over_degraded() -> None:
    t = ConditionTracker("h")
    d = "h:tpu:0"
    assert states(t.observe("p", [C(d, "degraded", "a")], T0)) == [(d, "degraded")]
    conds = [C(d, "degraded", "a"), C(d, "preempting", "b")]
    assert states(t.observe("p", conds, T0 + 1)) == [(d, "preempting")]
    assert states(t.observe("p", [*conds, C(d, "failed", "c")], T0 + 2)) == [(d, "failed")]
    assert states(t.observe("p", conds, T0 + 3)) == [(d, "preempting")]


def test_lesser_condition_under_a_worse_one_is_not_news_however_it_flaps() -> None:
    t = ConditionTracker("h")
    d = "GPU-a"
    t.observe("p", [C(d, "failed", "lost")], T0)
    for i in range(5):  # degraded comes and goes under failed: the device's state never changes
        assert (
            t.observe("p", [C(d, "failed", "lost"), C(d, "degraded", "hot")], T0 + 2 * i + 1) == []
        )
        assert t.observe("p", [C(d, "failed", "lost")], T0 + 2 * i + 2) == []
    # A second condition as bad as the worst is news: a new fact about a failed device.
    [e] = t.observe("p", [C(d, "failed", "lost"), C(d, "failed", "xid:48")], T0 + 20)
    assert e.state == "failed" and ":xid:48:" in e.event_id


def test_flapping_is_damped_by_clear_after() -> None:
    t = ConditionTracker("h", clear_after_s=30)
    d = "GPU-a"
    assert states(t.observe("p", [C(d, "degraded", "hot")], T0)) == [(d, "degraded")]
    for i in range(1, 9):  # every 5 s present or absent, ending absent: held, one condition
        assert t.observe("p", [C(d, "degraded", "hot")] if i % 2 else [], T0 + 5 * i) == []
    assert t.tick(T0 + 50) == []  # absent since T0 + 40: not yet 30 s
    assert t.conditions(d) == [C(d, "degraded", "hot")]
    [e] = t.tick(T0 + 71)
    assert e.state == "healthy"
    assert t.tick(T0 + 72) == [] and t.observe("p", [], T0 + 73) == []
    # Coming back after it cleared is a new start, with a new id.
    [e2] = t.observe("p", [C(d, "degraded", "hot")], T0 + 80)
    assert e2.state == "degraded" and e2.event_id.endswith(str(int((T0 + 80) * 1000)))


def test_same_key_changing_state_is_a_new_condition() -> None:
    t = ConditionTracker("h")
    d = "GPU-a"
    [a] = t.observe("p", [C(d, "degraded", "ecc")], T0)
    [b] = t.observe("p", [C(d, "failed", "ecc")], T0 + 1)
    [c] = t.observe("p", [C(d, "degraded", "ecc")], T0 + 2)
    assert [a.state, b.state, c.state] == ["degraded", "failed", "degraded"]
    assert len({a.event_id, b.event_id, c.event_id}) == 3


def test_two_probes_on_one_device() -> None:
    t = ConditionTracker("h")
    d = "GPU-a"
    [e] = t.observe("node", [C(d, "degraded", "node:DiskPressure")], T0)
    assert e.source == "node@h"
    # Another probe's condition on the same device; its keys live apart from the first's.
    [e] = t.observe("nvml", [C(d, "failed", "node:DiskPressure")], T0 + 1)
    assert (e.state, e.source) == ("failed", "nvml@h")
    # The first probe's report does not clear the second's condition.
    assert t.observe("node", [C(d, "degraded", "node:DiskPressure")], T0 + 2) == []
    [e] = t.observe("nvml", [], T0 + 3)
    assert e.state == "degraded" and e.source == "node@h"
    [e] = t.observe("node", [], T0 + 4)
    assert e.state == "healthy" and e.source == "node@h"


def test_several_devices_one_event_each_sorted() -> None:
    t = ConditionTracker("h")
    conds = [C(d, "failed", k) for d in ("b", "a") for k in ("node:ready", "taint:x")]
    events = t.observe("node", conds, T0)
    assert states(events) == [("a", "failed"), ("b", "failed")]
    assert events[0].reason == "node:ready on a; taint:x on a"


def test_probe_failure_is_not_a_device_condition_by_default() -> None:
    t = ConditionTracker("h", clear_after_s=10)
    d = "GPU-a"
    t.observe("p", [C(d, "failed", "lost")], T0)
    t.observe("p", [], T0 + 1)  # absent: held for 10 s
    assert t.probe_failed("p", "boom", T0 + 2, [d]) == []
    assert t.failing("p") == 1
    # A failing probe cannot say its conditions cleared: the hold does not expire meanwhile.
    assert t.tick(T0 + 100) == [] and t.state(d) == "failed"
    assert t.probe_failed("p", "boom", T0 + 101, [d]) == [] and t.failing("p") == 2
    assert t.observe("p", [C(d, "failed", "lost")], T0 + 102) == []  # it held all along
    assert t.failing("p") == 0


def test_probe_failure_reported_as_degraded_when_configured() -> None:
    t = ConditionTracker("h", probe_error_state="degraded", clear_after_s=30)
    t.observe("other", [C("a", "failed", "x")], T0)
    events = t.probe_failed("node", "HTTP 403", T0 + 1, ["a", "b"])
    # "a" is failed already (a lesser condition under it is no news); "b" becomes degraded.
    assert states(events) == [("b", "degraded")]
    assert "probe node cannot observe this host: HTTP 403" in events[0].reason
    for i in range(10):  # a failing probe does not flood
        assert t.probe_failed("node", "HTTP 403", T0 + 2 + i, ["a", "b"]) == []
    # It works again: its error condition clears at once (no hold for probe errors).
    assert states(t.observe("node", [], T0 + 20)) == [("b", "healthy")]


def test_invalid_device_ids_are_dropped_and_counted() -> None:
    t = ConditionTracker("h")
    assert t.observe("p", [C("has space", "failed", "k"), C("", "failed", "k")], T0) == []
    assert t.stats["conditions.invalid"] == 2


def test_long_ids_are_shortened_to_fit_the_wire() -> None:
    t = ConditionTracker("h" * 200)
    [e] = t.observe("p", [C("d" * 200, "failed", "k" * 100, "r" * 5000)], T0)
    assert len(e.event_id) <= 256 and len(e.source) <= 256 and len(e.reason) == 4096
    assert decode(encode(e), DeviceHealth) == e


observations = st.lists(
    st.tuples(
        st.sampled_from(["p1", "p2"]),
        st.lists(
            st.tuples(
                st.sampled_from(["d1", "d2"]),
                st.sampled_from(["failed", "degraded", "preempting"]),
                st.sampled_from(["k1", "k2", "k3"]),
            ),
            max_size=4,
        ),
    ),
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(observations)
def test_invariants_over_random_inputs(seq: list[tuple[str, list[tuple[str, str, str]]]]) -> None:
    """Whatever the probes say: ids are unique, a repeat says nothing, and what was last
    published for a device is its worst current condition (or healthy)."""
    t = ConditionTracker("h")
    ids: set[str] = set()
    now = T0
    last: dict[str, dict[str, list[Condition]]] = {}
    for probe, raw in seq:
        now += 1
        conds = [C(d, s, k) for d, s, k in raw]
        events = t.observe(probe, conds, now)
        last.setdefault(probe, {})
        last[probe] = {"c": conds}
        for e in events:
            assert e.event_id not in ids
            ids.add(e.event_id)
        assert len({e.device for e in events}) == len(events)  # one event per device per call
        now += 1
        assert t.observe(probe, conds, now) == []
        for d in ("d1", "d2"):
            current = [c for p in last.values() for c in p["c"] if c.device == d]
            worst = max((SEVERITY[c.state] for c in current), default=0)
            assert SEVERITY[t.state(d)] == worst


# --- the daemon, against a real nats-server and controller -------------------------------------


class ScriptedProbe:
    """An EventProbe whose conditions the test pushes."""

    def __init__(self, name: str = "script") -> None:
        self.name = name
        self.queue: asyncio.Queue[list[Condition]] = asyncio.Queue()

    async def watch(self, emit: Emit) -> None:
        while True:
            await emit(await self.queue.get())


class FlakyPoll:
    """A polled Probe that raises while ``broken`` and reports ``conditions`` otherwise."""

    def __init__(self, name: str = "flaky") -> None:
        self.name = name
        self.interval_s = 0.05
        self.broken = True
        self.conditions: list[Condition] = []
        self.calls = 0

    async def check(self) -> list[Condition]:
        self.calls += 1
        if self.broken:
            raise RuntimeError("cannot reach the thing")
        return list(self.conditions)


class CrashingWatch:
    name = "crashy"

    def __init__(self) -> None:
        self.starts = 0

    async def watch(self, emit: Emit) -> None:
        self.starts += 1
        raise OSError("device went away")


def fast(url: str, **kw: Any) -> DaemonSettings:
    defaults: dict[str, Any] = dict(
        addr=url,
        host="h1",
        publish_timeout_s=3.0,
        connect_timeout_s=1.0,
        retry_initial_s=0.1,
        retry_max_s=0.5,
        restart_initial_s=0.05,
        restart_max_s=0.2,
    )
    return DaemonSettings(**{**defaults, **kw})


async def device_state(url: str, device: str) -> str | None:
    reply = await client.query(url, "marduk", "devices")
    return next((d.state for d in reply.devices if d.device == device), None)


async def test_condition_restarts_the_right_replica_then_clears_to_healthy(
    controller: Controller, nats_server: NatsServer
) -> None:
    url = nats_server.url
    r1 = await agent.connect_async("r1", ["dev-a"], addr=url, timeout=5)
    r2 = await agent.connect_async("r2", ["dev-b"], addr=url, timeout=5)
    probe = ScriptedProbe()
    daemon = MonitorDaemon([probe], fast(url))
    await daemon.start()
    try:
        await probe.queue.put([C("dev-a", "failed", "xid:79", "XID 79: off the bus")])
        cmd = await r1.wait(10)
        assert cmd is not None and (cmd.kind, cmd.devices) == ("restart", ("dev-a",))
        assert await r1.ack()
        assert await device_state(url, "dev-a") == "failed"
        await probe.queue.put([C("dev-a", "failed", "xid:79", "XID 79: still")])  # no news
        await probe.queue.put([])
        await eventually(lambda: daemon.stats["events.published"] == 2 and daemon.pending == 0)
        assert await device_state(url, "dev-a") == "healthy"
        assert r2.last_failure is None and r2.epoch == 0  # the other replica was left alone
        assert daemon.stats["events.queued"] == 2
    finally:
        await daemon.stop()
        await r1.close()
        await r2.close()


async def test_nats_going_away_loses_nothing(tmp_path: Path) -> None:
    from tests.conftest import controller_settings, start_serving

    server = NatsServer(tmp_path / "js").start()
    ctl = await start_serving(Controller(controller_settings(server, tmp_path)))
    r1 = await agent.connect_async("r1", ["dev-a"], addr=server.url, timeout=5)
    probe = ScriptedProbe()
    daemon = MonitorDaemon([probe], fast(server.url))
    await daemon.start()
    try:
        await probe.queue.put([C("dev-a", "degraded", "hot")])
        await eventually(lambda: daemon.stats["events.published"] == 1)
        server.stop()
        await eventually(lambda: daemon.stats["nats.disconnects"] >= 1)
        # While NATS is away: failed, then healthy. Both must arrive, in this order.
        await probe.queue.put([C("dev-a", "failed", "xid:48", "XID 48: double-bit ECC")])
        await probe.queue.put([])
        await eventually(lambda: daemon.stats["publish.retries"] >= 1)
        assert daemon.pending == 2
        await asyncio.sleep(0.5)
        server.start()
        await eventually(lambda: daemon.pending == 0, timeout=30)
        assert daemon.stats["events.published"] == 3
        assert daemon.stats["events.rejected"] == 0
        cmd = await r1.wait(15)  # the failed event restarted the replica after all
        assert cmd is not None and cmd.kind == "restart" and cmd.devices == ("dev-a",)
        assert await device_state(server.url, "dev-a") == "healthy"  # and healthy came after
    finally:
        await daemon.stop()
        await r1.close()
        await ctl.stop()
        server.stop()


async def test_probe_failures_never_crash_nor_flood(
    controller: Controller, nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    flaky, crashy = FlakyPoll(), CrashingWatch()
    daemon = MonitorDaemon([flaky, crashy], fast(nats_server.url, devices=["dev-a"]))
    caplog.set_level("INFO", logger="monitor_cli")
    await daemon.start()
    try:
        await eventually(lambda: flaky.calls >= 5 and crashy.starts >= 3)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert sum("probe flaky failed" in w for w in warnings) == 1  # logged once per streak
        assert sum("probe crashy failed" in w for w in warnings) == 1
        assert daemon.stats["probe.flaky.errors"] >= 5
        assert daemon.stats["probe.crashy.restarts"] >= 2
        assert daemon.stats["events.queued"] == 0  # not reported: probe_error_state is None
        flaky.broken = False
        flaky.conditions = [C("dev-a", "degraded", "x")]
        await eventually(lambda: daemon.stats["events.published"] == 1)
        assert any("probe flaky works again" in r.getMessage() for r in caplog.records)
        assert all(not t.done() for t in daemon._tasks)
    finally:
        await daemon.stop()


async def test_probe_errors_reported_as_degraded_when_asked(
    controller: Controller, nats_server: NatsServer
) -> None:
    r1 = await agent.connect_async("r1", ["dev-a"], addr=nats_server.url, timeout=5)
    flaky = FlakyPoll()
    daemon = MonitorDaemon(
        [flaky], fast(nats_server.url, devices=["dev-a"], probe_error_state="degraded")
    )
    await daemon.start()
    try:
        await eventually(lambda: flaky.calls >= 5 and daemon.stats["events.published"] == 1)
        assert await device_state(nats_server.url, "dev-a") == "degraded"
        assert r1.last_failure is None  # degraded restarts nothing (by default)
        flaky.broken = False
        await eventually(lambda: daemon.stats["events.published"] == 2)
        assert await device_state(nats_server.url, "dev-a") == "healthy"
    finally:
        await daemon.stop()
        await r1.close()


async def test_stop_reports_what_could_not_be_published(caplog: pytest.LogCaptureFixture) -> None:
    probe = ScriptedProbe()
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens
    daemon = MonitorDaemon([probe], fast(url, connect_timeout_s=0.2, drain_timeout_s=0.3))
    await daemon.start()
    await probe.queue.put([C("dev-a", "failed", "k")])
    await eventually(lambda: daemon.stats["publish.retries"] >= 1)
    await daemon.stop()
    await daemon.stop()  # twice is safe
    assert daemon.stats["events.unpublished_at_stop"] == 1
    assert any("not published" in r.getMessage() for r in caplog.records)


def test_duplicate_probe_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        MonitorDaemon([ScriptedProbe("a"), ScriptedProbe("a")], DaemonSettings())


# --- the CLI -----------------------------------------------------------------------------------

runner = CliRunner()


def test_help_explains_each_probe() -> None:
    result = runner.invoke(run_cli.app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for word in ("nvml", "tpu", "node", "XID", "--probe", "--devices", "--addr", "--nkey"):
        assert word in result.output


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--probe", "bogus"], 2, "unknown probe 'bogus'"),
        (["--probe", "node"], 2, "needs the node's name"),
        (["--probe", "node", "--node-name", "n1"], 1, "KUBERNETES_SERVICE_HOST unset"),
        (["--probe", "tpu"], 1, "no TPU chip on this host"),
        (["--probe", "nvml", "--host", "a b"], 2, "must be printable"),
    ],
)
def test_errors_are_one_line(args: list[str], code: int, message: str) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "", "NODE_NAME": "", "MARDUK_DEVICES": ""}
    if "tpu" in args and run_cli.detect_probes().count("tpu"):
        pytest.skip("this machine has TPU chips")
    result = runner.invoke(run_cli.app, args, env=env)
    assert result.exit_code == code, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_no_probe_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(run_cli, "detect_probes", lambda: [])
    result = runner.invoke(run_cli.app, [])
    assert result.exit_code == 1 and "no probe can run here" in result.output


@pytest.mark.parametrize(
    ("args", "probe"),
    [
        (["--dcgm-url", "http://127.0.0.1:9/metrics"], "DcgmExporterProbe"),
        (["--gce-metadata-url", "http://127.0.0.1:9"], "GceMetadataProbe"),
    ],
)
def test_a_probe_url_alone_enables_its_probe(
    monkeypatch: pytest.MonkeyPatch, args: list[str], probe: str
) -> None:
    """`monitor run --dcgm-url URL` exited 1, "no probe can run here ... no
    --dcgm-url"; only --probe dcgm or the variable enabled it."""
    monkeypatch.setattr(run_cli, "detect_probes", lambda: [])
    built: list[Any] = []
    monkeypatch.setattr(run_cli, "run_loop", lambda coro: coro.close())
    monkeypatch.setattr(run_cli, "setup_logging", lambda **kw: None)
    real = run_cli._daemon

    def daemon(*a: Any, **kw: Any) -> Any:
        d = real(*a, **kw)
        built.extend(type(p).__name__ for p in d.probes)
        return d

    monkeypatch.setattr(run_cli, "_daemon", daemon)
    result = runner.invoke(run_cli.app, args)
    assert result.exit_code == 0, result.output
    assert probe in built
    # Named probes stay what was named: the URL only configures them.
    built.clear()
    result = runner.invoke(run_cli.app, [*args, "--probe", "tpu", "--tpu-chips", "1"])
    assert result.exit_code == 0, result.output
    assert built == ["TpuProbe"]


def test_detect_probes_does_not_raise() -> None:
    assert set(run_cli.detect_probes()) <= set(run_cli.PROBES)


# A node as GET /api/v1/nodes/<name> returns it (trimmed to what the probe reads).
def node_json(ready: str) -> dict[str, Any]:
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": "n1"},
        "spec": {},
        "status": {
            "conditions": [
                {
                    "type": "MemoryPressure",
                    "status": "False",
                    "reason": "KubeletHasSufficientMemory",
                },
                {
                    "type": "Ready",
                    "status": ready,
                    "reason": "KubeletReady" if ready == "True" else "KubeletNotReady",
                    "message": "container runtime is down"
                    if ready != "True"
                    else "kubelet is posting ready status",
                },
            ]
        },
    }


@pytest.fixture
def node_api() -> Iterator[dict[str, Any]]:
    state: dict[str, Any] = {"node": node_json("True")}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(state["node"]).encode()
            self.send_response(200 if self.path == "/api/v1/nodes/n1" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


async def test_cli_process_node_probe_end_to_end(
    controller: Controller, nats_server: NatsServer, node_api: dict[str, Any]
) -> None:
    """The real command in a process: NotReady restarts the replica, Ready clears, SIGTERM
    stops it cleanly."""
    r1 = await agent.connect_async("r1", ["dev-a"], addr=nats_server.url, timeout=5)
    node_api["node"] = node_json("False")
    code = "from monitor_cli.run_cli import app; app()"
    args = ["--probe", "node", "--node-api", node_api["url"], "--node-name", "n1"]
    args += ["--devices", "dev-a", "--addr", nats_server.url, "--interval", "0.2"]
    args += ["--clear-after", "0", "--host", "h1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        cmd = await r1.wait(20)
        assert cmd is not None and cmd.kind == "restart" and cmd.devices == ("dev-a",)
        assert "node n1 not Ready" in cmd.reason
        node_api["node"] = node_json("True")

        async def healthy() -> bool:
            return await device_state(nats_server.url, "dev-a") == "healthy"

        for _ in range(100):
            if await healthy():
                break
            await asyncio.sleep(0.1)
        assert await healthy()
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, timeout=20)
        assert proc.returncode == 0, err
        assert "monitor stopped" in err and "Traceback" not in err
        assert "monitoring host h1, devices dev-a, with node (every 0.2s)" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await r1.close()
