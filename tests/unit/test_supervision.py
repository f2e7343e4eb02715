"""The agent's supervision core (agent/supervise/supervision.py): every rule, no process, no clock."""

from __future__ import annotations

import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.supervise.supervision import (
    ExitCode,
    Finish,
    Forward,
    GiveUp,
    Grace,
    Ignore,
    Limits,
    Restart,
    Supervision,
    describe,
    describe_returncode,
)

LIMITS = Limits(max_restarts=2, restart_window_s=100.0, hang_timeout_s=10.0, startup_timeout_s=60.0)


def started(nproc: int = 1, epoch: int = 0, now: float = 0.0) -> Supervision:
    s = Supervision(LIMITS, nproc, epoch=epoch)
    s.started(now)
    return s


# --- exits, budget, give-up ------------------------------------------------------------------------


def test_a_crash_restarts_at_the_current_epoch_and_counts_against_the_budget() -> None:
    s = started(epoch=4)
    d = s.exited(0, 3, now=1.0)
    assert d == Restart("exit 3", 4, "crashed", 0, 3)
    assert list(s.failures) == [1.0]


def test_a_signal_death_is_named() -> None:
    d = started().exited(0, -signal.SIGKILL, now=1.0)
    assert isinstance(d, Restart) and d.why == "exit SIGKILL"


def test_past_the_budget_the_agent_gives_up_with_70() -> None:
    s = started()
    assert isinstance(s.exited(0, 1, now=1.0), Restart)
    s.started(1.5)
    assert isinstance(s.exited(0, 1, now=2.0), Restart)
    s.started(2.5)
    d = s.exited(0, 1, now=3.0)
    assert isinstance(d, GiveUp) and d.code == ExitCode.GAVE_UP and d.failure == "crashed"
    assert "restarted 2 times within 100s; giving up" in d.why


def test_failures_older_than_the_window_no_longer_count() -> None:
    s = started()
    s.exited(0, 1, now=1.0)
    s.exited(0, 1, now=2.0)
    d = s.exited(0, 1, now=102.5)  # the first two are more than 100 s old
    assert isinstance(d, Restart)
    assert list(s.failures) == [102.5]


def test_zero_restarts_gives_up_at_the_first_failure() -> None:
    s = Supervision(Limits(max_restarts=0), 1)
    s.started(0.0)
    d = s.exited(0, 1, now=0.1)
    assert isinstance(d, GiveUp) and d.code == ExitCode.GAVE_UP


def test_a_clean_exit_finishes() -> None:
    finished = started().exited(0, 0, now=5.0)
    assert finished == Finish()
    assert finished.why == "every rank finished"  # what the stop logs, as for any decision


# --- several local ranks ---------------------------------------------------------------------------


def test_every_rank_must_finish_before_the_agent_does() -> None:
    s = started(nproc=4)
    assert [s.exited(r, 0, now=1.0) for r in (0, 2, 1)] == [None, None, None]
    assert s.exited(3, 0, now=1.0) == Finish()


def test_any_rank_failing_restarts_them_all_and_says_which() -> None:
    s = started(nproc=4)
    s.exited(0, 0, now=1.0)  # one finished already: it restarts too
    d = s.exited(2, 3, now=2.0)
    assert isinstance(d, Restart) and d.rank == 2 and d.why == "local rank 2: exit 3"


def test_a_new_incarnation_forgets_who_finished() -> None:
    s = started(nproc=2)
    s.exited(0, 0, now=1.0)
    assert s.started(2.0) == 1
    assert s.exited(1, 0, now=3.0) is None  # rank 0 of this incarnation has not finished


def test_finished_ranks_are_not_hung() -> None:
    s = started(nproc=2)
    s.progress(0, 1, now=1.0)
    s.progress(1, 1, now=1.0)
    s.exited(0, 0, now=2.0)
    s.progress(1, 2, now=50.0)
    assert s.tick(55.0) is None  # rank 0 made no step since 1.0, but it is done


