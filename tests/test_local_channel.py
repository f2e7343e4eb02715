"""A supervised trainer's library talks to its local agent: progress, sections, commands."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port, marduk_cli
from tests.test_e2e_acceptance import Proc, controller, inject

pytestmark = pytest.mark.e2e


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    e = {
        "MARDUK_ADDR": f"nats://127.0.0.1:{free_port()}",
        "MARDUK_STATE_DIR": str(tmp_path / "state"),
        "PYTHONUNBUFFERED": "1",
    }
    ctl = controller(e)
    yield e
    ctl.stop()


def supervised(env: dict[str, str], mode: str, *extra: str) -> Proc:
    return Proc(
        [
            sys.executable,
            "-m",
            "marduk",
            "agent",
            "run",
            "--replica",
            "r1",
            "--devices",
            "d1",
            "--preload",
            "none",
            "--grace",
            "3",
            "--step-regex",
            r"NEVER(\d+)",
            *extra,
            "--",
            sys.executable,
            "tests/trainers/lib_trainer.py",
            "--mode",
            mode,
        ],
        env,
    )


def test_library_steps_feed_hang_detection(env: dict[str, str]) -> None:
    a = supervised(env, "steps-then-stall", "--hang-timeout", "1")
    try:
        a.expect("CONNECTED epoch=0 state=registered local=LocalAsyncClient")
        a.expect("STALLING")
        a.expect("no step after 19 for 1s", timeout=30)  # steps came from client.step()
        a.expect("CONNECTED epoch=1")
    finally:
        a.stop()
    # One registration, the supervisor's: the library did not register a second time.
    status = json.loads(marduk_cli("monitor", "status", "--json", env=env).stdout)
    assert [(w["replica"], w["role"]) for w in status["workers"]] in ([], [("r1", "supervisor")])


def test_section_timeout_counts_as_a_hang(env: dict[str, str]) -> None:
    a = supervised(env, "long-section", "--hang-timeout", "600")
    try:
        a.expect("IN SECTION")
        a.expect("section 'checkpoint' open for more than 0.5s", timeout=30)
    finally:
        a.stop()


def test_commands_reach_the_trainer_through_its_agent(env: dict[str, str]) -> None:
    a = supervised(env, "wait-command")
    try:
        a.expect("CONNECTED epoch=0")
        status = json.loads(marduk_cli("monitor", "status", "--json", env=env).stdout)
        assert [(w["replica"], w["role"]) for w in status["workers"]] == [("r1", "supervisor")]
        inject(env, "d1")
        a.expect("SIGTERM command=restart epoch=1")
        a.expect("CONNECTED epoch=1")
    finally:
        a.stop()
