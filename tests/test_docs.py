"""The docs stay true to the code: every JSON example decodes strictly; compose parses."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import yaml

from marduk import protocol as wire

ROOT = Path(__file__).resolve().parent.parent
TAGGED = (
    wire.Registration
    | wire.RegisterReply
    | wire.Deregistration
    | wire.DeregisterReply
    | wire.Ack
    | wire.AckReply
    | wire.Report
    | wire.ReportReply
    | wire.DeviceHealth
    | wire.HealthReply
    | wire.Command
    | wire.ControllerEvent
    | wire.Hello
    | wire.Query
    | wire.QueryReply
    | wire.ErrorReply
    | wire.Forget
    | wire.ForgetReply
    | wire.Standby
)


def test_every_json_example_in_protocol_md_decodes() -> None:
    text = (ROOT / "docs" / "protocol.md").read_text()
    blocks = re.findall(r"^```json\n(.*?)^```$", text, flags=re.S | re.M)
    assert len(blocks) >= 15
    types = set()
    for block in blocks:
        msg = wire.decode(block.encode(), TAGGED)  # type: ignore[arg-type]
        types.add(type(msg).__name__)
        # Round trip: what we document is what we would send.
        assert msgspec.json.decode(wire.encode(msg)) == {
            **msgspec.to_builtins(msg),
            **msgspec.json.decode(block.encode()),
        }
    assert {"Registration", "DeviceHealth", "Command", "HealthReply", "ErrorReply"} <= types


def test_every_subject_in_code_is_documented() -> None:
    from marduk.subjects import Subjects

    text = (ROOT / "docs" / "protocol.md").read_text()
    s = Subjects()
    for subject in (
        s.health,
        s.query,
        s.forget,
        s.hello,
        s.standby,
        s.ctl_events,
        s.register("<job>"),
        s.deregister("<job>"),
        s.ack("<job>"),
        s.report("<job>"),
        s.events("<job>"),
        s.replica_commands("<job>", "<replica>"),
        s.job_commands("<job>"),
    ):
        assert f"`{subject}`" in text, subject


def test_docker_compose_parses_and_wires_the_services() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"nats", "controller", "trainer-r1", "trainer-r2"} <= set(services)
    nats = services["nats"]
    assert nats["image"].startswith("nats:")
    assert any("-js" in str(c) or "--jetstream" in str(c) for c in nats["command"])
    ctl = services["controller"]
    assert ctl["environment"]["MARDUK_ADDR"] == "nats://nats:4222"
    assert "--no-embedded" in ctl["command"]
    for name in ("trainer-r1", "trainer-r2"):
        t = services[name]
        assert t["environment"]["MARDUK_ADDR"] == "nats://nats:4222"
        assert "controller" in t["depends_on"]
    build = ctl["build"]
    assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).exists()
