"""The micro STATS ``data`` of an endpoint: what its requests came to (pure, no server)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from marduk.controller.endpoint_stats import ANSWERED, DROPPED, RequestEnd, ServiceTallies


def test_a_tally_counts_answers_errors_by_code_drops_and_time() -> None:
    tallies = ServiceTallies()
    tally = tallies.endpoint("register")
    started = [tally.started() for _ in range(4)]
    assert tally.data()["in_flight"] == 4
    tally.done(started[0], ANSWERED)
    tally.done(started[1], RequestEnd("invalid", "invalid Registration: bad job"))
    tally.done(started[2], DROPPED)
    tally.done(started[3], RequestEnd("reply_subject", "not an inbox: $KV.x", answered=False))
    stats: Any = SimpleNamespace(name="register")
    data = tallies.stats_handler(stats)
    assert data["num_completed"] == 4 and data["in_flight"] == 0
    assert data["num_errors"] == 2
    assert data["errors"] == {"invalid": 1, "reply_subject": 1}
    assert data["num_unanswered"] == 2
    assert data["last_error"] == "reply_subject: not an inbox: $KV.x"
    assert data["processing_time"] >= 0
    assert data["average_processing_time"] == data["processing_time"] // 4


def test_an_endpoint_that_saw_nothing_says_so() -> None:
    data = ServiceTallies().stats_handler(SimpleNamespace(name="ack"))  # type: ignore[arg-type]
    assert data == {
        "num_completed": 0,
        "num_errors": 0,
        "errors": {},
        "last_error": "",
        "num_unanswered": 0,
        "in_flight": 0,
        "processing_time": 0,
        "average_processing_time": 0,
    }


def test_last_error_is_cut_short() -> None:
    tally = ServiceTallies().endpoint("query")
    tally.done(tally.started(), RequestEnd("internal", "x" * 1000))
    assert len(tally.data()["last_error"]) == 200