@given(
    nproc=st.integers(1, 8),
    order=st.lists(st.integers(0, 7), min_size=1, max_size=30),
    failing=st.integers(-1, 7),
)
def test_finish_only_when_every_rank_exited_zero(
    nproc: int, order: list[int], failing: int
) -> None:
    s = Supervision(Limits(max_restarts=100), nproc)
    s.started(0.0)
    done: set[int] = set()
    for r in (x % nproc for x in order):
        d = s.exited(r, 1 if r == failing else 0, now=1.0)
        if r == failing:
            assert isinstance(d, Restart) and d.rank == r
            return
        done.add(r)
        assert (d == Finish()) == (done == set(range(nproc)))


# --- hangs, startup, sections ------------------------------------------------------------------------


def test_no_first_step_within_the_startup_timeout_is_a_hang() -> None:
    s = started(now=0.0)
    assert s.tick(59.0) is None
    d = s.tick(61.0)
    assert isinstance(d, Restart) and d.failure == "hung"
    assert d.why == "no first step within 60s"


def test_ranks_never_started_or_stopped_cannot_hang() -> None:
    # An agent waiting for its place (a spare, a job below MIN) has no trainer: a SIGTERM
    # then must be reported as what it is, not as "no first step within 60s".
    waiting = Supervision(LIMITS, 2)
    assert waiting.tick(1e6) is None
    s = started(now=0.0)
    s.progress(0, 3, now=1.0)
    s.stopped()  # between incarnations, or waiting for the next epoch's place
    assert s.tick(1e6) is None
    s.started(2e6)
    assert isinstance(s.tick(2e6 + 61.0), Restart)


def test_no_step_for_the_hang_timeout_is_a_hang() -> None:
    s = started()
    assert s.progress(0, 7, now=1.0) is True  # the first sign of life
    assert s.progress(0, 8, now=2.0) is False
    assert s.tick(11.0) is None
    d = s.tick(12.5)
    assert isinstance(d, Restart) and d.why == "no step after 8 for 10s"


def test_heartbeats_count_as_progress() -> None:
    s = started()
    s.progress(0, 1, now=1.0)
    s.progress(0, None, now=9.0)
    assert s.tick(15.0) is None


def test_a_section_past_its_own_timeout_is_a_hang_though_steps_continue() -> None:
    s = started(nproc=2)
    s.section(1, "checkpoint", True, 3.0, now=1.0)
    s.progress(0, 5, now=4.5)
    s.progress(1, 5, now=4.5)
    d = s.tick(4.5)
    assert isinstance(d, Restart) and d.rank == 1
    assert d.why == "local rank 1: section 'checkpoint' open for more than 3s"


def test_a_silent_rank_is_not_hung_while_another_steps() -> None:
    s = started(nproc=4)
    s.progress(0, 1, now=1.0)  # only rank 0 prints its steps
    for t in range(2, 100):
        s.progress(0, t, now=float(t))
        assert s.tick(t + 0.5) is None  # past the startup and hang timeouts of ranks 1-3


def test_a_node_wide_hang_blames_the_rank_that_stopped_first() -> None:
    s = started(nproc=3)
    s.progress(0, 5, now=5.0)
    s.progress(1, 3, now=3.0)  # stuck since 3.0; 0 waits for it in a collective from 5.0
    d = s.tick(16.0)  # rank 2 never printed a step: not the one to blame
    assert isinstance(d, Restart) and d.failure == "hung" and d.rank == 1


def test_a_finished_rank_gives_the_silent_ones_a_whole_hang_timeout() -> None:
    s = started(nproc=2)
    s.progress(0, 5, now=5.0)  # only rank 0 prints its steps
    assert s.exited(0, 0, now=6.0) is None
    assert s.tick(15.5) is None  # 10.5 s after rank 0's last step, 9.5 s after it finished
    d = s.tick(16.5)
    assert isinstance(d, Restart) and d.rank == 1


