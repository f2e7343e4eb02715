"""``marduk agent run --nproc-per-node N`` with real processes: torchrun's contract, one restart
of every rank when one fails, log files and prefixes, standalone (no NATS), joining a controller
started later, and nothing left behind (grace honoured, SIGTERM ignored, setsid'd grandchildren).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from agent.supervise.supervisor import ExitCode
from tests.conftest import NatsServer
from tests.processes import Proc, agent_run, controller, inject

pytestmark = pytest.mark.e2e
RANKS = [sys.executable, "tests/trainers/ranks.py"]


def launch(env: dict[str, str], *options: str, trainer: list[str], nproc: int = 4) -> Proc:
    return agent_run(
        env,
        *("--replica", "r1", "--nproc-per-node", str(nproc), "--preload", "none"),
        *options,
        cmd=trainer,
    )


def envs(p: Proc) -> list[dict[str, str]]:
    """The ENV lines the ranks printed, in order, with the console prefix they came with."""
    out = []
    for line in p.all:
        if "ENV {" in line:
            prefix, _, payload = line.partition("ENV ")
            out.append({**json.loads(payload), "prefix": prefix})
    return out


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_four_ranks_get_torchruns_variables_and_one_crash_restarts_all_four_once(
    env: dict[str, str], tmp_path: Path
) -> None:
    # No NATS at env's address: standalone needs none.
    a = launch(
        env,
        *("--standalone", "--devices", "a,b,c,d", "--rank-devices", "split"),
        *("--log-dir", str(tmp_path / "logs"), "--tee", "3"),
        trainer=[*RANKS, "--steps", "8", "--crash-rank", "2"],
    )
    assert a.proc.wait(60) == ExitCode.OK, "".join(a.all)
    seen = envs(a)
    assert len(seen) == 8, "".join(a.all)  # four ranks, started twice
    for attempt in (0, 1):
        ranks = [e for e in seen if e["TORCHELASTIC_RESTART_COUNT"] == str(attempt)]
        assert sorted(int(e["RANK"]) for e in ranks) == [0, 1, 2, 3]
        assert len({e["MASTER_PORT"] for e in ranks}) == 1  # one master per incarnation
        for e in ranks:
            local = int(e["LOCAL_RANK"])
            assert e["RANK"] == str(local)
            assert e["prefix"] == f"[rank{local}]:"
            assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) == ("4", "4", "0")
            assert e["MASTER_ADDR"] == "127.0.0.1"
            assert e["MARDUK_DEVICES"] == "abcd"[local]
            assert e["CUDA_VISIBLE_DEVICES"] == str(local)
            assert e["MARDUK_RESTART_COUNT"] == str(attempt)
            assert e["MARDUK_AGENT_SOCKET"].endswith(f"agent-{local}.sock")
            assert e["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
    assert any("local rank 2 crashed (exit code 3)" in line for line in a.all)
    # The trainers forked ahead of time are the agent's own, not processes left behind.
    assert not any("left behind" in line or "fork server:" in line for line in a.all)
    # torchrun's layout: attempt_N/LOCAL_RANK/{stdout,stderr}.log, without the console prefix.
    (run,) = (tmp_path / "logs").glob("default_r1_0_*")  # one directory per run
    assert "ValueError: rank crash" in (run / "attempt_0" / "2" / "stderr.log").read_text()
    out = (run / "attempt_1" / "3" / "stdout.log").read_text()
    assert out.startswith("ENV {") and "DONE rank 3" in out and "[rank" not in out


CRASH_EARLY = ("--steps", "5", "--step-seconds", "0", "--crash-rank", "1")


def test_restarts_right_after_the_first_step_sweep_neither_forks_nor_zombies(
    env: dict[str, str],
) -> None:
    # Each incarnation crashes right after its first steps, while the next trainers are being
    # forked ahead of time: those are the agent's own, not processes left behind to sweep; nor
    # is a child that exited already (a zombie the agent adopts when its rank ends).
    a = launch(
        env,
        *("--standalone", "--max-restarts", "4"),
        trainer=[*RANKS, *CRASH_EARLY, "--crashes", "4", "--zombie"],
    )
    assert a.proc.wait(120) == ExitCode.OK, "".join(a.all)
    out = "".join(a.all)
    assert out.count("crashed (exit code 3)") == 4, out
    assert "left behind" not in out and "fork server:" not in out, out


def test_redirected_streams_go_to_files_only_and_the_filter_hides_ranks(
    env: dict[str, str], tmp_path: Path
) -> None:
    a = launch(
        env,
        *("--standalone", "--log-dir", str(tmp_path), "--redirects", "0:1"),
        *("--local-ranks-filter", "0,1"),
        trainer=[*RANKS, "--steps", "2"],
        nproc=3,
    )
    assert a.proc.wait(60) == ExitCode.OK, "".join(a.all)
    console = "".join(a.all)
    assert "[rank0]:ENV" not in console and "[rank0]:to stderr" in console  # stdout redirected
    assert "[rank1]:ENV" in console and "[rank2]:" not in console  # rank 2 filtered out
    (run,) = tmp_path.glob("default_r1_0_*")
    assert "DONE rank 0" in (run / "attempt_0" / "0" / "stdout.log").read_text()


def test_an_output_line_longer_than_the_pipe_reader_limit_passes_through_whole(
    env: dict[str, str],
) -> None:
    # 70 KB on one line, then more than a pipe's 64 KiB of steps: a pump that died on the long
    # line would leave the trainer blocked on write, "hung" with no restart left: exit 70.
    a = launch(
        env,
        *("--standalone", "--hang-timeout", "30", "--max-restarts", "0"),
        trainer=[*RANKS, "--long-line", "70000", "--steps", "8000", "--step-seconds", "0"],
        nproc=2,
    )
    assert a.proc.wait(120) == ExitCode.OK, "".join(a.all)[-2000:]
    long = "L" * 70000 + " END-OF-LONG-LINE\n"
    assert sorted(line[: line.index("L")] for line in a.all if line.endswith(long)) == [
        "[rank0]:",
        "[rank1]:",
    ]
    assert sum("DONE rank" in line for line in a.all) == 2


def process_at_pid(pid: int, tries: int = 200) -> subprocess.Popen[bytes] | None:
    """An unrelated ``setsid sleep`` given exactly ``pid`` (through ns_last_pid), or None."""
    for _ in range(tries):
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        except OSError:
            return None
        p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


@pytest.mark.serial  # steers the machine-wide pid counter: no other test may fork meanwhile
def test_a_finished_ranks_reused_pid_is_never_signalled(
    env: dict[str, str], tmp_path: Path
) -> None:
    crash = tmp_path / "crash"
    trainer = [*RANKS, "--steps", "3", "--finish-rank", "1", "--crash-rank", "0"]
    a = launch(
        env,
        *("--standalone", "--grace", "5"),
        trainer=[*trainer, "--crash-file", str(crash)],
        nproc=2,
    )
    a.expect("local rank 1 finished")
    pid = next(e["pid"] for e in envs(a) if e["RANK"] == "1")
    stranger = process_at_pid(pid)
    if stranger is None:
        a.stop()
        pytest.skip("cannot steer pids (/proc/sys/kernel/ns_last_pid not writable)")
    try:
        crash.touch()  # rank 0 crashes: every rank stops and restarts, rank 1's old pgid too
        assert a.proc.wait(60) == ExitCode.OK, "".join(a.all)
        assert stranger.poll() is None, "the agent signalled a process that reused a rank's pid"
    finally:
        stranger.kill()
        stranger.wait()


def test_a_python_without_marduk_starts_four_ranks_cold_instead_of_giving_up(
    env: dict[str, str],
) -> None:
    # The interpreter the venv was made from: the trainer runs, the fork server cannot.
    python = os.path.join(sys.base_prefix, "bin", "python3")
    if subprocess.run([python, "-c", "import msgspec"], capture_output=True).returncode == 0:
        pytest.skip(f"{python} has marduk's dependencies: no python without them here")
    a = launch(
        env,
        *("--standalone", "--max-restarts", "0"),
        trainer=[python, "tests/trainers/ranks.py", "--steps", "3"],
    )
    assert a.proc.wait(90) == ExitCode.OK, "".join(a.all)
    assert sum("DONE rank" in line for line in a.all) == 4
    assert sum("cannot import marduk's agent package" in line for line in a.all) == 1


def test_each_run_logs_into_a_directory_of_its_own(env: dict[str, str], tmp_path: Path) -> None:
    for _ in range(2):
        a = launch(
            env,
            *("--standalone", "--log-dir", str(tmp_path), "--tee", "3"),
            trainer=[*RANKS, "--steps", "1"],
            nproc=2,
        )
        assert a.proc.wait(60) == ExitCode.OK, "".join(a.all)
    runs = sorted(tmp_path.glob("default_r1_0_*"))
    assert len(runs) == 2  # the second run did not overwrite the first one's logs
    for run in runs:
        assert "DONE rank 1" in (run / "attempt_0" / "1" / "stdout.log").read_text()
    a = launch(env, "--standalone", "--log-dir", str(tmp_path / "x"), trainer=RANKS, nproc=2)
    a.expect("nothing is written there without --tee or --redirects")
    a.stop()


def test_torch_gloo_four_ranks_restart_together_after_one_crashes(env: dict[str, str]) -> None:
    pytest.importorskip("torch", reason="torch (CPU) is not installed: pip install torch")
    a = launch(
        env,
        *("--standalone", "--preload", "torch"),
        trainer=[sys.executable, "tests/trainers/gloo.py", "--steps", "6", "--crash-rank", "1"],
    )
    assert a.proc.wait(120) == ExitCode.OK, "".join(a.all)
    ranks = [line for line in a.all if "RANKS rank=" in line]
    assert sorted(line.split("]:")[1].strip() for line in ranks) == sorted(
        f"RANKS rank={r} world=4 inc={i}" for r in range(4) for i in range(2)
    )
    assert sum("DONE rank" in line for line in a.all) == 4
    assert sum("sum=4" in line for line in a.all) >= 4 * 6  # all_reduce over four ranks


def test_with_no_controller_answering_the_agent_runs_standalone(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "js").start()  # NATS, but no controller
    try:
        a = agent_run(
            {"MARDUK_ADDR": server.url},
            *("--replica", "r1", "--devices", "d1", "--connect-timeout", "1"),
            *("--preload", "none"),
            cmd=[*RANKS, "--steps", "3"],
        )
        assert a.proc.wait(30) == ExitCode.OK, "".join(a.all)
        assert any("running standalone" in line for line in a.all)
        assert not any("Traceback" in line for line in a.all)
    finally:
        server.stop()


def test_a_standalone_agent_joins_a_controller_started_later_and_follows_it(
    env: dict[str, str],
) -> None:
    a = launch(env, "--standalone", "--devices", "a,b", trainer=RANKS, nproc=2)
    try:
        a.expect("step 3")
        controller(env)  # its embedded NATS comes up at env's address
        a.expect("joined the controller", timeout=30)
        inject(env, "b")
        a.expect("restart command epoch 1")
        a.expect('"TORCHELASTIC_RESTART_COUNT": "1"')
        assert all(e["MARDUK_EPOCH"] == "1" for e in envs(a)[2:])
    finally:
        a.stop()


def test_after_the_controller_disappears_a_crash_restarts_locally_without_waiting_on_it(
    env: dict[str, str], tmp_path: Path
) -> None:
    ctl = controller(env)  # with its embedded NATS: both go
    crash = tmp_path / "crash"
    a = launch(
        env,
        *("--devices", "a,b"),
        trainer=[*RANKS, "--steps", "30", "--crash-rank", "1", "--crash-file", str(crash)],
        nproc=2,
    )
    a.expect("step 3")
    ctl.stop(signal.SIGKILL)
    a.expect("lost the connection to NATS")
    crash.touch()
    assert a.proc.wait(60) == ExitCode.OK, "".join(a.all)
    out = "".join(a.all)
    assert "report crashed not sent: no connection to NATS" in out, out
    assert "not delivered" not in out, out  # nothing waited for an answer, nothing was buffered
    assert out.index("report crashed not sent") < out.index("incarnation 1")


def test_the_grace_period_is_honoured_for_a_rank_that_checkpoints(env: dict[str, str]) -> None:
    a = launch(
        env,
        *("--standalone", "--grace", "10"),
        trainer=[*RANKS, "--crash-rank", "1", "--checkpoint-seconds", "1", "--steps", "40"],
        nproc=2,
    )
    a.expect("SIGTERM rank 0: checkpointing")
    a.expect("SAVED rank 0")  # a second later: not SIGKILLed meanwhile
    assert a.proc.wait(60) == ExitCode.OK, "".join(a.all)
    assert not any("SIGKILL" in line for line in a.all)


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace(env: dict[str, str]) -> None:
    a = launch(
        env,
        *("--standalone", "--grace", "1"),
        trainer=[*RANKS, "--crash-rank", "1", "--ignore-sigterm", "--steps", "40"],
        nproc=2,
    )
    a.expect("IGNORING SIGTERM rank 0")
    a.expect("ignored SIGTERM for 1s; SIGKILL")
    a.expect('"TORCHELASTIC_RESTART_COUNT": "1"')
    first = next(e["pid"] for e in envs(a) if e["RANK"] == "0")
    assert gone(int(first))
    a.stop()


def test_sigterm_while_the_ranks_stop_for_a_restart_starts_nothing_new(
    env: dict[str, str],
) -> None:
    a = launch(
        env,
        *("--standalone", "--grace", "20"),
        trainer=[*RANKS, "--crash-rank", "1", "--checkpoint-seconds", "5"],
        nproc=2,
    )
    a.expect("SIGTERM rank 0: checkpointing")  # rank 1 crashed; rank 0 saves for 5 s
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(60) == ExitCode.PREEMPTED, "".join(a.all)
    assert not any("incarnation 1" in line for line in a.all), "".join(a.all)
    assert any("SIGTERM to the agent (preemption or eviction)" in line for line in a.all)


def test_sigterm_while_waiting_for_the_controller_exits_without_starting(
    env: dict[str, str],
) -> None:
    a = launch(env, "--connect-timeout", "60", trainer=RANKS, nproc=2)  # no NATS there
    a.expect("the trainers start once it answers (up to 60 s; --standalone starts them now")
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(45) == ExitCode.PREEMPTED, "".join(a.all)
    assert any("SIGTERM before the trainers started" in line for line in a.all)
    assert not envs(a), "".join(a.all)


def test_a_second_signal_ends_the_grace_period(env: dict[str, str]) -> None:
    a = launch(
        env,
        *("--standalone", "--grace", "600"),
        trainer=[*RANKS, "--ignore-sigterm"],
        nproc=2,
    )
    a.expect("step 2")
    a.proc.send_signal(signal.SIGINT)
    a.expect("IGNORING SIGTERM")
    a.proc.send_signal(signal.SIGINT)
    assert a.proc.wait(60) == ExitCode.PREEMPTED, "".join(a.all)  # not after 600 s
    assert any("SIGINT again: the trainers get no more grace" in line for line in a.all)
    assert any("SIGINT to the agent (interrupted)" in line for line in a.all)


def test_grandchildren_that_setsid_away_end_with_their_rank_and_with_the_agent(
    env: dict[str, str],
) -> None:
    a = launch(
        env,
        "--standalone",
        trainer=[*RANKS, "--crash-rank", "1", "--setsid-child"],
        nproc=2,
    )
    a.expect('"TORCHELASTIC_RESTART_COUNT": "1"')
    a.expect("step 2")
    grandchildren = [int(line.split("GRANDCHILD ")[1]) for line in a.all if "GRANDCHILD" in line]
    assert len(grandchildren) >= 3  # two of the first incarnation, one or two of the second
    first = grandchildren[:2]
    assert all(gone(pid) for pid in first), [psutil.Process(p).status() for p in first]
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(30) == ExitCode.PREEMPTED
    time.sleep(0.2)
    now = [int(line.split("GRANDCHILD ")[1]) for line in a.all if "GRANDCHILD" in line]
    left = [pid for pid in now if not gone(pid)]
    assert not left, f"still running: {left}"


def test_two_nodes_of_two_ranks_restart_together_through_the_controller(
    controller_env: dict[str, str],
) -> None:
    """--nnodes 2: two agents of one replica (scope job), four gloo ranks; one crash restarts
    both nodes once, at the controller's epoch."""
    pytest.importorskip("torch", reason="torch (CPU) is not installed: pip install torch")
    from tests.conftest import free_port

    port = str(free_port())
    nodes = [
        agent_run(
            controller_env,
            *("--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2"),
            *("--master-port", port, "--devices", f"n{n}a,n{n}b", "--scope", "job"),
            *("--preload", "torch", "--grace", "3"),
            cmd=[sys.executable, "tests/trainers/gloo.py", "--steps", "8", "--crash-rank", "3"],
        )
        for n in range(2)
    ]
    for n, a in enumerate(nodes):
        assert a.proc.wait(120) == ExitCode.OK, "".join(a.all)
        ranks = sorted(line.split("]:")[1].strip() for line in a.all if "RANKS rank=" in line)
        assert ranks == sorted(
            f"RANKS rank={r} world=4 inc={i}" for r in (2 * n, 2 * n + 1) for i in range(2)
        ), "".join(a.all)


