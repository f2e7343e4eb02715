"""How a trainer starts (agent/supervise/start_choice.py): every branch of the choice, from the
facts alone."""

from __future__ import annotations

import dataclasses

import pytest

from agent.supervise.start_choice import (
    ZYGOTE_RETRIES,
    StartFacts,
    StartMode,
    choose,
    needs_import_check,
)

WARM = StartFacts(prespawn=True, python_command=True, fork_server=True, imports_agent=True)


@pytest.mark.parametrize(
    ("change", "mode", "reason"),
    [
        ({}, StartMode.ZYGOTE, "--fork-server"),
        ({"imports_agent": None}, StartMode.ZYGOTE, "--fork-server"),
        ({"prespawn": False}, StartMode.COLD, "--no-prespawn"),
        ({"python_command": False}, StartMode.COLD, "not a python SCRIPT"),
        ({"imports_agent": False}, StartMode.COLD, "cannot import the agent package"),
        ({"fork_server": False}, StartMode.PRESTARTED, "--no-fork-server"),
        ({"fork_unsafe": True}, StartMode.PRESTARTED, "unsafe"),
        ({"zygote_failures": ZYGOTE_RETRIES}, StartMode.PRESTARTED, "failed 3 times in a row"),
        ({"zygote_failures": ZYGOTE_RETRIES - 1}, StartMode.ZYGOTE, "--fork-server"),
        ({"has_pidfd": False}, StartMode.PRESTARTED, "no pidfd_open"),
    ],
)
def test_each_fact_and_the_mode_it_leads_to(
    change: dict[str, object], mode: StartMode, reason: str
) -> None:
    chosen, why = choose(dataclasses.replace(WARM, **change))
    assert chosen is mode
    assert reason in why


def test_cold_wins_over_everything_warm() -> None:
    broken = dataclasses.replace(WARM, fork_unsafe=True, zygote_failures=9, has_pidfd=False)
    assert choose(dataclasses.replace(broken, prespawn=False))[0] is StartMode.COLD
    assert choose(dataclasses.replace(broken, imports_agent=False))[0] is StartMode.COLD


def test_the_import_check_is_made_once_before_a_prestarted_start_only() -> None:
    unknown = dataclasses.replace(WARM, imports_agent=None)
    assert needs_import_check(dataclasses.replace(unknown, fork_server=False))
    assert not needs_import_check(unknown)  # the fork server's own failure says so
    assert not needs_import_check(dataclasses.replace(unknown, prespawn=False))
    assert not needs_import_check(dataclasses.replace(WARM, fork_server=False))  # known
