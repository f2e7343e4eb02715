"""How a trainer starts: forked from the fork server, from a prestarted trainer, or cold — chosen
from the facts alone, with the reason. The Starter (agent/supervise/starter.py) gathers the facts,
applies the choice, and falls back when a warm start fails (which changes the facts)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

ZYGOTE_RETRIES: Final = 3  # fork server failures in a row before prestarted trainers are used


class StartMode(enum.Enum):
    ZYGOTE = "zygote"  # forked from the fork server (zygote.py), the framework imported
    PRESTARTED = "prestarted"  # its own process, started ahead of time (prestarted.py)
    COLD = "cold"  # the command itself, started now


@dataclass(frozen=True, slots=True)
class StartFacts:
    """What the choice depends on."""

    prespawn: bool  # --prespawn
    python_command: bool  # the command is ``python SCRIPT`` or ``python -m MODULE``
    fork_server: bool  # --fork-server
    # Can the trainer's python import the agent package (the fork server and a prestarted
    # trainer run in it)? None: not checked yet.
    imports_agent: bool | None = None
    zygote_failures: int = 0  # in a row
    fork_unsafe: bool = False  # the fork server said forking cannot be done safely here
    has_pidfd: bool = True  # os.pidfd_open (Linux 5.3 and later)


def choose(facts: StartFacts) -> tuple[StartMode, str]:
    """The start mode for the next trainer, and why."""
    if not facts.prespawn:
        return StartMode.COLD, "--no-prespawn"
    if not facts.python_command:
        return StartMode.COLD, "not a python SCRIPT or python -m MODULE command"
    if facts.imports_agent is False:
        return StartMode.COLD, "the trainer's python cannot import the agent package"
    if not facts.fork_server:
        return StartMode.PRESTARTED, "--no-fork-server"
    if facts.fork_unsafe:
        return StartMode.PRESTARTED, "forking the trainer is unsafe"
    if facts.zygote_failures >= ZYGOTE_RETRIES:
        return (
            StartMode.PRESTARTED,
            f"the fork server failed {facts.zygote_failures} times in a row",
        )
    if not facts.has_pidfd:
        return StartMode.PRESTARTED, "no pidfd_open (Linux before 5.3)"
    return StartMode.ZYGOTE, "--fork-server"


def needs_import_check(facts: StartFacts) -> bool:
    """Check whether the trainer's python imports the agent package before the first prestarted
    trainer starts (once): a warm start that cannot import it would die before the trainer runs,
    and that death would count as the trainer's crash. (A fork server that cannot import it
    fails, and the check is made then.)"""
    return facts.imports_agent is None and choose(facts)[0] is StartMode.PRESTARTED
