"""The strict edge: whatever bytes arrive, decode() returns a message or raises ProtocolError.

Pure tests (no server). Each rule of the wire contract's edge has a table here: ids match their
pattern whole, and reserved job names are refused.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from marduk import protocol as wire
from marduk.errors import ProtocolError
from marduk.subjects import RESERVED_JOBS, Subjects, check_job, check_replica, valid_token

# A valid message of each type, as JSON-ready dicts; the tests below spoil one field at a time.
BASE: dict[type[Any], dict[str, Any]] = {
    wire.Registration: {"type": "register", "job": "j", "replica": "r", "devices": ["GPU-0"]},
    wire.Deregistration: {"type": "deregister", "job": "j", "replica": "r"},
    wire.Ack: {"type": "ack", "job": "j", "replica": "r", "epoch": 1},
    wire.Report: {"type": "report", "job": "j", "replica": "r", "status": "running"},
    wire.DeviceHealth: {"type": "health", "device": "GPU-0", "state": "failed"},
    wire.Query: {"type": "query", "what": "map", "job": "j"},
    wire.Forget: {"type": "forget", "job": "j", "replica": "r"},
    wire.Command: {"type": "command", "command_id": "c", "job": "j", "kind": "restart", "epoch": 1},
    wire.RegisterReply: {
        "type": "register_reply",
        "job": "j",
        "replica": "r",
        "worker": 0,
        "outcome": "new",
        "epoch": 1,
    },
    wire.AckReply: {"type": "ack_reply", "epoch": 1},
    wire.Action: {"job": "j", "replica": "r", "kind": "restart", "epoch": 1},
}
# What the controller decodes from the outside world.
REQUEST_TYPES = [
    wire.Registration,
    wire.Deregistration,
    wire.Ack,
    wire.Report,
    wire.DeviceHealth,
    wire.Query,
    wire.Forget,
]
JOB_TYPES = [t for t, base in BASE.items() if "job" in base and t is not wire.Action]


def message(type_: type[Any], **fields: Any) -> bytes:
    return msgspec.json.encode({**BASE[type_], **fields})


def refused(data: bytes, type_: Any, **kw: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        wire.decode(data, type_, **kw)
    return info.value


@pytest.mark.parametrize("type_", list(BASE), ids=lambda t: t.__name__)
def test_every_base_message_decodes(type_: type[Any]) -> None:
    assert isinstance(wire.decode(message(type_), type_), type_)


# --- 1. ids match their pattern whole ---------------------------------------------------------

BAD_IDS = ["a\n", "a\r", "a\n\n", "\na", "a b", "a.b", "a*", "-a", "", "a" * 129, "é"]


@pytest.mark.parametrize("value", BAD_IDS, ids=repr)
@pytest.mark.parametrize(
    ("type_", "field"),
    [
        (wire.Registration, "job"),
        (wire.Registration, "replica"),
        (wire.Deregistration, "replica"),
        (wire.Ack, "replica"),
        (wire.Report, "replica"),
        (wire.Command, "replica"),
        (wire.Forget, "replica"),
        (wire.Query, "job"),
    ],
    ids=lambda p: getattr(p, "__name__", p),
)
def test_token_fields_refuse_anything_but_a_whole_token(
    type_: type[Any], field: str, value: str
) -> None:
    e = refused(message(type_, **{field: value}), type_)
    assert e.reason == "invalid"
    assert f"`$.{field}`" in str(e)
    assert "regex" not in str(e)  # the pattern is said in words


@pytest.mark.parametrize("value", ["d\n", "d\r\n", "d d", "\td", "", "d" * 257, "ü"], ids=repr)
@pytest.mark.parametrize(
    ("type_", "field"),
    [(wire.Registration, "devices"), (wire.Command, "devices"), (wire.DeviceHealth, "device")],
    ids=lambda p: getattr(p, "__name__", p),
)
def test_device_ids_refuse_a_trailing_newline(type_: type[Any], field: str, value: str) -> None:
    e = refused(message(type_, **{field: [value] if field == "devices" else value}), type_)
    assert e.reason == "invalid"
    assert f"`$.{field}" in str(e)


@pytest.mark.parametrize("value", ["a", "A-1_b", "0", "a" * 128, "ctlx", "Ctl", "healthy"])
def test_good_tokens_pass(value: str) -> None:
    assert wire.decode(message(wire.Registration, job=value, replica=value), wire.Registration)
    assert valid_token(value)
    assert check_job(value) == value


@pytest.mark.parametrize("value", BAD_IDS, ids=repr)
def test_subject_helpers_refuse_the_same_ids(value: str) -> None:
    assert not valid_token(value)
    with pytest.raises(ValueError):
        check_job(value)
    with pytest.raises(ValueError):
        check_replica(value)


@pytest.mark.parametrize("prefix", ["marduk\n", "a.b\n", "a..b", ".a", "a b", ""], ids=repr)
def test_subject_prefix_is_matched_whole(prefix: str) -> None:
    with pytest.raises(ValueError):
        Subjects(prefix)
    assert Subjects("team.marduk").health == "team.marduk.health"


# --- 2. reserved job names --------------------------------------------------------------------


@pytest.mark.parametrize("job", sorted(RESERVED_JOBS))
@pytest.mark.parametrize("type_", JOB_TYPES, ids=lambda t: t.__name__)
def test_reserved_job_names_are_refused_in_every_message_with_a_job(
    type_: type[Any], job: str
) -> None:
    e = refused(message(type_, job=job), type_)
    assert e.reason == "invalid"
    assert "`$.job`" in str(e)
    assert repr(job) in str(e)  # the message says which names are reserved


def test_the_reserved_name_table_has_every_message_with_a_job() -> None:
    wanted = ["Registration", "Deregistration", "Ack", "Report", "Command", "Query", "Forget"]
    assert set(wanted) <= {t.__name__ for t in JOB_TYPES}
