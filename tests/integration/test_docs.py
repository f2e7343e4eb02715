"""The docs stay true to the code: every JSON example decodes strictly; every message, subject,
event kind, state and field the code has is documented (and nothing else); compose parses."""

from __future__ import annotations

import ast
import json
import re
import typing
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import yaml

from marduk.controller import Controller
from marduk.wire import params as params_wire
from marduk.wire import protocol as wire
from marduk.wire.subjects import Subjects
from tests.conftest import NatsServer, store_health

ROOT = Path(__file__).resolve().parents[2]
TAGGED = (
    wire.Registration
    | wire.RegisterReply
    | wire.Deregistration
    | wire.DeregisterReply
    | wire.Ack
    | wire.AckReply
    | wire.Report
    | wire.ReportReply
    | wire.WorkloadRequest
    | wire.WorkloadReply
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
    | wire.Drain
    | wire.DrainReply
    | params_wire.ParamsSet
    | params_wire.ParamsSetReply
    | params_wire.Params
    | params_wire.ParamsApplied
    | params_wire.ParamsAppliedReply
    | params_wire.ParamsQuery
    | params_wire.ParamsQueryReply
    | wire.PerfSummary
    | wire.PerfQuery
    | wire.PerfReply
)
PROTOCOL_MD = ROOT / "docs" / "protocol.md"
ARCHITECTURE_MD = ROOT / "docs" / "architecture.md"


def _messages() -> set[str]:
    """Every wire message class: the tagged Structs of marduk/wire/protocol.py and of the
    live parameters' marduk/wire/params.py."""
    bases = (wire.Message, params_wire.ParamsMessage)
    return {
        name
        for module in (wire, params_wire)
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, bases) and obj not in bases
    } | {"PerfSummary", "PerfQuery", "PerfReply"}  # marduk/wire/perf.py's, tagged alike


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
    assert types == _messages()  # every message has its example


def test_every_subject_in_code_is_documented() -> None:
    text = PROTOCOL_MD.read_text()
    s = Subjects()
    # Every fixed subject (a property of Subjects) is in the subject table, found by itself.
    fixed = [v for k, v in vars(Subjects).items() if isinstance(v, property)]
    assert len(fixed) >= 8
    for prop in fixed:
        subject = prop.fget(s)  # type: ignore[misc]
        assert f"`{subject}`" in text, subject
    for subject in (
        s.register("<job>"),
        s.deregister("<job>"),
        s.ack("<job>"),
        s.report("<job>"),
        s.events("<job>"),
        s.replica_commands("<job>", "<replica>"),
        s.job_commands("<job>"),
        s.params_commands("<job>"),
        s.params_applied("<job>"),
    ):
        assert f"`{subject}`" in text, subject


async def test_every_served_subject_is_in_the_subject_table(
    controller: Controller, nats_server: NatsServer
) -> None:
    """What the leader serves, as NATS micro lists it, against the table (drain was
    served but not documented)."""
    rows = _table_rows(_section(PROTOCOL_MD.read_text(), "## Subjects"))
    documented = {row[0].strip("`") for row in rows}
    nc = await nats.connect(nats_server.url)
    try:
        info = json.loads((await nc.request("$SRV.INFO.marduk", b"", timeout=5)).data)
    finally:
        await nc.close()
    served = {e["subject"].replace(".*.", ".<job>.") for e in info["endpoints"]}
    assert len(served) >= 7 and served <= documented, served - documented


def _section(text: str, heading: str) -> str:
    """From ``heading`` to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}") + 1
    stop = re.compile(rf"^#{{1,{len(level)}}} ", re.M).search(text, start + len(heading))
    return text[start : stop.start() if stop else len(text)]


def _table_rows(text: str) -> list[list[str]]:
    """The cells of every markdown table row in ``text``, header rows left out."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        if set(line) <= set("|-: "):
            rows.pop()  # the line above the rule is the header
            continue
        rows.append([cell.strip() for cell in line.strip("|").split(" | ")])
    return rows


