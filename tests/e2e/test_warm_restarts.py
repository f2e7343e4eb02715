"""Warm restarts from the fork server (agent/supervise/zygote.py), with real processes: every restart of
a burst is forked from the zygote, the trainer is a clean process, nothing is left behind, and
a dead zygote costs one cold start, not the job. No timed assertions: how each trainer was
started is asserted from what it reports (``MARDUK_WARM_START``), not from the clock."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import psutil
import pytest

from agent.supervise.supervisor import ExitCode
from tests.conftest import eventually_sync
from tests.processes import Proc, agent_run

pytestmark = pytest.mark.e2e
PROBE = [sys.executable, "tests/trainers/warm_probe.py"]


def agent(env: dict[str, str], *trainer: str, extra: tuple[str, ...] = ()) -> Proc:
    return agent_run(
        env,
        *("--replica", "r1", "--devices", "d1", "--grace", "5", "--max-restarts", "20"),
        *extra,
        cmd=[*PROBE, *trainer],
    )


def facts(p: Proc) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line.split("FACTS ", 1)[1]) for line in p.all if line.startswith("FACTS ")]


def wait_facts(p: Proc, inc: int) -> dict:  # type: ignore[type-arg]
    p.expect(f'"inc": {inc},', timeout=60)
    return next(f for f in facts(p) if f["inc"] == inc)


def descendants(p: Proc) -> list[psutil.Process]:
    try:
        return psutil.Process(p.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def zygote_pid(p: Proc) -> int:
    """The agent's current fork server (its trainers have its command line too)."""
    started = [line for line in p.all if "fork server started: pid" in line]
    return int(started[-1].split("pid ")[1].split(",")[0])


def test_back_to_back_faults_each_restart_from_the_zygote_into_a_clean_process(
    controller_env: dict[str, str],
) -> None:
    """A trainer that crashes 0.3 s after every start, 6 times: each restart is a fork."""
    a = agent(controller_env, "--crashes", "6", "--steps", "3", extra=("--preload", "numpy"))
    assert a.proc.wait(90) == ExitCode.OK
    seen = facts(a)
    assert [f["inc"] for f in seen] == list(range(7))
    assert sum("trainer crashed (exit code 3)" in line for line in a.all) == 6
    for f in seen:
        assert f["by"] == "zygote", f
        assert f["threads"] == 1  # no thread inherited from the zygote
        assert f["ppid"] == a.proc.pid  # the agent's own child: it reaps it, it dies with it
        assert f["pgid"] == f["sid"] == f["pid"]  # its own session: not the zygote's
        assert f["sigterm_default"] and f["sigint_default"]
        assert f["sigmask"] == []
        assert f["stdin"] == "/dev/null"  # not the zygote's socket, nor a pipe of the agent's
        assert set(f["fds"]) <= {0, 1, 2, 3}  # 3: the probe's own listing of /proc/self/fd
    # Each fork draws fresh entropy, as a fresh interpreter would.
    assert len({f["random"] for f in seen}) == len({f["numpy"] for f in seen}) == len(seen)


def test_a_killed_zygote_costs_one_cold_start_then_restarts_are_warm_again(
    controller_env: dict[str, str], tmp_path: Path
) -> None:
    a = agent(controller_env, "--crash-dir", str(tmp_path))
    assert wait_facts(a, 0)["by"] == "zygote"
    a.expect("step 10")
    zygote = psutil.Process(zygote_pid(a))
    assert zygote.ppid() == a.proc.pid
    running = next(f for f in facts(a) if f["inc"] == 0)["pid"]
    zygote.kill()
    zygote.wait(10)
    a.expect("step 20")  # the running trainer outlives its zygote
    assert psutil.pid_exists(running)
    bys = []
    for inc in range(4):
        (tmp_path / f"crash-{inc}").touch()
        bys.append(wait_facts(a, inc + 1)["by"])
        a.expect("step 10", timeout=60)  # its successor starts once it has stepped
    # The trainer forked ahead of time (if it was) still starts warm; then one cold start;
    # a new zygote takes over from there.
    assert "cold" in bys[:2], bys
    assert bys[-1] == "zygote", bys
    assert sum("starting the trainer cold" in line for line in a.all) == 1
    assert zygote_pid(a) != zygote.pid and psutil.pid_exists(zygote_pid(a))
    a.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_process_is_left_behind(controller_env: dict[str, str], sig: int) -> None:
    """The agent's whole tree (zygote, trainer, the trainer forked ahead) ends with it: after
    a clean stop, and through PR_SET_PDEATHSIG when the agent is SIGKILLed."""
    a = agent(controller_env)
    wait_facts(a, 0)
    # The zygote, the running trainer and the next one, forked once the first has stepped.
    eventually_sync(lambda: len(descendants(a)) >= 3, timeout=30)
    tree = descendants(a)
    a.proc.send_signal(sig)
    a.proc.wait(30)
    _gone, alive = psutil.wait_procs(tree, timeout=15)
    assert not alive, [(p.pid, p.cmdline()) for p in alive]


def test_a_zygote_that_would_fork_threads_falls_back_to_prestarted_trainers(
    controller_env: dict[str, str],
) -> None:
    """A preloaded module started a thread: forking is unsafe, so the zygote refuses and the
    agent uses prestarted trainers; the job runs and restarts all the same."""
    a = agent(
        controller_env,
        "--crashes",
        "2",
        "--steps",
        "3",
        extra=("--preload", "tests.trainers.starts_a_thread"),
    )
    assert a.proc.wait(90) == ExitCode.OK
    assert any("cannot fork trainers" in line and "preloaded-worker" in line for line in a.all)
    assert [f["by"] for f in facts(a)] == ["standby", "standby", "standby"]


def test_without_the_fork_server_prestarted_trainers_start_the_trainers(
    controller_env: dict[str, str],
) -> None:
    a = agent(controller_env, "--crashes", "1", "--steps", "3", extra=("--no-fork-server",))
    assert a.proc.wait(60) == ExitCode.OK
    bys = [f["by"] for f in facts(a)]
    # MARDUK_WARM_START=standby: the first from a prestarted trainer started on the spot; the
    # restart from one (ready or not).
    assert bys == ["standby", "standby"]
    assert not any("fork server started" in line for line in a.all)
