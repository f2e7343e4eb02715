"""The pieces ``marduk agent run``'s shell is built from, each alone: no process, no socket
(the shell together is tested in tests/e2e/test_supervisor_processes.py)."""

from __future__ import annotations

import asyncio
import io
import re
import signal
from collections import Counter

from agent.channel import handoff
from agent.library.client import Command
from agent.library.options import Options
from agent.supervise.launch import LaunchSpec, LogSpec, Std
from agent.supervise.output import RankOutput, read_output, step_of
from agent.supervise.rank_facts import CommandArrived, Preempted, Rank, RankExited, Tick, decide
from agent.supervise.reports import answered_epoch, failure_report, restart_for_others
from agent.supervise.signals import Signals
from agent.supervise.signatures import Diagnosis
from agent.supervise.supervision import ExitCode, Forward, GiveUp, Limits, Restart, Supervision
from agent.supervise.telemetry import Telemetry, gauges, readiness
from agent.supervise.trainer_env import rank_env, trainer_env
from marduk.wire import protocol as wire


def options(**changes: object) -> Options:
    fields: dict[str, object] = {
        "job": "j",
        "replica": "r0",
        "worker": 3,
        "devices": ["GPU-a", "GPU-b"],
        "addr": "nats://h:4222",
        "prefix": "marduk",
        "scope": "replica",
        "timeout": 5.0,
        "incarnation": 0,
        "epoch": 0,
        "role": "supervisor",
    }
    return Options(**{**fields, **changes})  # type: ignore[arg-type]


def stream(data: bytes, limit: int = 64) -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=limit)
    reader.feed_data(data)
    reader.feed_eof()
    return reader


# --- output -------------------------------------------------------------------------------------


def test_a_line_longer_than_the_limit_comes_back_in_pieces_never_an_error() -> None:
    async def lines() -> list[bytes]:
        reader, out = stream(b"x" * 150 + b"\nshort\nlast"), []  # (a loop: the reader's)
        while line := await read_output(reader):
            out.append(line)
        return out

    got = asyncio.run(lines())
    assert b"".join(got) == b"x" * 150 + b"\nshort\nlast"
    assert len(got) > 3  # the long line in pieces
    assert got[-2:] == [b"short\n", b"last"]


def test_step_of_reads_the_first_group_and_ignores_what_is_no_number() -> None:
    step_re = re.compile(r"step[= ](\S+)")
    assert step_of(step_re, "loss 0.1 step=42") == 42
    assert step_of(step_re, "step=abc") is None
    assert step_of(step_re, "no progress here") is None
    assert step_of(re.compile(r"step"), "step") is None  # no group


def test_the_pump_prefixes_whole_lines_keeps_the_tail_and_reports_steps() -> None:
    out, steps = io.BytesIO(), []
    output = RankOutput(
        LogSpec(),
        r"step (\d+)",
        "j_r0_3_",
        lambda rank, step: steps.append((rank, step)),
        consoles=lambda _which: out,
    )
    rank = Rank(1, "/nowhere.sock", tail_lines=3)
    data = b"step 1\n" + b"y" * 100 + b"\nstep 2\n"

    async def pump() -> None:
        await output.pump(rank, stream(data), Std.OUT, b"[rank1]: ")

    asyncio.run(pump())
    assert out.getvalue() == b"[rank1]: step 1\n[rank1]: " + b"y" * 100 + b"\n[rank1]: step 2\n"
    assert steps == [(1, 1), (1, 2)]
    assert rank.tail[0] == "y" * 100 and rank.tail[-1] == "step 2"


# --- the facts the core is fed -------------------------------------------------------------------


def core(nproc: int = 2) -> Supervision:
    c = Supervision(Limits(max_restarts=3), nproc, epoch=4)
    c.started(0.0)
    return c


def command(kind: str, epoch: int) -> Command:
    return Command(
        kind=kind,  # type: ignore[arg-type]
        epoch=epoch,
        reason="r",
        devices=(),
        job="j",
        replica="r0",
        scope="replica",
        command_id="c",
        issued_at=0.0,
        received_at=0.0,
    )