def test_several_ranks_hang_when_none_steps() -> None:
    s = started(nproc=2)
    assert s.tick(59.0) is None
    d = s.tick(61.0)
    assert isinstance(d, Restart) and d.why == "no first step on any local rank within 60s"
    s.started(70.0)
    s.progress(1, 4, now=71.0)
    s.progress(0, 3, now=72.0)
    d = s.tick(82.5)
    assert isinstance(d, Restart) and d.why == "no step after 4 on any local rank for 10s"


def test_a_closed_section_or_one_without_timeout_never_hangs() -> None:
    s = started()
    s.section(0, "save", True, 3.0, now=1.0)
    s.section(0, "save", False, None, now=2.0)
    s.section(0, "eval", True, None, now=2.0)
    assert s.tick(8.0) is None


def test_a_hang_counts_against_the_budget_like_a_crash() -> None:
    s = Supervision(Limits(max_restarts=1, hang_timeout_s=1.0), 1)
    s.started(0.0)
    s.exited(0, 1, now=0.5)
    s.started(1.0)
    s.progress(0, 1, now=1.0)
    d = s.tick(3.0)
    assert isinstance(d, GiveUp) and d.failure == "hung" and d.code == ExitCode.GAVE_UP


# --- commands and epoch fencing --------------------------------------------------------------------


def test_a_restart_command_restarts_at_its_epoch_outside_the_budget() -> None:
    s = started(epoch=2)
    d = s.command("restart", 3, "device d1 failed")
    assert d == Restart("restart command epoch 3: device d1 failed", 3)
    assert not s.failures
    s.restarting_at(3)
    assert s.epoch == 3


def test_a_restart_command_not_newer_than_the_running_epoch_is_ignored() -> None:
    s = started(epoch=3)
    assert isinstance(s.command("restart", 3, "resent"), Ignore)
    assert isinstance(s.command("restart", 2, "late"), Ignore)


def test_fail_and_stop_give_up_with_their_codes() -> None:
    s = started()
    fail = s.command("fail", 1, "bad device")
    stop = s.command("stop", 1, "operator")
    assert isinstance(fail, GiveUp) and fail.code == ExitCode.DEVICE_FAILED
    assert isinstance(stop, GiveUp) and stop.code == ExitCode.STOPPED


def test_checkpoint_is_forwarded_and_nothing_stops() -> None:
    d = started().command("checkpoint", 1, "maintenance in 60 s")
    assert isinstance(d, Forward) and "maintenance" in d.why


def test_a_checkpoint_of_an_older_epoch_is_not_for_these_ranks() -> None:
    # A grow joiner starts at the grow's epoch; the checkpoint asked of the members before it
    # (queued while the joiner waited for its place) has nothing for it to save.
    d = started(epoch=6).command("checkpoint", 5, "grow: save a checkpoint now")
    assert isinstance(d, Ignore) and d.why == "checkpoint of epoch 5: the ranks run at epoch 6"
    assert isinstance(started(epoch=5).command("checkpoint", 5, "grow"), Forward)


def test_epochs_never_go_backwards() -> None:
    s = started(epoch=5)
    assert s.restart_epoch(3) == 5
    assert s.restart_epoch(7) == 7
    s.restarting_at(6)
    assert s.epoch == 7


# --- how long the ranks get to stop -----------------------------------------------------------------


def test_a_restart_command_gets_the_restart_grace() -> None:
    """A peer crashed or a device failed: every process of the scope stops at once, so the
    trainer's save on SIGTERM (JAX's sync point) cannot complete; no waiting it out."""
    grace = Grace(full_s=30.0, restart_s=0.5)
    s = started(epoch=2)
    assert grace.of(s.command("restart", 3, "worker job/r0/1 crashed")) == 0.5
    assert Grace(full_s=0.2, restart_s=0.5).of(Restart("restart command", 3)) == 0.2  # at most


