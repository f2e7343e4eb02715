"""``marduk agent run`` as a new user meets it, with real processes: what it says and reports
when it is stopped before its trainers start, and when it cannot start as asked."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from agent.supervise.supervision import ExitCode
from tests.processes import agent_run, controller, inject, status

WAITER = (
    *("--nnodes", "2:2", "--scope", "job", "--nproc-per-node", "1", "--no-prespawn"),
    *("--startup-timeout", "0.2", "--monitor-interval", "0.05"),
)


def test_a_sigterm_while_waiting_for_ranks_is_a_preemption_not_a_hang(
    controller_env: dict[str, str],
) -> None:
    # One agent of a job of two: it waits for its place, its ticks queue up meanwhile (each
    # past --startup-timeout); none of them may read the SIGTERM's stop as a hang.
    a = agent_run(controller_env, *WAITER, "--job", "waiting", cmd=[sys.executable, "-c", "0"])
    a.expect("waiting for the controller to assign", timeout=30)
    time.sleep(1.0)
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(30) == ExitCode.PREEMPTED
    out = "".join(a.all)
    assert "hung" not in out and "no first step" not in out, out
    assert "SIGTERM to the agent (preemption or eviction): no trainer had started" in out, out
    [worker] = status(controller_env)["workers"]
    assert worker["status"] == "preempted" and worker["failure_class"] == "", worker


def test_a_fork_server_whose_python_lacks_marduk_says_so_at_once_and_claims_nothing(
    controller_env: dict[str, str], tmp_path: Path
) -> None:
    # A python without the agent's dependencies (no site-packages: no msgspec), as a system
    # python is: its fork server dies importing; the agent says so, naming the interpreter
    # and the missing module, while it still waits for its place, and never claims "ready".
    python = tmp_path / "python3"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    (tmp_path / "train.py").write_text("print('never run')\n")
    a = agent_run(
        controller_env,
        *("--nnodes", "2:2", "--scope", "job", "--nproc-per-node", "1", "--preload", "none"),
        cmd=[str(python), str(tmp_path / "train.py")],
    )
    a.expect("waiting for the controller to assign", timeout=30)
    said = a.expect("cannot import marduk's agent package", timeout=20)
    assert str(python) in said and "No module named 'msgspec'" in said, said
    assert "starting every trainer cold" in said
    time.sleep(0.5)
    a.stop()
    assert not any("fork server is ready" in line for line in a.all), "".join(a.all)


def test_nnodes_one_to_one_has_one_member_and_the_others_wait_quietly(
    controller_env: dict[str, str], tmp_path: Path
) -> None:
    # --nnodes 1:1 without --node-rank: the controller assigns the one node rank, so a second
    # agent of the job is not a member (it ran rank 0 of world 1 too, before); it and a
    # spare wait at INFO, as waiting for a place is what they are for.
    (tmp_path / "train.py").write_text("import time\nprint('step 1', flush=True)\ntime.sleep(60)\n")
    one = ("--nnodes", "1:1", "--scope", "job", "--job", "one", "--preload", "none")
    cmd = [sys.executable, str(tmp_path / "train.py")]
    a = agent_run(controller_env, *one, "--replica", "a", cmd=cmd)
    a.expect("trainer started", timeout=30)
    b = agent_run(controller_env, *one, "--replica", "b", cmd=cmd)
    said = b.expect("not a member of the job at epoch", timeout=30)
    assert " INFO " in said and "waiting, its trainers not started" in said, said
    spare = agent_run(controller_env, *one, "--replica", "c", "--spare", cmd=cmd)
    said = spare.expect("a spare of the job", timeout=30)
    assert " INFO " in said and "a lost member's ranks" in said, said
    time.sleep(1.0)
    for p in (b, spare):
        p.stop()
        assert not any("trainer started" in line for line in p.all), "".join(p.all)
        assert not any("WARNING" in line and "member" in line for line in p.all)
    a.stop()


def test_a_fail_command_and_a_sigterm_are_each_said_once(
    env: dict[str, str], tmp_path: Path
) -> None:
    ctl = controller({**env, "MARDUK_DEVICE_MAX_FAILURES": "0"})
    (tmp_path / "train.py").write_text("import time\nprint('step 1', flush=True)\ntime.sleep(60)\n")
    cmd = [sys.executable, str(tmp_path / "train.py")]
    common = ("--devices", "d1", "--preload", "none")
    failed = agent_run(env, "--replica", "r1", *common, cmd=cmd)
    failed.expect("trainer started", timeout=30)
    inject(env, "d1")
    assert failed.proc.wait(30) == ExitCode.DEVICE_FAILED
    lines = [line for line in failed.all if "fail command" in line]
    assert len(lines) == 1 and " ERROR " in lines[0] and "giving up" in lines[0], lines
    stopped = agent_run(env, "--replica", "r2", *common[2:], "--devices", "d2", cmd=cmd)
    stopped.expect("trainer started", timeout=30)
    stopped.proc.send_signal(signal.SIGTERM)
    assert stopped.proc.wait(30) == ExitCode.PREEMPTED
    lines = [line for line in stopped.all if "SIGTERM to the agent" in line]
    assert len(lines) == 1 and "stopping the trainers" in lines[0], lines
    ctl.stop()


def test_nats_refusing_the_connection_is_said_at_once(env: dict[str, str], tmp_path: Path) -> None:
    # Nothing listens at env's address: "connection refused" is known at the first attempt,
    # so it is said then, not when --connect-timeout runs out; and nothing was ever "lost".
    a = agent_run(
        env,
        *("--replica", "r1", "--devices", "d1", "--connect-timeout", "30", "--no-prespawn"),
        cmd=[sys.executable, "-c", "import time; time.sleep(60)"],
    )
    said = a.expect("cannot reach NATS at", timeout=5)
    assert "(connection refused); retrying for up to 30 s, then running standalone" in said
    time.sleep(0.5)
    a.stop()
    assert not any("lost the connection" in line for line in a.all), "".join(a.all)


def test_giving_up_with_ranks_still_running_is_said_once(env: dict[str, str]) -> None:
    # Local rank 1 crashes past --max-restarts 0 while rank 0 runs: the give-up's reason is
    # said once (then the stop names the processes), not by the stop line and again after.
    code = (
        "import os, sys, time\n"
        "time.sleep(0.3)\n"
        "sys.exit(3) if os.environ['LOCAL_RANK'] == '1' else time.sleep(60)\n"
    )
    a = agent_run(
        env,
        *("--standalone", "--replica", "r1", "--nproc-per-node", "2", "--max-restarts", "0"),
        cmd=[sys.executable, "-c", code],
    )
    assert a.proc.wait(30) == ExitCode.GAVE_UP
    lines = [line for line in a.all if "local rank 1: exit 3" in line]
    assert len(lines) == 1 and " ERROR " in lines[0] and "giving up" in lines[0], a.all