def test_an_exit_of_an_incarnation_already_stopped_decides_nothing() -> None:
    c = core()
    assert decide(c, RankExited(incarnation=c.incarnation - 1, rank=0, returncode=1), 1.0) is None
    decision = decide(c, RankExited(incarnation=c.incarnation, rank=0, returncode=1), 1.0)
    assert isinstance(decision, Restart) and decision.rank == 0 and decision.failure


def test_a_peer_notice_is_never_the_cores_and_a_checkpoint_is_forwarded() -> None:
    c = core()
    assert decide(c, CommandArrived(command("peer_failed", 0)), 1.0) is None
    assert isinstance(decide(c, CommandArrived(command("checkpoint", 5)), 1.0), Forward)
    assert isinstance(decide(c, CommandArrived(command("restart", 5)), 1.0), Restart)


def test_a_signal_gives_up_with_the_preemption_code() -> None:
    decision = decide(core(), Preempted("SIGINT"), 1.0)
    assert isinstance(decision, GiveUp) and decision.code == ExitCode.PREEMPTED
    assert decide(core(), Tick(), 1.0) is None


def test_the_nodes_step_is_the_lowest_of_the_ranks_that_stepped() -> None:
    c = core(3)
    assert c.step is None
    c.progress(0, 10, 1.0)
    c.progress(2, 7, 1.0)
    c.progress(1, None, 1.0)  # a heartbeat
    assert c.step == 7


# --- reports -------------------------------------------------------------------------------------


def test_a_crash_report_names_the_rank_the_code_and_the_diagnosis() -> None:
    crash = Restart(why="w", epoch=4, failure="crashed", rank=1, returncode=-9)
    d = Diagnosis("oom", "restart", "out of memory", ("MemoryError",))
    line, fields = failure_report("crashed", crash, d, ["a", "b"], nproc=2)
    assert line == "local rank 1 crashed (SIGKILL): oom - out of memory"
    assert fields["exit_code"] is None and fields["signal"] == "SIGKILL"
    assert fields["lines"] == ["MemoryError"] and fields["action"] == "restart"


def test_an_undiagnosed_hang_reports_why_and_the_tail() -> None:
    hang = Restart(why="no step for 60s", epoch=4, failure="hung", rank=0, returncode=143)
    tail = [str(i) for i in range(8)]
    line, fields = failure_report("hung", hang, None, tail, nproc=1)
    assert line == "trainer hung (exit code 143)"
    assert fields["summary"] == "no step for 60s" and fields["failure_class"] == ""
    assert fields["lines"] == ["3", "4", "5", "6", "7"]


def test_the_answered_epoch_is_the_highest_action_never_below_the_running_one() -> None:
    assert answered_epoch(5, None) is None
    action = wire.Action(job="j", replica="r0", kind="restart", epoch=9)
    assert answered_epoch(5, wire.ReportReply(actions=[action])) == 9
    assert answered_epoch(12, wire.ReportReply(actions=[action])) == 12
    assert answered_epoch(5, wire.ReportReply(actions=[])) == 5


def test_the_other_ranks_are_told_to_restart_at_the_answered_epoch() -> None:
    crash = Restart(why="w", epoch=4, failure="crashed", rank=2)
    cmd = restart_for_others(options(), 7, crash, command_id="local-1-0", issued_at=1.5)
    assert (cmd.kind, cmd.epoch, cmd.job, cmd.replica) == ("restart", 7, "j", "r0")
    assert cmd.reason == "local rank 2 crashed" and cmd.command_id == "local-1-0"


# --- metrics -------------------------------------------------------------------------------------