def _ticked(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def test_the_event_kind_table_lists_every_kind_and_only_those() -> None:
    section = _section(
        PROTOCOL_MD.read_text(), "### ControllerEvent: `marduk.<job>.events`, `marduk.ctl.events`"
    )
    documented = set().union(*(_ticked(row[0]) for row in _table_rows(section)))
    assert documented == wire.EVENT_KINDS


# f-string kinds in the code, and what they expand to.
_TEMPLATES = {
    "device_{}": {f"device_{s}" for s in typing.get_args(wire.HealthState)},
    "{}_issued": {"restart_issued", "fail_issued"},  # a device failure's command kinds
    "trainer_{}": {"trainer_restarting", "trainer_exited", "trainer_checkpointed"},
    "worker_{}": {"worker_crashed", "worker_hung", "worker_gave_up", "worker_preempted"},
}


def _emitted_kinds() -> set[str]:
    """Every event kind the controller's code can publish: the ``kind`` of each ControllerEvent
    it builds (a string, either branch of a conditional, a local assigned strings, or a
    parameter: then the callers' arguments), f-strings expanded by _TEMPLATES."""
    kinds: set[str] = set()

    def values(node: ast.expr, func: ast.FunctionDef | None, tree: ast.Module) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            kinds.add(node.value)
        elif isinstance(node, ast.IfExp):
            values(node.body, func, tree)
            values(node.orelse, func, tree)
        elif isinstance(node, ast.JoinedStr):
            template = "".join(
                v.value if isinstance(v, ast.Constant) else "{}" for v in node.values
            )
            assert template in _TEMPLATES, f"new event kind template {template!r}: add it"
            kinds.update(_TEMPLATES[template])
        elif isinstance(node, ast.Name) and func is not None:
            if node.id in {a.arg for a in func.args.args}:
                index = [a.arg for a in func.args.args].index(node.id)
                index -= 1 if func.args.args[0].arg == "self" else 0
                for other in trees:  # callers anywhere in the package
                    for call in ast.walk(other):
                        name = getattr(call, "func", None)
                        if isinstance(call, ast.Call) and func.name in (
                            getattr(name, "attr", ""),
                            getattr(name, "id", ""),
                        ):
                            values(call.args[index], None, other)
            else:
                for stmt in ast.walk(func):
                    if isinstance(stmt, ast.Assign) and any(
                        isinstance(t, ast.Name) and t.id == node.id for t in stmt.targets
                    ):
                        values(stmt.value, None, tree)
        else:
            raise AssertionError(f"an event kind the test cannot read: {ast.dump(node)}")

    trees = [ast.parse(path.read_text()) for path in sorted((ROOT / "marduk").rglob("*.py"))]
    for tree in trees:
        for func in [
            n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        ]:
            for call in ast.walk(func):
                if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "ControllerEvent":
                    for kw in call.keywords:
                        if kw.arg == "kind":
                            values(kw.value, func, tree)  # type: ignore[arg-type]
    return kinds


def test_every_event_kind_the_code_publishes_is_in_the_list_and_no_other() -> None:
    assert _emitted_kinds() == wire.EVENT_KINDS


def test_state_and_status_tables_match_the_wire_types() -> None:
    text = PROTOCOL_MD.read_text()
    (state_row,) = [r for r in _table_rows(_section(text, "### DeviceHealth")) if r[0] == "`state`"]
    assert _ticked(state_row[1]) == set(typing.get_args(wire.HealthState))
    report = _section(text, "### Report: `marduk.<job>.report`")
    statuses = set().union(*(_ticked(r[0]) for r in _table_rows(report)))
    assert statuses == set(typing.get_args(wire.ReportStatus))


def test_query_reply_field_tables_match_the_structs() -> None:
    query = _section(PROTOCOL_MD.read_text(), "### Query: `marduk.ctl.query`")
    cut, jobs_at = query.index("| `devices` field |"), query.index("| `jobs` field |")
    tables = query[:cut], query[cut:jobs_at], query[jobs_at:]
    workers, devices, jobs = (
        set().union(*(_ticked(r[0]) for r in _table_rows(table))) for table in tables
    )
    assert workers == set(wire.WorkerInfo.__struct_fields__)
    assert devices == set(wire.DeviceInfo.__struct_fields__)
    assert jobs == set(wire.JobInfo.__struct_fields__)


async def test_only_inbox_reply_subjects_are_answered_as_documented(
    controller: Controller, nats_server: NatsServer
) -> None:
    """A plain subject in Marduk-Reply-To gets no answer (the controller would otherwise
    publish wherever a client says, with its own rights), nor does a header that is no subject
    at all; the docs say so, and name the counters the controller keeps (architecture.md
    named only one of the two)."""
    text = " ".join(PROTOCOL_MD.read_text().split())
    assert "`Marduk-Reply-To`: a subject that starts with `_INBOX.`" in text
    assert "Any other subject gets no answer" in text
    for doc in (text, " ".join(ARCHITECTURE_MD.read_text().split())):
        assert "`rejected.reply_subject`" in doc and "`rejected.reply_header`" in doc
    nc = await nats.connect(nats_server.url)
    try:
        plain, inbox = await nc.subscribe("mon1.replies"), await nc.subscribe("_INBOX.mon1")
        event = wire.DeviceHealth(device="GPU-x", state="failed")
        for reply_to in ("mon1.replies", "_INBOX.mon 1", "_INBOX.mon1"):
            await store_health(nc, wire.encode(event), reply_to)
        assert wire.decode((await inbox.next_msg(timeout=5)).data, wire.HealthReply).known is False
        assert controller.stats["rejected.reply_subject"] == 1
        assert controller.stats["rejected.reply_header"] == 1
        assert not plain.pending_msgs
    finally:
        await nc.close()


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
        # Auth: every node enforces the roles `marduk auth init` generated.
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


OPERATIONS_MD = ROOT / "docs" / "operations.md"


@pytest.mark.parametrize(
    ("command", "heading"),
    [
        (["controller"], "### `marduk controller`"),
        (["agent", "run"], "### `marduk agent run [OPTIONS] -- CMD [ARGS...]`"),
        (["monitor", "run"], "## Monitors"),
    ],
)
def test_every_option_is_in_its_commands_table(command: list[str], heading: str) -> None:
    """`agent run --metrics-addr` (and `monitor run --dcgm-url`) were served
    but missing from their tables. torchrun's underscore spellings are aliases, not listed."""
    import typer.main

    from marduk.cli import app

    cli: Any = typer.main.get_command(app)
    for name in command:
        cli = cli.commands[name]
    rows = " ".join(r[0] for r in _table_rows(_section(OPERATIONS_MD.read_text(), heading)))
    options = {o for p in cli.params for o in p.opts if o.startswith("--") and "_" not in o}
    # A --flag/--no-flag pair is listed once; --tls-* stands for the three TLS files.
    listed = {o for o in options if any(f"{a}{o}{b}" in rows for a in "`/" for b in "`/ ")}
    listed |= {o for o in options if o.startswith("--tls-") and "`--tls-*`" in rows}
    assert options - listed == set()


def _metrics_table() -> dict[str, list[str]]:
    """operations.md's Prometheus table: metric name -> its row."""
    section = _section(OPERATIONS_MD.read_text(), "### Prometheus metrics")
    return {row[0].strip("`"): row for row in _table_rows(section)}


def _registered_metric_names() -> set[str]:
    """What the controller's and the agent's registries can serve besides plain counters: the
    stats families, and every gauge and histogram their code builds (by name)."""
    from marduk.shell.metrics import FAMILIES

    names = {name for name, _label, _doc in FAMILIES.values()}
    for path in [*(ROOT / "marduk").rglob("*.py"), *(ROOT / "agent").rglob("*.py")]:
        for call in ast.walk(ast.parse(path.read_text())):
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
                continue
            index = {"gauge": 0, "histogram": 1, "GaugeMetricFamily": 0}.get(call.func.id)
            if index is not None and len(call.args) > index:
                arg = call.args[index]
                if call.func.id == "GaugeMetricFamily" and path.name == "metrics.py":
                    continue  # gauge() itself
                assert isinstance(arg, ast.Constant), f"{path}: a metric name the test cannot read"
                names.add(arg.value)
    return names


def test_the_metrics_table_lists_every_family_gauge_and_histogram() -> None:
    """The controller's and the agent's metric names were documented nowhere."""
    table = _metrics_table()
    assert set(table) == _registered_metric_names()
    for name, row in table.items():
        kind = row[1]
        assert kind in {"counter", "gauge", "histogram"}
        assert name.endswith("_total") == (kind == "counter"), name


def documented_metric(name: str) -> bool:
    """Is a scraped metric (``marduk_x_total`` for counters) in the table, or a counter of the
    Counters section exported under the rule ``a.b`` -> ``marduk_a_b_total``?"""
    if name in _metrics_table():
        return True
    counters = _section(OPERATIONS_MD.read_text(), "## Counters and metrics").split("###")[0]
    for key in re.findall(r"`([a-z_.<>|/ -]+)`", counters):
        flat = re.escape(key.replace(".", "_").replace("-", "_"))
        pattern = re.sub(r"<[^>]+>", "[a-z0-9_]+", flat.replace(r"\<", "<").replace(r"\>", ">"))
        if re.fullmatch(f"marduk_{pattern}_total", name):
            return True
    return False


def _yaml_block(text: str, first_line: str) -> Any:
    blocks = re.findall(r"^```yaml\n(.*?)^```$", text, flags=re.S | re.M)
    (block,) = [b for b in blocks if b.startswith(first_line)]
    return yaml.safe_load(block)


def _seconds(duration: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)", duration).groups()  # type: ignore[union-attr]
    return int(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def test_the_alertmanager_config_is_whole_and_routes_to_the_receiver() -> None:
    """The documented alertmanager.yml had no default receiver on its root
    route (amtool check-config: "root route must specify a default receiver"), and its
    group_interval of 30 s held a device's next alert or resolve back up to 30 s."""
    config = _yaml_block(OPERATIONS_MD.read_text(), "# alertmanager.yml")
    assert set(config) <= {"global", "route", "receivers", "inhibit_rules", "templates"}
    receivers = [r["name"] for r in config["receivers"]]
    assert len(receivers) == len(set(receivers))
    root = config["route"]
    # Alertmanager's own rules for the root: a receiver, no matchers, no continue.
    assert root["receiver"] in receivers
    assert not {"matchers", "match", "match_re", "continue"} & set(root)
    (marduk,) = [r for r in root["routes"] if r["receiver"] == "marduk"]
    assert all(r["receiver"] in receivers for r in root["routes"])
    assert marduk["group_by"] == ["UUID"] and marduk["matchers"] == ['UUID=~"GPU-.+"']
    assert _seconds(marduk["group_wait"]) == 0 and 0 < _seconds(marduk["group_interval"]) <= 5
    (hook,) = next(r for r in config["receivers"] if r["name"] == "marduk")["webhook_configs"]
    assert hook["send_resolved"] is True and hook["url"].startswith("http")
    assert set(hook["http_config"]["authorization"]) == {"credentials_file"}


def test_the_prometheus_rules_are_a_whole_rules_file() -> None:
    rules = _yaml_block(OPERATIONS_MD.read_text(), "# Prometheus rules file")
    (group,) = rules["groups"]
    assert group["name"] and group["rules"]
    for rule in group["rules"]:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
        assert rule["alert"] and "DCGM_FI_DEV_" in rule["expr"]
        assert rule["labels"]["severity"] in {"critical", "warning"}


def test_the_error_code_table_lists_every_code_the_code_answers() -> None:
    """Every ProtocolError/PolicyError/MembershipError reason and ErrorReply code in the code is in the table."""
    codes: set[str] = set()
    for path in [*(ROOT / "marduk").rglob("*.py")]:
        for call in ast.walk(ast.parse(path.read_text())):
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
                continue
            errors = {"ProtocolError", "PolicyError", "MembershipError"}
            if call.func.id in errors | {"ParamsError", "ParamValueError"} and call.args:
                arg = call.args[0]
            elif call.func.id == "ErrorReply":
                arg = next((k.value for k in call.keywords if k.arg == "code"), None)
            else:
                continue
            if isinstance(arg, ast.Constant):
                codes.add(arg.value)
    table = _table_rows(_section(PROTOCOL_MD.read_text(), "### Errors"))
    documented = {row[0].strip("`") for row in table}
    assert len(codes) >= 10 and codes == documented
