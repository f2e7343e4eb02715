"""The MARDUK_* hand-off from ``marduk agent run`` to its trainer, as one object: no processes."""

from __future__ import annotations

import dataclasses

import pytest

from agent.channel import handoff
from agent.channel.handoff import Handoff, HandoffError, parse_devices
from agent.library.client import AgentError, resolve_options

FULL = Handoff(
    job="j1",
    replica="r1",
    worker=3,
    devices=("GPU-a", "GPU-b"),
    scope="job",
    addr="nats://h:4222",
    prefix="mk",
    epoch=7,
    restart_count=2,
    supervisor_pid=4242,
    agent_socket="/run/marduk-agent-x/agent.sock",
    warm_start="zygote",
)


def test_what_the_supervisor_writes_the_library_reads_back() -> None:
    assert Handoff.from_env(FULL.to_env()) == FULL


def test_the_variable_names_are_the_documented_ones() -> None:
    # docs/operations.md lists these; trainers (tests/trainers, bench) read them by name.
    assert FULL.to_env() == {
        "MARDUK_JOB": "j1",
        "MARDUK_REPLICA_ID": "r1",
        "MARDUK_WORKER": "3",
        "MARDUK_DEVICES": "GPU-a,GPU-b",
        "MARDUK_SCOPE": "job",
        "MARDUK_ADDR": "nats://h:4222",
        "MARDUK_PREFIX": "mk",
        "MARDUK_EPOCH": "7",
        "MARDUK_RESTART_COUNT": "2",
        "MARDUK_SUPERVISOR_PID": "4242",
        "MARDUK_AGENT_SOCKET": "/run/marduk-agent-x/agent.sock",
        "MARDUK_WARM_START": "zygote",
    }
    assert {f.name for f in dataclasses.fields(Handoff)} == set(handoff._VAR)


def test_an_empty_environment_is_a_process_started_by_hand() -> None:
    given = Handoff.from_env({"PATH": "/bin", "MARDUK_JOB": "  ", "MARDUK_DEVICES": ","})
    assert given == Handoff(devices=())  # "," names no device: an explicit empty list
    assert not given.supervised and given.epoch == 0 and given.restart_count == 0
    assert Handoff().to_env() == {"MARDUK_EPOCH": "0", "MARDUK_RESTART_COUNT": "0"}
    assert Handoff.from_env({}).devices is None


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("MARDUK_WORKER", "two", "MARDUK_WORKER must be a whole number, not 'two'"),
        ("MARDUK_EPOCH", "-1", "MARDUK_EPOCH must not be negative"),
        ("MARDUK_RESTART_COUNT", "1.5", "MARDUK_RESTART_COUNT must be a whole number"),
        ("MARDUK_SCOPE", "pod", "MARDUK_SCOPE must be 'replica' or 'job', not 'pod'"),
        ("MARDUK_WARM_START", "hot", "MARDUK_WARM_START must be 'zygote' or 'standby'"),
    ],
)
def test_an_unreadable_variable_is_named_in_the_error(var: str, value: str, says: str) -> None:
    with pytest.raises(HandoffError, match=says):
        Handoff.from_env({var: value})


def test_the_library_reports_a_bad_variable_as_an_agent_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MARDUK_WORKER", "x")
    with pytest.raises(AgentError, match="MARDUK_WORKER must be a whole number"):
        resolve_options("r1", ["d"], None, "nats://127.0.0.1:1", None)


def test_the_library_takes_its_settings_from_the_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in FULL.to_env().items():
        monkeypatch.setenv(var, value)
    opts = resolve_options(None, None, None, None, None)
    assert (opts.job, opts.replica, opts.worker, opts.devices) == (
        "j1",
        "r1",
        3,
        ["GPU-a", "GPU-b"],
    )
    assert (opts.scope, opts.addr, opts.prefix) == ("job", "nats://h:4222", "mk")
    assert (opts.epoch, opts.incarnation, opts.agent_socket) == (7, 2, FULL.agent_socket)
    # The supervisor resolves its own settings: it never talks to a socket of its parent's.
    assert resolve_options(None, None, None, None, None, role="supervisor").agent_socket is None
    # Arguments win over the environment.
    opts = resolve_options("r2", ["d"], "j2", None, "replica", worker=0, prefix="p")
    assert (opts.replica, opts.job, opts.scope, opts.worker, opts.prefix) == (
        "r2",
        "j2",
        "replica",
        0,
        "p",
    )


def test_devices_are_comma_separated_and_trimmed() -> None:
    assert parse_devices(" a , b,,c ") == ("a", "b", "c")
    assert parse_devices("") is None and parse_devices(None) is None
