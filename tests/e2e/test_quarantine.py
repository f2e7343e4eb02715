"""Flap damping, quarantine and drain end to end: real controller, real agents, real CLI."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import marduk_cli
from tests.processes import Proc, agent_run, controller, status

pytestmark = pytest.mark.e2e
TOY = [sys.executable, "tests/trainers/toy.py", "--step-seconds", "0.05"]


def cli(env: dict[str, str], *args: str) -> str:
    r = marduk_cli("monitor", *args, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def exit_code(p: Proc, timeout: float = 30) -> int:
    return p.proc.wait(timeout)


def test_a_flapping_device_is_quarantined_its_pod_exits_71_until_undrained(
    env: dict[str, str],
) -> None:
    env = {**env, "MARDUK_FLAP_LIMIT": "1"}
    ctl = controller(env)
    agent = agent_run(env, "--replica", "r1", "--devices", "gpu-a,gpu-b", cmd=TOY)
    try:
        agent.expect("START r1/0 epoch=0")
        cli(env, "inject-failure", "gpu-a")  # the first failure: a restart
        agent.expect("START r1/0 epoch=1")
        cli(env, "mark-healthy", "gpu-a")
        out = cli(env, "inject-failure", "gpu-a")  # back to failed: flapping, quarantined
        assert "fail" in out, out
        assert exit_code(agent) == 71
        [dev] = [d for d in status(env)["devices"] if d["device"] == "gpu-a"]
        assert dev["quarantined"] and "flapping" in dev["out_reason"]
        # A new pod on the same device is refused at once: exit 71, the trainer never starts.
        again = agent_run(env, "--replica", "r1", "--devices", "gpu-a,gpu-b", cmd=TOY)
        assert exit_code(again) == 71
        assert "out of service" in "".join(again.all)
        assert not any("START" in line for line in again.all)
        # The operator puts it back: the next pod runs.
        assert "1 device back in service: gpu-a" in cli(env, "undrain", "gpu-a")
        third = agent_run(env, "--replica", "r1", "--devices", "gpu-a,gpu-b", cmd=TOY)
        third.expect("START r1/0")
        # Drain by hand: the running replica gets fail and exits 71.
        out = cli(env, "drain", "gpu-b", "--reason", "suspect NVLink")
        assert "1 device drained: gpu-b" in out and "fail sent to default/r1" in out
        assert exit_code(third) == 71
    finally:
        agent.stop()
        ctl.stop()


def test_a_preemption_notice_makes_the_trainer_checkpoint_and_keep_training(
    env: dict[str, str],
) -> None:
    ctl = controller(env)
    lib = [sys.executable, "tests/trainers/lib_trainer.py", "--mode", "checkpoint"]
    agent = agent_run(env, "--replica", "r1", "--devices", "tpu-0,tpu-1", cmd=lib)
    try:
        agent.expect("CONNECTED")
        out = cli(
            env, "inject-failure", "tpu-0", "--state", "preempting", "--reason", "GCE TERMINATE"
        )
        assert "checkpoint" in out, out
        line = agent.expect("CHECKPOINT SAVED step=")
        step = int(line.split("step=")[1])

        def checkpointed() -> bool:
            [w] = status(env)["workers"]
            return bool(w["status"] == "checkpointed" and w["step"] is not None)

        from tests.conftest import eventually_sync

        eventually_sync(checkpointed)
        [dev] = [d for d in status(env)["devices"] if d["device"] == "tpu-0"]
        assert dev["state"] == "preempting"
        # Not a restart: the same trainer goes on stepping, and asked once.
        assert sum("CONNECTED" in x for x in agent.all) == 1
        assert sum("CHECKPOINT SAVED" in x for x in agent.all) == 1 and step >= 1
        assert agent.proc.poll() is None
    finally:
        agent.stop()
        ctl.stop()


@pytest.mark.parametrize("expect", ["1", "99"])
def test_a_device_check_runs_before_restarting_after_a_device_failure(
    env: dict[str, str], expect: str
) -> None:
    """The trainer dies with an XID (a check_device diagnosis). With --preflight, a fresh
    process checks the devices first: it passes (the trainer restarts) or, when the host lacks
    a device, fails (exit 71: the pod goes back to the scheduler, no restart into it)."""
    ctl = controller(env)
    crash = [
        sys.executable, "tests/trainers/toy.py", "--step-seconds", "0.05", "--crash-at", "5",
        "--crash-line", "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus",
    ]  # fmt: skip
    agent = agent_run(
        {**env, "JAX_PLATFORMS": "cpu"},
        "--replica", "r1", "--devices", "gpu-a", "--preflight", "--preflight-expect", expect,
        cmd=crash,
    )  # fmt: skip
    try:
        agent.expect("START r1/0 epoch=0")
        if expect == "1":
            agent.expect("device check after gpu_xid passed", timeout=60)
            agent.expect("START r1/0 epoch=1")
        else:
            assert exit_code(agent, timeout=90) == 71
            out = "".join(agent.all)
            assert "device check after gpu_xid failed" in out and "jax sees 1" in out
            assert out.count("START r1/0") == 1
            [w] = status(env)["workers"]
            assert w["failure_class"] == "preflight"
    finally:
        agent.stop()
        ctl.stop()