def test_without_the_fork_server_each_rank_starts_from_its_own_prestarted_trainer(
    env: dict[str, str],
) -> None:
    a = launch(
        env,
        *("--standalone", "--no-fork-server"),
        trainer=[*RANKS, "--crash-rank", "1", "--steps", "30"],
        nproc=2,
    )
    assert a.proc.wait(60) == ExitCode.OK, "".join(a.all)
    seen = envs(a)
    assert sorted((e["RANK"], e["TORCHELASTIC_RESTART_COUNT"]) for e in seen) == [
        ("0", "0"),
        ("0", "1"),
        ("1", "0"),
        ("1", "1"),
    ]
    assert {e["MARDUK_WARM_START"] for e in seen} == {"standby"}  # a prestarted trainer


def test_the_jax_example_one_process_per_host_standalone_resumes_after_a_kill(
    env: dict[str, str], tmp_path: Path
) -> None:
    """JAX's way: one process per host seeing every device (--rank-devices all), no NATS."""
    pytest.importorskip("jax", reason="jax is not installed")
    import os

    jax_env = {
        **env,
        "MARDUK_CKPT_DIR": str(tmp_path / "ckpt"),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    a = agent_run(
        jax_env,
        *("--standalone", "--nproc-per-node", "1", "--replica", "r1", "--devices", "d1,d2"),
        *("--grace", "10", "--startup-timeout", "180", "--preload", "none"),
        cmd=[
            sys.executable,
            "examples/jax_trainer.py",
            *("--ckpt-every", "5", "--step-seconds", "0.02"),
        ],
    )
    started = a.expect("trainer started: pid", timeout=60)
    a.expect("step 12 loss", timeout=120)
    os.kill(int(started.split("pid ")[1].split(",")[0]), signal.SIGKILL)
    a.expect("trainer crashed (SIGKILL)")
    resumed = a.expect("resuming at step", timeout=120)
    assert int(resumed.split()[-1]) >= 10
    a.expect(f"step {int(resumed.split()[-1]) + 2} loss", timeout=120)
    a.stop()