def test_the_pod_leaving_gets_the_full_grace() -> None:
    """A preemption, eviction, fail, stop or spent budget: the last save on SIGTERM matters."""
    grace = Grace(full_s=30.0, restart_s=0.5)
    s = started(epoch=2)
    leaving = [
        s.preempted(),
        s.command("fail", 3, "device quarantined"),
        s.command("stop", 4, "operator"),
        GiveUp(ExitCode.GAVE_UP, "budget", "crashed", 0, 1),
        Finish(),
    ]
    assert [grace.of(d) for d in leaving] == [30.0] * len(leaving)


def test_a_local_failure_no_controller_answered_keeps_the_full_grace() -> None:
    """Standalone only this node's ranks stop: a sibling's save of its own state may complete."""
    s = started(nproc=2, epoch=3)
    d = s.exited(1, 3, now=1.0)
    assert isinstance(d, Restart) and d.failure == "crashed"
    grace = Grace(full_s=30.0, restart_s=0.5)
    assert grace.of(d) == grace.of(d, answered=None, epoch=3) == 30.0
    assert grace.of(d, answered=3, epoch=3) == 30.0  # no new epoch: nobody else restarts


def test_a_local_failure_the_controller_restarts_the_scope_for_gets_the_restart_grace() -> None:
    """It answered the report with a new epoch: every process of the scope is stopping, the
    other local ranks' mesh with the crashed one included."""
    s = started(nproc=2, epoch=3)
    d = s.exited(1, 3, now=1.0)
    assert Grace(full_s=30.0, restart_s=0.5).of(d, answered=4, epoch=3) == 0.5


# --- preemption, standalone, joining -----------------------------------------------------------------


def test_sigterm_to_the_agent_is_preemption() -> None:
    d = started().preempted()
    assert d.code == ExitCode.PREEMPTED == 143
    assert d.why == "SIGTERM to the agent (preemption or eviction)"


def test_ctrl_c_is_not_called_an_eviction() -> None:
    d = started().preempted("SIGINT")
    assert d.code == ExitCode.PREEMPTED
    assert d.why == "SIGINT to the agent (interrupted)"


def test_standalone_a_local_failure_keeps_the_epoch() -> None:
    s = started(epoch=2)
    s.exited(0, 1, now=1.0)
    assert s.restart_epoch(None) == 2  # no controller answered: only a controller issues epochs


def test_joining_a_controller_adopts_its_epoch_so_its_next_command_is_news() -> None:
    s = started(epoch=0)
    assert s.joined(4, []) is None
    assert isinstance(s.command("restart", 4, "old"), Ignore)
    assert isinstance(s.command("restart", 5, "new"), Restart)


def test_joining_a_controller_that_put_our_devices_out_of_service_gives_up() -> None:
    d = started().joined(1, ["d1"])
    assert isinstance(d, GiveUp) and d.code == ExitCode.DEVICE_FAILED and "d1" in d.why


def test_registering_before_the_start_with_devices_out_of_service_gives_up() -> None:
    s = Supervision(LIMITS, 2, epoch=0)  # the trainers have not started: this is the first word
    d = s.joined(3, ["d1", "d2"])
    assert d == GiveUp(
        ExitCode.DEVICE_FAILED, "device(s) d1, d2 out of service (quarantined or drained)"
    )
    assert s.epoch == 3  # adopted all the same: the controller's epochs apply


def test_registering_before_the_start_with_usable_devices_goes_on() -> None:
    s = Supervision(LIMITS, 1, epoch=0)
    assert s.joined(2, []) is None and s.epoch == 2


def test_nproc_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Supervision(LIMITS, 0)


def test_a_returncode_in_words() -> None:
    assert describe_returncode(3) == (3, "") and describe(3) == "3"
    assert describe_returncode(-9) == (None, "SIGKILL") and describe(-9) == "SIGKILL"
    assert describe(-99) == "signal 99"
