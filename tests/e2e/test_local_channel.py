"""A supervised trainer's library talks to its local agent: progress, sections, commands."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import marduk_cli
from tests.processes import Proc, agent_run, inject

pytestmark = pytest.mark.e2e


def supervised(env: dict[str, str], mode: str, *extra: str) -> Proc:
    # Steps come only from the library: no output line matches the step regex.
    return agent_run(
        env,
        *("--replica", "r1", "--devices", "d1", "--preload", "none", "--grace", "3"),
        *("--step-regex", r"NEVER(\d+)", *extra),
        cmd=[sys.executable, "tests/trainers/lib_trainer.py", "--mode", mode],
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
