"""The controller's role machine: every allowed transition, ignored events, illegal ones."""

from __future__ import annotations

import logging

import pytest

from marduk.core.role import IGNORED, TRANSITIONS, Event, IllegalTransition, Role, RoleMachine


def machine_in(role: Role) -> RoleMachine:
    m = RoleMachine()
    m.role = role
    return m


@pytest.mark.parametrize(
    ("start", "event", "end"), [(s, e, t) for (s, e), t in TRANSITIONS.items()]
)
def test_every_allowed_transition_moves_the_role_and_says_so(
    start: Role, event: Event, end: Role
) -> None:
    seen: list[tuple[Role, Role, Event, str]] = []
    m = RoleMachine(lambda *change: seen.append(change))
    m.role = start
    assert m.handle(event, "because") is end
    assert m.role is end
    assert seen == [(start, end, event, "because")]


@pytest.mark.parametrize(
    ("start", "event"), sorted(IGNORED, key=lambda p: (p[0].value, p[1].value))
)
def test_an_ignored_event_changes_nothing(start: Role, event: Event) -> None:
    seen: list[object] = []
    m = RoleMachine(lambda *change: seen.append(change))
    m.role = start
    assert m.handle(event) is start and seen == []


ILLEGAL = [
    (r, e) for r in Role for e in Event if (r, e) not in TRANSITIONS and (r, e) not in IGNORED
]


@pytest.mark.parametrize(("start", "event"), ILLEGAL)
def test_every_other_event_is_a_bug_named_with_role_and_event(
    start: Role, event: Event, caplog: pytest.LogCaptureFixture
) -> None:
    m = machine_in(start)
    with caplog.at_level(logging.ERROR), pytest.raises(IllegalTransition) as e:
        m.handle(event, "why")
    assert m.role is start
    assert (e.value.role, e.value.event) == (start, event)
    assert start.value in caplog.text and event.value in caplog.text


def test_the_table_and_the_ignored_events_do_not_overlap_and_cover_known_bugs() -> None:
    assert not set(TRANSITIONS) & IGNORED
    # A few that must stay bugs: serving without taking over, electing a leader, a second start.
    for bug in [
        (Role.STANDBY, Event.TOOK_OVER),
        (Role.SERVING, Event.ELECTED),
        (Role.STANDBY, Event.STARTED),
        (Role.STOPPED, Event.STARTED),
    ]:
        assert bug in ILLEGAL


def test_a_leader_life_from_start_to_stop() -> None:
    m = RoleMachine()
    path = [
        (Event.STARTED, Role.STANDBY),
        (Event.ELECTED, Role.TAKING_OVER),
        (Event.TOOK_OVER, Role.SERVING),
        (Event.STEP_DOWN, Role.STEPPING_DOWN),
        (Event.STEPPED_DOWN, Role.STANDBY),
        (Event.ELECTED, Role.TAKING_OVER),
        (Event.TOOK_OVER, Role.SERVING),
        (Event.DEPOSED, Role.STANDBY),
        (Event.FATAL, Role.FAILED),
        (Event.STOP, Role.STOPPING),
        (Event.STOPPED, Role.STOPPED),
    ]
    for event, role in path:
        assert m.handle(event) is role


def test_each_change_is_logged_once_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    m = RoleMachine()
    with caplog.at_level(logging.INFO, logger="marduk.controller"):
        m.handle(Event.STARTED, "campaigning")
        m.handle(Event.STOP)
        m.handle(Event.STOP)  # ignored: not logged at INFO
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert lines == [
        "role: starting -> standby (started: campaigning)",
        "role: standby -> stopping (stop)",
    ]
