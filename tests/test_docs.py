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
    | wire.Drain
    | wire.DrainReply
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
    nodes = ["nats-1", "nats-2", "nats-3"]
    controllers = ["controller-1", "controller-2"]
    assert {*nodes, *controllers, "trainer-r1", "trainer-r2"} <= set(services)
    all_urls = [f"nats://{n}:4222" for n in nodes]

    # Three JetStream nodes, one cluster, each routed to the other two, each with its own store.
    def flag(cmd: list[str], name: str) -> str:
        return cmd[cmd.index(name) + 1]

    volumes = set()
    for node in nodes:
        svc = services[node]
        cmd = [str(c) for c in svc["command"]]
        assert svc["image"].startswith("nats:")
        assert "--jetstream" in cmd or "-js" in cmd
        assert flag(cmd, "--name") == node
        assert flag(cmd, "--cluster_name") == "marduk"
        assert flag(cmd, "--cluster").endswith(":6222")
        routes = set(flag(cmd, "--routes").split(","))
        assert routes == {f"nats://{peer}:6222" for peer in nodes if peer != node}
        store = flag(cmd, "--store_dir")
        # Auth: every node enforces the roles `marduk auth init` generated (issue 7).
        assert flag(cmd, "--config") == "/auth/nats-server.conf"
        assert "marduk-auth:/auth:ro" in svc["volumes"]
        assert svc["depends_on"]["auth-init"]["condition"] == "service_completed_successfully"
        (volume,) = [v.split(":")[0] for v in svc["volumes"] if v.endswith(f":{store}")]
        volumes.add(volume)
        assert "healthz" in " ".join(svc["healthcheck"]["test"])
    assert len(volumes) == 3 and volumes <= set(compose["volumes"])

    # Two controllers on every node's URL, with the state bucket on 3 replicas.
    for name in controllers:
        ctl = services[name]
        assert ctl["image"] == "marduk:dev"
        assert ctl["environment"]["MARDUK_ADDR"].split(",") == all_urls
        assert "--no-embedded" in ctl["command"]
        assert flag(ctl["command"], "--kv-replicas") == "3"
        assert set(nodes) <= set(ctl["depends_on"])
        assert ctl["environment"]["MARDUK_NKEY"] == "/auth/controller.nk"
    init = services["auth-init"]
    assert "marduk auth init /auth" in " ".join(init["command"])
    build = init["build"]
    assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).exists()

    for name in ("trainer-r1", "trainer-r2"):
        t = services[name]
        assert t["environment"]["MARDUK_ADDR"].split(",") == all_urls
        assert t["environment"]["MARDUK_NKEY"] == "/auth/agent.nk"  # controller.pub beside it
        assert set(controllers) <= set(t["depends_on"])
