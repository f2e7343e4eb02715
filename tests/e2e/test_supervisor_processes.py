"""``marduk agent run`` with real processes: restarts, hangs, give-up, targeted and job restarts."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from agent.supervise.supervisor import ExitCode
from tests.conftest import NatsServer
from tests.processes import Proc, agent_run, controller, inject

pytestmark = pytest.mark.e2e
TOY = [sys.executable, "tests/trainers/toy.py"]


def agent(
    env: dict[str, str],
    replica: str,
    devices: str,
    *trainer: str,
    worker: int = 0,
    extra: tuple[str, ...] = (),
) -> Proc:
    return agent_run(
        env,
        *("--replica", replica, "--worker", str(worker), "--devices", devices),
        *("--grace", "5", "--preload", "none", *extra),
        cmd=[*TOY, *trainer],
    )


def test_crash_is_diagnosed_restarted_at_a_new_epoch_then_clean_exit(
    controller_env: dict[str, str],
) -> None:
    env = controller_env
    a = agent(env, "r1", "d1", "--crash-at", "2", "--steps", "3")
    a.expect("START r1/0 epoch=0 inc=0")
    a.expect("python_exception - ValueError: toy crash")
    a.expect("START r1/0 epoch=1 inc=1")
    a.expect("DONE r1/0")
    assert a.proc.wait(20) == ExitCode.OK


def test_keeps_crashing_gives_up_with_documented_code(controller_env: dict[str, str]) -> None:
    env = controller_env
    a = agent(
        env,
        "r1",
        "d1",
        "--crash-at",
        "1",
        "--crash-incarnations",
        "99",
        extra=("--max-restarts", "2", "--no-prespawn"),
    )
    assert a.proc.wait(30) == ExitCode.GAVE_UP
    assert sum("START r1/0" in line for line in a.all) == 3  # first run + 2 restarts
    assert any("giving up" in line for line in a.all)


def test_hang_is_caught_and_restarted(controller_env: dict[str, str]) -> None:
    env = controller_env
    a = agent(env, "r1", "d1", "--hang-at", "2", "--steps", "4", extra=("--hang-timeout", "1"))
    a.expect("no step after 2 for 1s")
    a.expect("START r1/0 epoch=1 inc=1")
    a.expect("DONE r1/0")
    assert a.proc.wait(20) == ExitCode.OK


def test_device_failure_restarts_only_the_replica_on_it(controller_env: dict[str, str]) -> None:
    env = controller_env
    r1 = agent(env, "r1", "d1,d2")
    r2 = agent(env, "r2", "d3")
    try:
        r1.expect("START r1/0 epoch=0")
        r2.expect("START r2/0 epoch=0")
        r1.expect("step 3")
        inject(env, "d2")
        r1.expect("SIGTERM r1/0: checkpointing")  # the trainer got its grace period
        r1.expect("START r1/0 epoch=1 inc=1")
        r1.expect("step 2")
        assert not any("START r2/0 epoch=1" in line for line in r2.all)
    finally:
        r1.stop()
        r2.stop()


def test_job_scope_restarts_every_worker_once(controller_env: dict[str, str]) -> None:
    env = controller_env
    agents = [
        agent(env, f"r{r}", f"dev{r}{w}", worker=w, extra=("--scope", "job"))
        for r in range(2)
        for w in range(2)
    ]
    try:
        for a in agents:
            a.expect("step 2")
        inject(env, "dev01")
        for a in agents:
            a.expect("epoch=1 inc=1")
        for a in agents:
            a.expect("step 3")
        starts = [sum("START" in line for line in a.all) for a in agents]
        assert starts == [2, 2, 2, 2]
    finally:
        for a in agents:
            a.stop()


def test_sigterm_is_forwarded_and_reported_as_preemption(controller_env: dict[str, str]) -> None:
    env = controller_env
    a = agent(env, "r1", "d1")
    a.expect("step 2")
    a.proc.send_signal(signal.SIGTERM)
    a.expect("SIGTERM r1/0: checkpointing")
    assert a.proc.wait(20) == ExitCode.PREEMPTED


def test_unreachable_controller_is_a_setup_error(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "js").start()
    try:
        a = agent_run(
            {"MARDUK_ADDR": server.url},
            *("--replica", "r1", "--devices", "d1", "--connect-timeout", "1"),
            "--require-controller",
            cmd=TOY,
        )
        assert a.proc.wait(30) == ExitCode.SETUP
        assert any("cannot register" in line for line in a.all)
        assert not any("Traceback" in line for line in a.all)
    finally:
        server.stop()


def test_fail_command_makes_the_agent_exit_for_pod_replacement(env: dict[str, str]) -> None:
    env["MARDUK_DEVICE_MAX_FAILURES"] = "0"  # the first failure of a device escalates
    controller(env)
    a = agent(env, "r1", "d1")
    a.expect("step 2")
    inject(env, "d1")
    assert a.proc.wait(20) == ExitCode.DEVICE_FAILED
    assert any("fail command" in line for line in a.all)


def test_prespawned_trainer_has_its_modules_imported_before_it_runs(
    controller_env: dict[str, str], tmp_path: Path
) -> None:
    """A prestarted trainer imports --preload while it waits; the trainer finds it in
    sys.modules."""
    env = controller_env
    probe = "import sys; print('PRELOADED', 'email.mime.text' in sys.modules)"
    preload = ("--devices", "d1", "--preload", "email.mime.text")
    # `python -c` cannot be pre-spawned: it runs directly, nothing preloaded.
    a = agent_run(env, "--replica", "r1", *preload, cmd=[sys.executable, "-c", probe])
    a.expect("PRELOADED False")
    assert a.proc.wait(20) == ExitCode.OK
    script = tmp_path / "probe.py"
    script.write_text(probe + "\n")
    b = agent_run(env, "--replica", "r2", *preload, cmd=[sys.executable, str(script)])
    b.expect("(pre-spawned)")
    b.expect("PRELOADED True")
    assert b.proc.wait(20) == ExitCode.OK


def test_prestarted_command_forms() -> None:
    from agent.supervise.supervisor import prestarted_command

    assert prestarted_command(["python3", "t.py", "-x"], ["jax"]) == [
        "python3",
        "-m",
        "agent.supervise.prestarted",
        "--preload",
        "jax",
        "--",
        "t.py",
        "-x",
    ]
    assert prestarted_command(["python", "-m", "pkg.train"], []) == [
        "python",
        "-m",
        "agent.supervise.prestarted",
        "--preload",
        "",
        "--",
        "-m",
        "pkg.train",
    ]
    assert prestarted_command(["python", "-u", "t.py"], []) is None
    assert prestarted_command(["bash", "run.sh"], []) is None
