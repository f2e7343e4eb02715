"""Operability end to end: /metrics and probes on the controller and an agent, NATS micro
discovery, and JSON log fields; real processes, real server."""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request

import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from marduk.controller import Controller
from tests.conftest import NatsServer, eventually_sync, free_port, marduk_cli
from tests.integration.test_docs import documented_metric
from tests.processes import agent_run, controller

pytestmark = pytest.mark.e2e


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def value(text: str, name: str, **labels: str) -> float:
    """A sample's value from the Prometheus text format (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = (
        rf"^{re.escape(name)}(\{{{re.escape(want)}\}})? (\S+)$"
        if want
        else rf"^{re.escape(name)} (\S+)$"
    )
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.groups()[-1])
    return 0.0


def test_metrics_and_probes_move_as_events_happen(env: dict[str, str]) -> None:
    cport, aport = free_port(), free_port()
    ctl = controller({**env, "MARDUK_METRICS_ADDR": f"127.0.0.1:{cport}", "MARDUK_JSON_LOGS": "1"})
    trainer = agent_run(
        {**env, "MARDUK_METRICS_ADDR": f"127.0.0.1:{aport}"},
        "--replica",
        "r1",
        "--devices",
        "gpu-a,gpu-b",
        cmd=[sys.executable, "tests/trainers/toy.py", "--step-seconds", "0.05"],
    )
    try:
        assert scrape(cport, "/healthz") == (200, "ok\n")
        status, why = scrape(cport, "/readyz")
        assert status == 200 and why.startswith("leader")
        _, text = scrape(cport)
        assert value(text, "marduk_leader", role="leader") == 1
        trainer.expect("START r1/0 epoch=0")
        eventually_sync(lambda: scrape(aport, "/readyz")[0] == 200, timeout=20)
        eventually_sync(lambda: value(scrape(cport)[1], "marduk_workers", state="live") == 1)
        before = value(scrape(cport)[1], "marduk_commands_total", kind="restart")

        r = marduk_cli("monitor", "inject-failure", "gpu-b", env=env)
        assert r.returncode == 0, r.stderr
        trainer.expect("START r1/0 epoch=1")
        _, text = scrape(cport)
        assert value(text, "marduk_commands_total", kind="restart") == before + 1
        assert value(text, "marduk_health_events_total", state="failed") == 1
        assert value(text, "marduk_restarts_total", cause="device/restart") == 1
        assert value(text, "marduk_event_to_command_seconds_count") == 1
        assert value(text, "marduk_devices", state="failed") == 1
        assert value(text, "marduk_messages_received_total", kind="registration") >= 1
        # The agent counts its restart and how long it took; ready again once it steps.
        eventually_sync(lambda: value(scrape(aport)[1], "marduk_agent_restart_seconds_count") == 1)
        _, atext = scrape(aport)
        assert value(atext, "marduk_restarts_total", cause="command") == 1
        assert value(atext, "marduk_agent_epoch", epoch="current") == 1
        assert value(atext, "marduk_commands_total", kind="restart") == 1  # the library's counter
        eventually_sync(lambda: scrape(aport, "/readyz")[0] == 200, timeout=20)
        # status shows the same counters (one source).
        s = json.loads(marduk_cli("monitor", "status", "--json", env=env).stdout)
        assert s["stats"]["commands.restart"] == value(
            scrape(cport)[1], "marduk_commands_total", kind="restart"
        )
        assert scrape(cport, "/nope")[0] == 404
        # Every metric either serves is in operations.md.
        undocumented = [
            fam.name
            for text in (scrape(cport)[1], scrape(aport)[1])
            for fam in text_string_to_metric_families(text)
            # (a histogram's `_created` timestamp comes as a gauge of its own)
            if not documented_metric(fam.name.removesuffix("_created"))
            and not documented_metric(fam.name + "_total")
        ]
        assert undocumented == []
    finally:
        trainer.stop()
        ctl.stop()
    # JSON logs carry the decision's fields, not only the text.
    records = [json.loads(line) for line in ctl.all if line.startswith("{")]
    issued = [r for r in records if r.get("event") == "restart_issued"]
    assert issued and issued[0]["job"] == "default" and issued[0]["replica"] == "r1"
    assert issued[0]["epoch"] == 1 and issued[0]["device"] == "gpu-b"
    assert issued[0]["event_id"].startswith("marduk-monitor-")  # inject-failure's id


async def test_the_leader_is_a_nats_micro_service(
    controller: Controller, nats_server: NatsServer
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        ping = json.loads((await nc.request("$SRV.PING.marduk", b"", timeout=5)).data)
        assert ping["name"] == "marduk" and ping["version"] == controller.info().version
        info = json.loads((await nc.request("$SRV.INFO.marduk", b"", timeout=5)).data)
        assert {e["name"] for e in info["endpoints"]} == {
            "register",
            "deregister",
            "ack",
            "report",
            "request",
            "query",
            "forget",
            "drain",
            "params_set",
            "params_get",
            "params_applied",
        }
        assert info["metadata"]["controller_id"] == controller.controller_id
        stats = json.loads((await nc.request("$SRV.STATS.marduk", b"", timeout=5)).data)
        assert stats["name"] == "marduk"
    finally:
        await nc.close()


def test_metrics_addr_in_use_is_one_line(env: dict[str, str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = marduk_cli("controller", env={**env, "MARDUK_METRICS_ADDR": f"127.0.0.1:{port}"})
    assert r.returncode == 1 and "cannot serve metrics" in r.stderr and "Traceback" not in r.stderr
    r = marduk_cli("controller", "--metrics-addr", "nonsense", env=env)
    assert r.returncode == 1 and "expected HOST:PORT" in r.stderr
