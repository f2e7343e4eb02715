"""The Alertmanager webhook receiver: the documented payload, end to end with a real nats-server,
a real controller and a real agent library client."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import agent
from marduk.controller import Controller
from marduk.errors import MardukError
from monitor_cli import client as monitor
from monitor_cli.alertmanager import (
    AlertmanagerReceiver,
    AlertMapping,
    PayloadError,
    ReceiverSettings,
    decode_webhook,
    parse_state_map,
    plan_events,
)
from tests.conftest import (
    ROOT,
    NatsServer,
    controller_settings,
    eventually,
    eventually_sync,
    free_port,
    start_serving,
)
from tests.processes import Proc

GPU0 = "GPU-0d1e2f3a-4b5c-6d7e-8f90-a1b2c3d4e5f6"
GPU1 = "GPU-11111111-2222-3333-4444-555555555555"


def alert(
    device: str | None,
    status: str = "firing",
    *,
    name: str = "GpuXidCritical",
    severity: str = "critical",
    fingerprint: str = "1a30ba71cca2921f",
    starts_at: str = "2026-05-12T09:52:26.739266876Z",
) -> dict[str, Any]:
    labels = {"alertname": name, "severity": severity, "Hostname": "gpu-node-17", "gpu": "0"}
    if device is not None:
        labels["UUID"] = device
    return {
        "status": status,
        "labels": labels,
        "annotations": {"summary": f"XID 79 on {device}", "description": "GPU fell off the bus"},
        "startsAt": starts_at,
        "endsAt": "2026-05-12T10:02:26.739Z" if status == "resolved" else "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus:9090/graph?g0.expr=DCGM_FI_DEV_XID_ERRORS+%3D%3D+79",
        "fingerprint": fingerprint,
    }


def notification(*alerts: dict[str, Any]) -> dict[str, Any]:
    """Alertmanager's webhook payload, version 4, as its configuration docs give it."""
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    return {
        "version": "4",
        "groupKey": f'{{}}/{{severity="critical"}}:{{UUID="{alerts[0]["labels"].get("UUID")}"}}',
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "marduk",
        "groupLabels": {"UUID": alerts[0]["labels"].get("UUID", "")},
        "commonLabels": {"alertname": "GpuXidCritical"},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "notification_reason": "new_alerts",
        "alerts": list(alerts),
    }


