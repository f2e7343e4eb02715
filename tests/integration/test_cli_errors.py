"""Rough edges a new user met in the real CLI, each pinned: one-line errors, addresses, JetStream,
usage errors, help, plurals, exit codes, and what ``watch`` says when things go away."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.supervise.signatures import diagnose
from marduk import __version__
from marduk.transport.embedded import find_binary, listening
from tests.conftest import NatsServer, eventually_sync, free_port, marduk_cli
from tests.processes import Proc, trainer

# Rich sizes help to COLUMNS; wide enough that no path or choice list is folded.
WIDE = {"COLUMNS": "250"}
BOX = "╭│╰─"

# Every command that takes --addr, with what it needs to get that far.
COMMANDS = [
    ["monitor", "status"],
    ["monitor", "top", "--count", "1"],
    ["monitor", "watch", "--count", "1"],
    ["monitor", "inject-failure", "d1"],
    ["monitor", "mark-healthy", "d1"],
    ["monitor", "forget", "job1"],
    ["controller"],
    ["agent", "run", "--replica", "r1", "--devices", "d1", "--connect-timeout", "1", "--", "true"],
]


def one_error_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr and not any(c in r.stderr for c in BOX), r.stderr
    assert lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.mark.parametrize("addr", ["http://localhost:4222", "foo"])
def test_an_address_that_is_not_nats_is_one_line_for_every_command(
    addr: str, tmp_path: Path
) -> None:
    for args in COMMANDS:
        # Both ways in: the option and the variable.
        for extra, env in (
            (["--addr", addr], {}),
            ([], {"MARDUK_ADDR": addr}),
        ):
            cut = args.index("--") if "--" in args else len(args)
            argv = [*args[:cut], *extra, *args[cut:]]
            r = marduk_cli(*argv, env={**env, "MARDUK_STATE_DIR": str(tmp_path)})
            assert r.returncode == 1, (argv, r.stdout, r.stderr)
            line = one_error_line(r)
            assert f"not a NATS URL: {addr!r}" in line, line


@pytest.fixture
def server_without_jetstream() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [find_binary(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        eventually_sync(lambda: listening("127.0.0.1", port, 0.1), timeout=10, interval=0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_monitor_commands_say_the_server_has_no_jetstream(server_without_jetstream: str) -> None:
    env = {"MARDUK_ADDR": server_without_jetstream}
    for args in (
        ["monitor", "status"],
        ["monitor", "inject-failure", "d1"],
        ["monitor", "watch", "--count", "1"],
        ["monitor", "top", "--count", "1"],
        ["monitor", "forget", "job1"],
    ):
        r = marduk_cli(*args, "--timeout", "2", env=env)
        assert r.returncode == 1, (args, r.stderr)
        line = one_error_line(r)
        assert f"the NATS server at {server_without_jetstream} has no JetStream" in line
        assert "start it with -js" in line


def test_controller_says_the_server_has_no_jetstream(
    server_without_jetstream: str, tmp_path: Path
) -> None:
    r = marduk_cli(
        "controller",
        "--no-embedded",
        env={"MARDUK_ADDR": server_without_jetstream, "MARDUK_STATE_DIR": str(tmp_path)},
    )
    assert r.returncode == 1
    assert "has no JetStream: start it with -js" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["monitor", "inject-failure"], "Missing argument"),
        (["monitor", "status", "--bogus"], "No such option: --bogus"),
        (["monitor", "status", "--state", "sideways"], "'--state': 'sideways' is not one of"),
        (["monitor", "inject-failure", "d1", "--state", "healthy"], "is not one of"),
        (["controller", "--log-level", "loud"], "'loud' is not one of"),
        (["agent", "run", "--scope", "pod", "--", "true"], "'pod' is not one of"),
    ],
)
def test_usage_errors_are_one_line_with_the_help_hint(args: list[str], said: str) -> None:
    r = marduk_cli(*args, env={"COLUMNS": "80"})
    assert r.returncode == 2, r.stderr
    line = one_error_line(r)
    assert said in line and "Value error" not in line, line  # no pydantic leftovers
    command = " ".join(args[:1] if args[0] == "controller" else args[:2])
    assert line.endswith(f"; see 'python -m marduk {command} -h'"), line


def test_version() -> None:
    for flag in ("--version", "-V"):
        r = marduk_cli(flag)
        assert r.returncode == 0 and r.stdout == f"marduk {__version__}\n", r.stderr


def test_help_shows_flags_plainly_with_defaults_and_choices(tmp_path: Path) -> None:
    r = marduk_cli("monitor", "status", "-h", env=WIDE)
    assert r.returncode == 0
    assert "<bool>" not in r.stdout
    assert "--json " in r.stdout and "--no-json" not in r.stdout and "as-json" not in r.stdout
    assert "<live|stale|failed|degraded|preempting|healthy|drained|quarantined>" in r.stdout
    r = marduk_cli("agent", "run", "-h", env=WIDE)
    assert "<bool>" not in r.stdout
    assert "<replica|job>" in r.stdout
    assert "<debug|info|warning|error>" in r.stdout
    # typer shows a described default in parentheses.
    assert "[default: (controller.pub beside --nkey, if there)]" in r.stdout
    # --state-dir's default is the directory the controller really uses.
    env = {k: v for k, v in os.environ.items() if k != "MARDUK_STATE_DIR"}
    env.update(WIDE, XDG_STATE_HOME=str(tmp_path / "xdg"))
    r = subprocess.run(
        [sys.executable, "-m", "marduk", "controller", "-h"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    real = subprocess.run(
        [
            sys.executable,
            "-c",
            "from marduk.transport.embedded import default_state_dir as d; print(d())",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.strip()
    assert real == str(tmp_path / "xdg" / "marduk")
    assert f"[default: ({real})]" in r.stdout
    assert "<bool>" not in r.stdout


def test_cuda_error_out_of_memory_is_an_oom() -> None:
    d = diagnose(["RuntimeError: CUDA error: out of memory"])
    assert d is not None and d.failure_class == "device_oom"
    d = diagnose(["CUDA_ERROR_OUT_OF_MEMORY: out of memory"])
    assert d is not None and d.failure_class == "device_oom"
    d = diagnose(["RuntimeError: CUDA error: an illegal memory access was encountered"])
    assert d is not None and d.failure_class == "cuda_error"


# --- against a running controller ----------------------------------------------------------------


def test_status_inject_top_and_exit_codes(controller_env: dict[str, str]) -> None:
    env = {**controller_env, "COLUMNS": "80"}
    gpu = "GPU-8e1a4c2b-1f0e-4d2c-9a7b-5c3d2e1f8b31"
    r1 = trainer(env, "r1", f"{gpu},d2")
    try:
        # Unknown device: exit 3, with or without --json (which still prints the reply).
        r = marduk_cli("monitor", "inject-failure", "nope", env=env)
        assert r.returncode == 3 and "unknown to the controller" in r.stdout, r.stderr
        r = marduk_cli("monitor", "inject-failure", "nope", "--json", env=env)
        assert r.returncode == 3 and json.loads(r.stdout)["known"] is False
        r = marduk_cli("monitor", "inject-failure", "d2", env=env)
        assert r.returncode == 0
        assert "1 restart scope acted on" in r.stdout and "scope(s)" not in r.stdout
        assert not any(c in r.stdout for c in BOX + "┏")  # piped: plain lines
        # Status, piped into 80 columns: plain lines, nothing cut, library worker 'registered'.
        r = marduk_cli("monitor", "status", env=env)
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert "1 replica, 1 worker, 2 devices" in out
        assert "jobs:" in out and "workers:" in out and "devices:" in out
        assert gpu in out  # the devices table: whole
        row = next(line for line in out.splitlines() if line.startswith("  default  r1"))
        assert "registered" in row  # a library-only worker: no report, but not blank
        assert "GPU-8e1a4c2b…8b31,d2" in row  # abbreviated in the row, whole below
        assert "s ago" in out and "…" not in out.replace("GPU-8e1a4c2b…8b31", "")
        assert "device d2 failed" in out  # the job's last failure
        # Filters, and --json keeping the QueryReply's shape.
        r = marduk_cli("monitor", "status", "--state", "failed", "--json", env=env)
        reply = json.loads(r.stdout)
        assert reply["type"] == "query_reply" and [d["device"] for d in reply["devices"]] == ["d2"]
        r = marduk_cli("monitor", "status", "--device", "GPU-8e1a4c2b…8b31", env=env)
        assert gpu in r.stdout and "\n  d2 " not in r.stdout
        r = marduk_cli("monitor", "status", "--replica", "nope", env=env)
        assert "nothing matches these filters" in r.stdout
        # top, piped: refreshes as plain blocks, then stops.
        r = marduk_cli("monitor", "top", "--count", "2", "--interval", "0.1", env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.count("--- ") == 2 and r.stdout.count("jobs:") == 2
        assert "device_failed  device d2" in r.stdout
        r = marduk_cli("monitor", "top", "--once", env=env)
        assert r.returncode == 0 and r.stdout.count("--- ") == 1, r.stderr
        r = marduk_cli("monitor", "top", "--once", "--json", env=env)
        assert r.returncode == 0 and json.loads(r.stdout)["type"] == "perf_reply", r.stderr
        r = marduk_cli("monitor", "top", "--json", env=env)
        assert r.returncode == 2 and "only with --once" in one_error_line(r)
    finally:
        r1.stop()


def test_give_up_message_says_time_not_times(controller_env: dict[str, str]) -> None:
    from tests.processes import agent_run

    a = agent_run(
        controller_env,
        *("--replica", "r1", "--devices", "d1", "--max-restarts", "1", "--no-prespawn"),
        cmd=[sys.executable, "-c", "import sys; sys.exit(3)"],
    )
    a.proc.wait(30)
    assert any("giving up" in line for line in a.all), "".join(a.all)
    assert not any("1 times" in line for line in a.all), "".join(a.all)


def test_watch_says_when_the_controller_and_nats_go_and_come_back(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "js").start()
    env = {
        "MARDUK_ADDR": server.url,
        "MARDUK_STATE_DIR": str(tmp_path / "state"),
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": "80",
    }
    ctl_args = [sys.executable, "-m", "marduk", "controller", "--no-embedded"]
    try:
        ctl = Proc(ctl_args, env)
        ctl.expect("serving prefix")
        watch = Proc([sys.executable, "-m", "marduk", "monitor", "watch"], env)
        watch.expect("watching controller events")
        watch.expect("serving (term")
        ctl.stop()
        watch.expect("controller not answering")
        ctl = Proc(ctl_args, env)
        ctl.expect("serving prefix")
        watch.expect("serving again")
        ctl.stop()
        server.stop()
        watch.expect("lost the connection to NATS")
        server.start()
        watch.expect(f"reconnected to NATS at {server.url}")
        assert watch.proc.poll() is None  # still watching
    finally:
        server.stop()


def test_status_shows_a_drained_device_out_of_service(controller_env: dict[str, str]) -> None:
    env = {**controller_env, "COLUMNS": "200"}
    r1 = trainer(env, "r1", "lin-d1,lin-d2,lin-d3")
    try:
        assert marduk_cli("monitor", "inject-failure", "lin-d2", env=env).returncode == 0
        for dev in ("lin-d2", "lin-d3"):
            r = marduk_cli("monitor", "drain", dev, "--reason", "bad fan", env=env)
            assert r.returncode == 0, r.stderr
        r = marduk_cli("monitor", "status", env=env)
        assert r.returncode == 0, r.stderr
        rows = {
            line.split()[0]: line for line in r.stdout.splitlines() if line.startswith("  lin-")
        }
        assert rows["lin-d1"].split()[1] == "healthy"
        assert rows["lin-d3"].split()[1] == "drained", rows
        assert "failed, drained" in rows["lin-d2"] and "injected" not in rows["lin-d2"], rows
        assert rows["lin-d2"].endswith("drained by an operator: bad fan"), rows
        jobs = r.stdout.splitlines()
        header = next(line for line in jobs if "unusable" in line).split()
        row = next(line for line in jobs if line.startswith("  default ")).split()
        assert row[header.index("unusable")] == "2", r.stdout
        r = marduk_cli("monitor", "status", "--state", "drained", env=env)
        assert "lin-d2" in r.stdout and "lin-d3" in r.stdout and "\n  lin-d1 " not in r.stdout
    finally:
        r1.stop()


def test_a_job_filter_from_marduk_job_is_said_and_an_empty_match_explained(
    controller_env: dict[str, str],
) -> None:
    env = {**controller_env, "COLUMNS": "200"}
    r1 = trainer(env, "r1", "d1")
    try:
        r = marduk_cli("monitor", "status", env={**env, "MARDUK_JOB": "nosuch"})
        assert r.returncode == 0, r.stderr
        assert "job: nosuch (from MARDUK_JOB)" in r.stdout.splitlines()
        assert "no worker of job nosuch has registered (1 worker in 1 other job)" in r.stdout
        r = marduk_cli("monitor", "status", "--job", "default", env=env)
        assert "job: default (--job)" in r.stdout.splitlines() and "  default  r1" in r.stdout
        r = marduk_cli("monitor", "status", env=env)
        assert not any(line.startswith("job: ") for line in r.stdout.splitlines())
        r = marduk_cli("monitor", "top", "--count", "1", env={**env, "MARDUK_JOB": "nosuch"})
        assert r.returncode == 0 and "job: nosuch (from MARDUK_JOB)" in r.stdout, r.stderr
    finally:
        r1.stop()


def test_an_unknown_device_exits_3_for_every_command_that_names_one(
    controller_env: dict[str, str],
) -> None:
    env = {**controller_env, "COLUMNS": "200"}
    r1 = trainer(env, "r1", "d1,d2")
    try:
        for args in (
            ["inject-failure", "nosuchdev"],
            ["mark-healthy", "nosuchdev"],
            ["drain", "nosuchdev"],
            ["undrain", "nosuchdev"],
        ):
            r = marduk_cli("monitor", *args, env=env)
            assert r.returncode == 3, (args, r.stdout, r.stderr)
            assert "nosuchdev is unknown to the controller" in r.stdout, (args, r.stdout)
            r = marduk_cli("monitor", *args, "--json", env=env)
            assert r.returncode == 3 and json.loads(r.stdout), (args, r.stdout, r.stderr)
        # A known device with nothing to change is no error; a known one beside an unknown one
        # is drained, and the unknown one still exits 3.
        r = marduk_cli("monitor", "undrain", "d1", env=env)
        assert r.returncode == 0 and "nothing changed" in r.stdout, r.stdout
        r = marduk_cli("monitor", "drain", "d1", "nosuchdev", env=env)
        assert r.returncode == 3 and "1 device drained: d1" in r.stdout, r.stdout
        r = marduk_cli("monitor", "drain", "d1", env=env)
        assert r.returncode == 0 and "nothing changed" in r.stdout, r.stdout
        r = marduk_cli("monitor", "mark-healthy", "d2", env=env)
        assert r.returncode == 0, r.stdout
    finally:
        r1.stop()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["inject-failure", "bad device"], "Invalid value for 'DEVICE': 'bad device': expected "),
        (["mark-healthy", "bad device"], "Invalid value for 'DEVICE': 'bad device': expected "),
        (["drain", "d1", "bad device"], "'bad device': expected printable ASCII without spaces"),
        (["undrain", "--host", "h" * 300], "Invalid value for '--host'"),
        (["forget", "bad job"], "'bad job': expected 1-128 of A-Z a-z 0-9 _ -"),
        (["forget", "job/r1/x"], "WORKER is a number"),
        (["drain"], "Invalid value for DEVICE: none given: name DEVICE(s) or --host HOST"),
        (["mark-healthy", "d1", "--all"], "give a DEVICE or --all (not both)"),
    ],
)
def test_wire_mistakes_are_usage_errors_before_any_request(args: list[str], said: str) -> None:
    # Nothing listens there: a request would fail with exit 1, the check comes first.
    r = marduk_cli("monitor", *args, "--addr", "nats://127.0.0.1:1", env={"COLUMNS": "80"})
    assert r.returncode == 2, r.stderr
    line = one_error_line(r)
    assert said in line and "$." not in line and "Expected str" not in line, line