def test_ready_only_once_every_rank_runs_and_has_stepped() -> None:
    at = {"incarnation": 2, "epoch": 5, "step": 10}
    assert readiness([True, False], [], **at) == (False, "not every trainer is running")
    assert readiness([True, True], [1], **at) == (
        False,
        "local rank(s) [1] (incarnation 2) has not stepped yet",
    )
    assert readiness([True], [0], **at) == (False, "trainer (incarnation 2) has not stepped yet")
    assert readiness([True, True], [], **at) == (True, "trainer stepping (epoch 5, step 10)")


def test_the_gauges_say_what_runs_at_which_epoch() -> None:
    got = {m.name: m.samples[0].value for m in gauges(2, 7, -1)}
    assert got == {
        "marduk_agent_trainer_running": 2.0,
        "marduk_agent_epoch": 7.0,
        "marduk_agent_incarnation": 0.0,  # before the first start
    }


def test_a_restart_is_timed_from_the_trainers_end_once() -> None:
    t = Telemetry(Counter(), list)
    t.trainers_started(5.0)  # the first start: no restart
    t.trainers_ended(10.0)
    t.trainers_started(12.5)
    t.trainers_started(20.0)
    assert t.registry.get_sample_value("marduk_agent_restart_seconds_count") == 1
    assert t.registry.get_sample_value("marduk_agent_restart_seconds_sum") == 2.5


# --- the trainers' environment -------------------------------------------------------------------


def test_every_trainer_gets_its_environment_the_handoff_and_unbuffered_output() -> None:
    env = trainer_env(
        options(),
        epoch=6,
        incarnation=-1,
        launch=LaunchSpec(nproc_per_node=2),
        environ={"PATH": "/bin", handoff.EPOCH: "1"},
        supervisor_pid=77,
    )
    assert env["PATH"] == "/bin" and env["PYTHONUNBUFFERED"] == "1"
    assert env[handoff.EPOCH] == "6" and env[handoff.RESTART_COUNT] == "0"
    assert env[handoff.SUPERVISOR_PID] == "77" and env[handoff.DEVICES] == "GPU-a,GPU-b"
    assert env["OMP_NUM_THREADS"] == "1"  # several ranks, none set: as torchrun does


def test_each_rank_gets_its_socket_and_torchruns_variables() -> None:
    base = {"PATH": "/bin"}
    spec = LaunchSpec(nproc_per_node=2)
    env = rank_env(
        base,
        rank=1,
        socket_path="/run/agent-1.sock",
        placed=spec,
        devices=["GPU-a", "GPU-b"],
        incarnation=3,
        master_port=29555,
    )
    assert env[handoff.AGENT_SOCKET] == "/run/agent-1.sock"
    assert env["LOCAL_RANK"] == "1" and env["MASTER_PORT"] == "29555"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "3"
    alone = rank_env(
        base, rank=0, socket_path="/s", placed=None, devices=[], incarnation=0, master_port=0
    )
    assert alone == {"PATH": "/bin", handoff.AGENT_SOCKET: "/s"}


# --- signals -------------------------------------------------------------------------------------


def test_the_first_signal_is_noted_the_second_hurries() -> None:
    async def scenario() -> tuple[list[str], bool, bool, str]:
        seen: list[str] = []
        s = Signals(seen.append)
        s.handle(signal.SIGINT)
        first_hurry = s.hurry.is_set()
        s.handle(signal.SIGTERM)
        return seen, first_hurry, s.hurry.is_set(), s.name

    assert asyncio.run(scenario()) == (["SIGINT"], False, True, "SIGINT")


def test_work_is_cut_short_by_a_signal_and_not_started_after_one() -> None:
    async def scenario() -> tuple[int | None, int | None, bool, int | None]:
        s = Signals(lambda _name: None)
        quick = await s.or_signal(asyncio.sleep(0, result=1))
        slow = asyncio.ensure_future(s.or_signal(asyncio.sleep(60, result=2)))
        await asyncio.sleep(0.01)
        s.handle(signal.SIGTERM)
        cut = await slow
        never = asyncio.sleep(0, result=3)
        after = await s.or_signal(never)
        return quick, cut, s.signalled.is_set(), after

    assert asyncio.run(scenario()) == (1, None, True, None)
