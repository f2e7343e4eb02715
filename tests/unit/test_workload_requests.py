"""A trainer's requests, pure: the checks the library and the agent share, the supervision
core's "stop restarting me", and the controller's rules (marduk/core/workload_requests.py)."""

from __future__ import annotations

import pytest

from agent.channel.requests import check, default_device
from agent.supervise.supervision import ExitCode, GiveUp, Limits, Restart, Supervision
from marduk.core.policy import Policy, PolicyError
from marduk.wire.protocol import WorkloadRequest
from tests.unit.test_policy import reg


@pytest.mark.parametrize(
    ("kind", "device", "reason", "code"),
    [
        ("reboot_me", None, "", "unknown_kind"),
        (3, None, "", "wrong_type"),
        ("exclude_node", None, b"bytes", "wrong_type"),
        ("device_bad", 7, "", "wrong_type"),
        ("device_bad", "has space", "", "wrong_type"),
        ("exclude_node", None, "x" * 1025, "oversized"),
        ("device_bad", "d" * 257, "", "oversized"),
        ("device_bad", None, "", "no_device"),
        ("stop_restarting", "d1", "", "wrong_type"),
    ],
)
def test_a_bad_request_is_refused_with_a_code_and_a_reason(
    kind: object, device: object, reason: object, code: str
) -> None:
    refusal = check(kind, device, reason)
    assert refusal is not None and refusal.code == code and refusal.why


def test_good_requests_pass_and_a_rank_with_one_device_names_it_by_default() -> None:
    assert check("stop_restarting", None, "done") is None
    assert check("exclude_node", None, "x" * 1024) is None
    assert check("device_bad", "GPU-1", "") is None
    assert default_device("device_bad", None, ["GPU-1"]) == "GPU-1"
    assert default_device("device_bad", None, ["GPU-1", "GPU-2"]) is None  # must name one
    assert default_device("exclude_node", None, ["GPU-1"]) is None


def test_after_stop_restarting_a_crash_ends_the_agent_with_the_trainers_exit_code() -> None:
    core = Supervision(Limits(max_restarts=3))
    core.started(0.0)
    assert isinstance(core.exited(0, 5, 1.0), Restart)  # before: restarted as ever
    core.started(2.0)
    core.stop_restarting("the trainer asked (done)")
    d = core.exited(0, 123, 3.0)
    assert isinstance(d, GiveUp) and d.code == 123 and "the trainer asked (done)" in d.why
    core.started(4.0)
    d = core.exited(0, -9, 5.0)  # killed by a signal: 128 + 9, as a shell says it
    assert isinstance(d, GiveUp) and d.code == 137


def test_after_stop_restarting_a_hang_or_a_restart_command_ends_the_agent_72() -> None:
    core = Supervision(Limits(hang_timeout_s=1.0))
    core.started(0.0)
    core.progress(0, 1, 0.5)
    core.stop_restarting("asked")
    d = core.tick(2.0)
    assert isinstance(d, GiveUp) and d.code == ExitCode.STOPPED and d.failure == "hung"
    d = core.command("restart", 5, "peer crashed")
    assert isinstance(d, GiveUp) and d.code == ExitCode.STOPPED and "not restarted" in d.why


def request(kind: str, *, replica: str = "r1", device: str | None = None) -> WorkloadRequest:
    return WorkloadRequest(job="j", replica=replica, kind=kind, device=device, request_id="q1")  # type: ignore[arg-type]


def test_exclude_node_drains_the_workers_own_devices_and_fails_its_scope() -> None:
    p = Policy()
    p.register(reg("r1", ["d1", "d2"]), now=0)
    p.register(reg("r2", ["d3"], pid=2), now=0)
    r = p.on_workload_request(request("exclude_node"), now=1)
    assert r.devices == ["d1", "d2"]
    assert [(c.replica, c.kind) for c in r.outcome.commands] == [("r1", "fail")]
    assert r.outcome.events[0].kind == "trainer_request"
    assert "drained by its trainer" in p.devices["d1"].out_reason
    assert "d3" not in p.devices or not p.devices["d3"].drained


def test_device_bad_is_a_failed_health_event_and_said_twice_restarts_once() -> None:
    p = Policy()
    p.register(reg("r1", ["d1"]), now=0)
    r = p.on_workload_request(request("device_bad", device="d1"), now=1)
    assert [(c.replica, c.kind) for c in r.outcome.commands] == [("r1", "restart")]
    again = p.on_workload_request(request("device_bad", device="d1"), now=2)
    assert not again.outcome.commands and "first decision" in again.detail


def test_a_request_about_another_workers_device_or_from_an_unknown_worker_is_refused() -> None:
    p = Policy()
    p.register(reg("r1", ["d1"]), now=0)
    p.register(reg("r2", ["d2"], pid=2), now=0)
    with pytest.raises(PolicyError) as e:
        p.on_workload_request(request("device_bad", device="d2"), now=1)
    assert e.value.code == "not_own_device"
    with pytest.raises(PolicyError) as e:
        p.on_workload_request(request("exclude_node", replica="nobody"), now=1)
    assert e.value.code == "unknown_worker"
    assert not p.devices  # nothing changed


def test_stop_restarting_is_only_an_event_at_the_controller() -> None:
    p = Policy()
    p.register(reg("r1", ["d1"]), now=0)
    r = p.on_workload_request(request("stop_restarting"), now=1)
    assert not r.outcome.commands and [e.kind for e in r.outcome.events] == ["trainer_request"]
