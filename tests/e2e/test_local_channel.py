"""A supervised trainer's library talks to its local agent: progress, sections, commands."""

from __future__ import annotations

import json
import re
import sys
import time

import pytest

from tests.conftest import eventually_sync, marduk_cli
from tests.processes import Proc, agent_run, inject

pytestmark = pytest.mark.e2e


def supervised(env: dict[str, str], mode: str, *extra: str, trainer: tuple[str, ...] = ()) -> Proc:
    # Steps come only from the library: no output line matches the step regex.
    return agent_run(
        env,
        *("--replica", "r1", "--devices", "d1", "--preload", "none", "--grace", "3"),
        *("--step-regex", r"NEVER(\d+)", *extra),
        cmd=[sys.executable, "tests/trainers/lib_trainer.py", "--mode", mode, *trainer],
    )


def test_library_steps_feed_hang_detection(controller_env: dict[str, str]) -> None:
    env = controller_env
    a = supervised(env, "steps-then-stall", "--hang-timeout", "1")
    try:
        a.expect("CONNECTED epoch=0 state=registered local=LocalAsyncClient")
        a.expect("STALLING")
        a.expect("no step after 19 for 1s", timeout=30)  # steps came from client.step()
        a.expect("CONNECTED epoch=1")
        # One registration, the supervisor's: the library did not register a second time.
        status = json.loads(marduk_cli("monitor", "status", "--json", env=env).stdout)
        assert [(w["replica"], w["role"]) for w in status["workers"]] == [("r1", "supervisor")]
    finally:
        a.stop()


def test_a_learned_hang_timeout_ends_a_hung_02s_step_job_within_5s_and_status_shows_it(
    controller_env: dict[str, str],
) -> None:
    """``--hang-timeout auto``: 20 intervals of 0.2 s (enough to learn from) make it 5 x 0.2 s,
    raised to the lower bound (3 s), not the 600 s upper bound; the next incarnation reports it
    learned."""
    env = controller_env
    a = supervised(
        env,
        "steps-then-stall",
        *("--hang-timeout", "auto"),
        trainer=("--steps", "21", "--step-seconds", "0.2"),
    )
    try:
        a.expect("STALLING", timeout=30)
        t = time.monotonic()
        a.expect("no step after 20 for 3s", timeout=30)
        assert time.monotonic() - t < 15  # 3 s and a tick; generous for a loaded machine
        a.expect("CONNECTED epoch=1")

        def learned() -> object:
            status = json.loads(marduk_cli("monitor", "status", "--json", env=env).stdout)
            # 20 intervals at the restart; more as the next incarnation steps.
            return re.search(
                r"hang 3s \(learned from \d+ steps\)", status["workers"][0]["timeouts"]
            )

        eventually_sync(learned, timeout=20)
    finally:
        a.stop()


def test_a_frozen_trainer_is_ended_after_its_hang_timeout_not_the_grace(
    controller_env: dict[str, str],
) -> None:
    """A trainer stopped (SIGSTOP: frozen, not dead) holds a SIGTERM pending: the agent wakes it
    (SIGCONT) so that it ends now, not after --grace (30 s here) with a SIGKILL."""
    env = controller_env
    a = supervised(env, "steps-then-freeze", "--hang-timeout", "1", "--grace", "30")
    try:
        a.expect("FREEZING")
        a.expect("no step after 19 for 1s", timeout=30)
        a.expect("SIGTERM command=", timeout=10)  # its handler ran: it was woken
        a.expect("CONNECTED epoch=1", timeout=10)
        assert not any("ignored SIGTERM" in line for line in a.all)
    finally:
        a.stop()


def test_section_timeout_counts_as_a_hang(controller_env: dict[str, str]) -> None:
    env = controller_env
    a = supervised(env, "long-section", "--hang-timeout", "600")
    try:
        a.expect("IN SECTION")
        a.expect("section 'checkpoint' open for more than 0.5s", timeout=30)
    finally:
        a.stop()


def test_commands_reach_the_trainer_through_its_agent(controller_env: dict[str, str]) -> None:
    env = controller_env
    a = supervised(env, "wait-command")
    try:
        a.expect("CONNECTED epoch=0")
        status = json.loads(marduk_cli("monitor", "status", "--json", env=env).stdout)
        assert [(w["replica"], w["role"]) for w in status["workers"]] == [("r1", "supervisor")]
        assert status["workers"][0]["status"] == "running"  # the supervisor reported
        inject(env, "d1")
        a.expect("SIGTERM command=restart epoch=1")
        a.expect("CONNECTED epoch=1")
    finally:
        a.stop()
