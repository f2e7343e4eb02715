"""The controller's role as a state machine: the roles, the events that move it, the table.

Pure: the controller tells ``RoleMachine`` what happened (elected, took over, deposed, ...) and
it answers with the role that follows, or raises ``IllegalTransition`` for an event the table
does not allow in the current role (a bug). Each change is logged once, with its reason. See
docs/architecture.md, *Leadership*.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

from marduk.errors import MardukError

log = logging.getLogger("marduk.controller")


class Role(enum.Enum):
    STARTING = "starting"
    """Connecting and opening the durable state; not campaigning yet."""
    STANDBY = "standby"
    """Campaigning for the lease, mirroring the state, preparing a takeover; serving nothing."""
    TAKING_OVER = "taking over"
    """Elected: claiming the term in the store and loading the state; handlers refuse."""
    SERVING = "serving"
    """The state is ours: handlers decide and commit (while the lease holds and NATS is up)."""
    STEPPING_DOWN = "stepping down"
    """Giving the lease up after an error: nothing is decided, the commits in flight drain."""
    STOPPING = "stopping"
    """Shutting down (a signal, or after a fatal error)."""
    STOPPED = "stopped"
    FAILED = "failed"
    """Something fatal happened: the process ends with exit code 1 (then ``STOPPING``)."""


class Event(enum.Enum):
    STARTED = "started"
    ELECTED = "elected"
    TOOK_OVER = "took over"
    DEPOSED = "deposed"
    STEP_DOWN = "step down"
    STEPPED_DOWN = "stepped down"
    STOP = "stop"
    STOPPED = "stopped"
    FATAL = "fatal"


R, E = Role, Event

TRANSITIONS: dict[tuple[Role, Event], Role] = {
    (R.STARTING, E.STARTED): R.STANDBY,
    (R.STANDBY, E.ELECTED): R.TAKING_OVER,
    (R.TAKING_OVER, E.TOOK_OVER): R.SERVING,
    (R.TAKING_OVER, E.DEPOSED): R.STANDBY,
    (R.TAKING_OVER, E.STEP_DOWN): R.STEPPING_DOWN,
    (R.SERVING, E.DEPOSED): R.STANDBY,
    (R.SERVING, E.STEP_DOWN): R.STEPPING_DOWN,
    (R.STEPPING_DOWN, E.STEPPED_DOWN): R.STANDBY,
    # The lease lapsed while the step-down drained: the step-down ends there.
    (R.STEPPING_DOWN, E.DEPOSED): R.STANDBY,
    **{(r, E.STOP): R.STOPPING for r in Role if r not in (R.STOPPING, R.STOPPED)},
    (R.STOPPING, E.STOPPED): R.STOPPED,
    **{
        (r, E.FATAL): R.FAILED
        for r in (R.STARTING, R.STANDBY, R.TAKING_OVER, R.SERVING, R.STEPPING_DOWN)
    },
}
"""Every change of role the controller may make: (role, event) -> the next role."""

IGNORED: frozenset[tuple[Role, Event]] = frozenset(
    {
        # A second stop (the CLI's signal, then run_controller's finally) changes nothing.
        (R.STOPPING, E.STOP),
        (R.STOPPED, E.STOP),
        # Once failed or stopping the first reason stands and nothing more is taken on: a
        # lease won meanwhile lapses unserved, a loop that ends with the process is no news.
        *((r, E.FATAL) for r in (R.FAILED, R.STOPPING, R.STOPPED)),
        *((r, E.ELECTED) for r in (R.FAILED, R.STOPPING, R.STOPPED)),
        *((r, E.DEPOSED) for r in (R.FAILED, R.STOPPING, R.STOPPED)),
        # A step-down is STANDBY before it resigns: a renewal failing in between is no news.
        (R.STANDBY, E.DEPOSED),
    }
)
"""Events that may arrive in a role and change nothing (not bugs)."""


class IllegalTransition(MardukError):
    """An event the table does not allow in the current role: a bug in the controller."""

    def __init__(self, role: Role, event: Event, why: str) -> None:
        super().__init__(f"illegal role transition: {event.value} while {role.value} ({why})")
        self.role, self.event = role, event


Listener = Callable[[Role, Role, Event, str], None]


class RoleMachine:
    """Holds the controller's one role and moves it by the table."""

    def __init__(self, on_change: Listener | None = None) -> None:
        self.role = Role.STARTING
        self._on_change = on_change

    def handle(self, event: Event, why: str = "") -> Role:
        """Apply ``event``; the role that follows (unchanged for an ignored event)."""
        before = self.role
        after = TRANSITIONS.get((before, event))
        if after is None:
            if (before, event) in IGNORED:
                log.debug("role %s: %s ignored (%s)", before.value, event.value, why)
                return before
            log.error("illegal role transition: %s while %s (%s)", event.value, before.value, why)
            raise IllegalTransition(before, event, why)
        self.role = after
        because = f"{event.value}: {why}" if why else event.value
        log.info("role: %s -> %s (%s)", before.value, after.value, because)
        if self._on_change is not None:
            self._on_change(before, after, event, why)
        return after

    def is_(self, *roles: Role) -> bool:
        return self.role in roles