def body(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


# --- alerts -> events (pure) ----------------------------------------------------------------------


def test_the_documented_payload_decodes_and_maps() -> None:
    msg = decode_webhook(body(notification(alert(GPU0))))
    assert (msg.version, msg.receiver, len(msg.alerts)) == ("4", "marduk", 1)
    [event] = plan_events(msg, AlertMapping()).events
    assert (event.device, event.state, event.source) == (GPU0, "failed", "alertmanager")
    assert event.reason == f"alert GpuXidCritical: XID 79 on {GPU0}"
    assert event.event_id == "alertmanager-1a30ba71cca2921f-firing-2026-05-12T09:52:26.739266876Z"
    assert event.timestamp == pytest.approx(1778579546.739266)

    [healthy] = plan_events(
        decode_webhook(body(notification(alert(GPU0, "resolved")))), AlertMapping()
    ).events
    assert healthy.state == "healthy" and healthy.event_id != event.event_id
    assert healthy.event_id.endswith("-resolved-2026-05-12T09:52:26.739266876Z")


def test_mapping_severity_labels_and_one_event_per_device() -> None:
    mapping = AlertMapping(state_map=parse_state_map("warning=degraded, page=failed"))
    msg = decode_webhook(
        body(
            notification(
                alert(GPU0, severity="warning", fingerprint="a"),
                alert(GPU0, severity="critical", fingerprint="b", name="GpuEccDbe"),
                alert(GPU1, severity="preempting", fingerprint="c"),
                alert(None, fingerprint="d"),  # a node alert: no device
                alert("GPU with spaces", fingerprint="e"),
            )
        )
    )
    plan = plan_events(msg, mapping)
    assert {(e.device, e.state) for e in plan.events} == {(GPU0, "failed"), (GPU1, "preempting")}
    first = next(e for e in plan.events if e.device == GPU0)
    assert first.event_id.startswith("alertmanager-b-firing")  # the most severe alert
    assert first.reason.endswith("(and 1 more alert(s))")
    assert plan.skipped == {"no_device": 1, "invalid_device": 1}
    assert plan_events(msg, mapping).events == plan.events  # the same notification, the same ids

    # A resolve while another alert for the device still fires is not "healthy".
    mixed = decode_webhook(
        body(notification(alert(GPU0, "resolved", fingerprint="a"), alert(GPU0, fingerprint="b")))
    )
    plan = plan_events(mixed, AlertMapping())
    assert [(e.state, e.event_id.split("-")[1]) for e in plan.events] == [("failed", "b")]
    assert plan.skipped == {"superseded": 1}
    # Older Alertmanagers send no fingerprint: it is derived from the labels, stably.
    bare = alert(GPU0, fingerprint="")
    ids = {plan_events(decode_webhook(body(notification(bare))), AlertMapping()).events[0].event_id}
    ids.add(
        plan_events(decode_webhook(body(notification(bare))), AlertMapping()).events[0].event_id
    )
    assert len(ids) == 1


def test_bad_payloads_and_options_are_one_line_errors() -> None:
    for raw, why in [
        (b"{not json", "malformed JSON"),
        (b'{"version":"4"}', "missing required field `alerts`"),
        (body({"alerts": [{"status": "pending"}]}), "Invalid enum value 'pending'"),
        (body({"alerts": [{"status": "firing", "labels": {"UUID": 7}}]}), "Expected `str`"),
    ]:
        with pytest.raises(PayloadError, match=why) as e:
            decode_webhook(raw)
        assert "\n" not in str(e.value)
    with pytest.raises(MardukError, match="--state-map 'warning': expected VALUE=STATE"):
        parse_state_map("warning")
    with pytest.raises(MardukError, match="STATE one of failed, degraded, preempting "):
        parse_state_map("warning=sad")


# --- the receiver over HTTP -------------------------------------------------------------------------


def http(
    url: str, data: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    req = urllib.request.Request(
        url,
        data=data,
        method="POST" if data is not None else "GET",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


async def post(receiver: AlertmanagerReceiver, payload: dict[str, Any]) -> tuple[int, Any]:
    status, text = await asyncio.to_thread(
        http, f"http://127.0.0.1:{receiver.port}/", body(payload)
    )
    return status, (json.loads(text) if status == 200 else text)


async def start_receiver(addr: str, **kw: Any) -> AlertmanagerReceiver:
    receiver = AlertmanagerReceiver(ReceiverSettings(listen="127.0.0.1:0", addr=addr, **kw))
    await receiver.start()
    return receiver


async def test_firing_restarts_the_replica_once_and_resolved_marks_healthy(
    controller: Controller, nats_server: NatsServer
) -> None:
    trainer = await agent.connect_async("r1", [GPU0, GPU1], job="train", addr=nats_server.url)
    receiver = await start_receiver(nats_server.url)
    try:
        firing = notification(alert(GPU0))
        status, reply = await post(receiver, firing)
        assert status == 200, reply
        assert reply["events"][0]["outcome"] == "decided" and reply["events"][0]["actions"] == 1
        command = await trainer.wait(10)
        assert command is not None
        assert (command.kind, command.epoch, command.devices) == ("restart", 1, (GPU0,))
        assert await trainer.ack()

        # Alertmanager delivers the same notification again (repeat_interval, a retry, an HA
        # peer): the controller recognises the event id and does nothing new.
        status, reply = await post(receiver, firing)
        assert status == 200 and reply["events"][0]["outcome"] == "duplicate"
        # The next command the trainer gets is the one a different alert causes: epoch 2.
        status, _ = await post(receiver, notification(alert(GPU1, fingerprint="ffff0000")))
        assert status == 200
        command = await trainer.wait(10)
        assert command is not None and (command.epoch, command.devices) == (2, (GPU1,))

        status, reply = await post(receiver, notification(alert(GPU0, "resolved")))
        assert status == 200 and reply["events"][0]["state"] == "healthy"
        devices = await monitor.query(nats_server.url, "marduk", "devices")
        assert {d.device: d.state for d in devices.devices}[GPU0] == "healthy"

        assert receiver.stats["alertmanager_events.duplicate"] == 1
        assert receiver.stats["alertmanager_events.failed"] == 2
        assert receiver.stats["alertmanager_events.healthy"] == 1
        status, metrics = await asyncio.to_thread(http, f"http://127.0.0.1:{receiver.port}/metrics")
        assert status == 200 and "marduk_alertmanager_events_duplicate_total 1.0" in metrics
        assert (await asyncio.to_thread(http, f"http://127.0.0.1:{receiver.port}/readyz"))[0] == 200
    finally:
        await receiver.stop()
        await trainer.close()


async def test_an_event_no_controller_decided_is_counted_undecided(
    nats_server: NatsServer,
) -> None:
    """This counter was marduk_alertmanager_events_stored_total, which read like
    every event stored; it counts only those stored and not decided in time."""
    import nats

    from marduk.store.health_stream import ensure_stream
    from marduk.wire.subjects import Subjects

    nc = await nats.connect(nats_server.url)
    await ensure_stream(nc, "marduk", Subjects().health)  # stored, but no controller runs
    await nc.close()
    receiver = await start_receiver(nats_server.url, decide_timeout_s=0.3)
    try:
        await eventually(lambda: receiver.publisher.ready, timeout=10)
        status, reply = await post(receiver, notification(alert(GPU0)))
        assert status == 200 and reply["events"][0]["outcome"] == "stored"
        assert receiver.stats["alertmanager_events.undecided"] == 1
        _, metrics = await asyncio.to_thread(http, f"http://127.0.0.1:{receiver.port}/metrics")
        assert "marduk_alertmanager_events_undecided_total 1.0" in metrics
        assert "\nmarduk_alertmanager_events_stored_total" not in metrics
        assert (
            "# HELP marduk_alertmanager_events_undecided_total Events stored that no controller "
            "decided within the receiver's wait" in metrics
        )
    finally:
        await receiver.stop()


async def test_bad_requests_are_counted_and_the_server_keeps_serving(tmp_path: Path) -> None:
    receiver = await start_receiver(
        f"nats://127.0.0.1:{free_port()}", token="s3cret", publish_timeout_s=0.5
    )
    base = f"http://127.0.0.1:{receiver.port}"
    auth = {"Authorization": "Bearer s3cret"}
    try:
        assert await asyncio.to_thread(http, f"{base}/healthz") == (200, "ok\n")
        assert (await asyncio.to_thread(http, f"{base}/readyz"))[0] == 503  # no NATS
        status, text = await asyncio.to_thread(http, base + "/", b"{oops", auth)
        assert status == 400 and text.startswith("malformed JSON") and text.count("\n") == 1
        status, text = await asyncio.to_thread(http, base + "/", body({"alerts": 3}), auth)
        assert status == 400 and "not an Alertmanager webhook payload" in text
        status, text = await asyncio.to_thread(http, base + "/", body(notification(alert(GPU0))))
        assert status == 401 and text == "missing or wrong bearer token\n"
        status, text = await asyncio.to_thread(http, f"{base}/alerts", b"{}", auth)
        assert status == 404
        # Alerts without the device label are counted and ignored: nothing to publish.
        payload = body(notification(alert(None), alert(None, fingerprint="x")))
        status, text = await asyncio.to_thread(http, base + "/", payload, auth)
        assert status == 200 and json.loads(text) == {"events": [], "ignored": 2}
        assert receiver.stats["alerts.no_device"] == 2
        assert receiver.stats["webhooks.malformed"] == 2
        assert receiver.stats["webhooks.auth"] == 1
        assert await asyncio.to_thread(http, f"{base}/healthz") == (200, "ok\n")
    finally:
        await receiver.stop()


async def test_nats_away_answers_503_and_alertmanagers_retry_lands(tmp_path: Path) -> None:
    port = free_port()
    receiver = await start_receiver(f"nats://127.0.0.1:{port}", publish_timeout_s=0.5)
    server: NatsServer | None = None
    ctl: Controller | None = None
    trainer = None
    try:
        firing = notification(alert(GPU0))
        status, text = await post(receiver, firing)
        assert status == 503 and "NATS" in text and text.count("\n") == 1

        server = NatsServer(tmp_path / "js", port=port).start()
        ctl = await start_serving(Controller(controller_settings(server, tmp_path)))
        trainer = await agent.connect_async("r1", [GPU0], job="train", addr=server.url)
        await eventually(lambda: receiver.publisher.ready, timeout=30)
        status, reply = await post(receiver, firing)  # Alertmanager retries a 5xx
        assert status == 200 and reply["events"][0]["outcome"] == "decided"
        command = await trainer.wait(10)
        assert command is not None and command.devices == (GPU0,)
        assert receiver.stats["webhooks.unavailable"] == 1
    finally:
        await receiver.stop()
        if trainer is not None:
            await trainer.close()
        if ctl is not None:
            await ctl.stop()
        if server is not None:
            server.stop()


def test_the_command_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    proc = Proc(
        [
            sys.executable,
            "-m",
            "monitor_cli.alertmanager_cli",
            "--listen",
            f"127.0.0.1:{port}",
            "--addr",
            f"nats://127.0.0.1:{free_port()}",
        ],
        {"PYTHONUNBUFFERED": "1"},
    )
    proc.expect("receiving Alertmanager webhooks on http://127.0.0.1")
    eventually_sync(lambda: http(f"http://127.0.0.1:{port}/healthz")[0] == 200)
    status, text = http(f"http://127.0.0.1:{port}/", b"[]")
    assert status == 400 and "not an Alertmanager webhook payload" in text
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(20) == 0
    proc.stop()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--state-map", "warning"], "error: --state-map 'warning': expected VALUE=STATE"),
        (["--listen", "nowhere"], "error: --listen 'nowhere': expected HOST:PORT"),
        (["--token-file", "/nonexistent/token"], "error: --token-file /nonexistent/token:"),
    ],
)
def test_command_errors_are_one_line(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "monitor_cli.alertmanager_cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 1
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr


def test_listen_address_in_use_is_one_line() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "monitor_cli.alertmanager_cli",
                "--listen",
                f"127.0.0.1:{port}",
                "--addr",
                f"nats://127.0.0.1:{free_port()}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
    assert done.returncode == 1
    assert f"error: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
