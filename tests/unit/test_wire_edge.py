"""The strict edge: whatever bytes arrive, decode() returns a message or raises ProtocolError.

Pure tests (no server). Each rule of the wire contract's edge has a table here: ids match their
pattern whole, reserved job names are refused, bad UTF-8 and deep nesting are ``malformed``,
every ``v`` but 1 is ``version``, and epochs stay within 2**53.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marduk.errors import ProtocolError
from marduk.wire import protocol as wire
from marduk.wire.subjects import RESERVED_JOBS, Subjects, check_job, check_replica, valid_token

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
REQUEST_TYPES: list[type[Any]] = [
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


# --- 3. bad UTF-8 and deep nesting are malformed ------------------------------------------------

BAD_UTF8 = [
    b"\xff",  # never valid
    b"\xc3\x28",  # a lead byte without its continuation
    b"\xc0\xaf",  # overlong '/'
    b"\xed\xa0\x80",  # a UTF-16 surrogate encoded as UTF-8
    b"\xf4\x90\x80\x80",  # above U+10FFFF
    b"r\x80",  # a stray continuation byte
]


@pytest.mark.parametrize("raw", BAD_UTF8, ids=repr)
@pytest.mark.parametrize(
    "where",
    [
        (b'{"type":"register","job":"j","replica":"', b'","devices":["d"]}'),  # a kept field
        (b'{"type":"register","job":"j","replica":"r","devices":["d"],"reason":"', b'"}'),
        (b'{"type":"register","job":"j","replica":"r","devices":["d"],"', b'":1}'),  # a key
        (b'{"type":"register","job":"j","replica":"r","host":"', b'","devices":["d"]}'),
        (b'{"type":"health","device":"d","state":"failed","reason":"', b'"}'),
    ],
    ids=["replica", "unknown-field", "unknown-key", "host", "health-reason"],
)
def test_invalid_utf8_anywhere_is_malformed(where: tuple[bytes, bytes], raw: bytes) -> None:
    data = where[0] + raw + where[1]
    type_ = wire.DeviceHealth if b'"health"' in data else wire.Registration
    e = refused(data, type_)
    assert e.reason == "malformed"
    assert "UTF-8" in str(e)


def test_non_ascii_utf8_is_fine() -> None:
    msg = wire.decode(message(wire.DeviceHealth, reason="GPU überhitzt 🔥"), wire.DeviceHealth)
    assert msg.reason == "GPU überhitzt 🔥"


def _deep_list(n: int) -> bytes:
    return b"[" * n + b"]" * n


def _deep_dict(n: int) -> bytes:
    return b'{"a":' * n + b"1" + b"}" * n


def _in_field(value: bytes, field: bytes = b"x") -> bytes:
    head = b'{"type":"register","job":"j","replica":"r","devices":["d"],"'
    return head + field + b'":' + value + b"}"


BIG = 10_000_000  # a max_bytes that lets 100,000-deep objects through to the parser


@pytest.mark.parametrize(
    ("data", "max_bytes", "reason"),
    [
        # Not an object, but too deep to read: the depth comes before the schema.
        (_deep_list(1_000), None, "malformed"),
        (_deep_list(100_000), None, "malformed"),
        (b"[" * 100_000, None, "malformed"),
        (_deep_dict(1_000), None, "malformed"),
        (_deep_dict(100_000), None, "oversized"),  # 600 KB
        (_deep_dict(100_000), BIG, "malformed"),
        (b'{"a":' * 100_000, BIG, "malformed"),  # deep and never closed
        (_in_field(_deep_list(1_000)), None, "malformed"),  # skipped field
        (_in_field(_deep_list(100_000)), None, "malformed"),
        (_in_field(_deep_dict(1_000)), None, "malformed"),
        (_in_field(_deep_dict(100_000)), BIG, "malformed"),
        # A kept field of the wrong type (devices: strings) is too deep to read all the same.
        (_in_field(_deep_list(1_000), b"devices"), None, "malformed"),
        (_in_field(_deep_list(100_000), b"devices"), None, "malformed"),
        # Just under the depth: JSON the decoder reads, of the wrong shape.
        (_deep_list(500), None, "invalid"),
        (_in_field(_deep_list(500), b"devices"), None, "invalid"),
    ],
    ids=[
        "list-1k",
        "list-100k",
        "list-100k-open",
        "dict-1k",
        "dict-100k",
        "dict-100k-big",
        "dict-100k-open",
        "field-list-1k",
        "field-list-100k",
        "field-dict-1k",
        "field-dict-100k",
        "devices-list-1k",
        "devices-list-100k",
        "list-500",
        "devices-list-500",
    ],
)
def test_deep_nesting_is_refused(data: bytes, max_bytes: int | None, reason: str) -> None:
    kw = {} if max_bytes is None else {"max_bytes": max_bytes}
    e = refused(data, wire.Registration, **kw)
    assert e.reason == reason, str(e)


@pytest.mark.parametrize("type_", REQUEST_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deep_nesting_is_malformed_for_every_request(type_: type[Any], depth: int) -> None:
    body = msgspec.json.encode(BASE[type_])[:-1] + b',"x":' + _deep_list(depth) + b"}"
    assert refused(body, type_).reason == "malformed"
    assert refused(_deep_dict(depth), type_, max_bytes=BIG).reason == "malformed"


# Not JSON, whatever the first value: the typed decoder refuses a payload that is not an object
# at its first byte, and a field of the wrong shape before the bytes after it. Each was `invalid`.
NOT_JSON = [
    b'[},]\\:[, {}"{"]null...',  # the fuzzing client's: `invalid DeviceHealth: Expected object`
    b"null x",
    b"null}",
    b'"abc" garbage',
    b'"abc"]',
    b"1 2",
    b"[1, 2,]",
    b'{"v": 2, "device": 7, "x": tru}',
    b'{"device": 7, "state": 7, "y": [1,]}',
    # Nesting past the decoder's limit before the bad bytes.
    b"[" * 2_000 + b"x",
    b'{"device":' + b"[" * 2_000 + b"x",
]
# JSON of the wrong shape, for contrast: the schema's answer.
WRONG_SHAPE = [b"null", b'"abc"', b"1", b"[1, 2]", b"[]", b'{"job": [[1]], "device": [[1]]}']


@pytest.mark.parametrize("data", NOT_JSON, ids=lambda d: repr(d[:24]))
@pytest.mark.parametrize("type_", REQUEST_TYPES, ids=lambda t: t.__name__)
def test_not_json_is_malformed_whatever_its_first_value(type_: type[Any], data: bytes) -> None:
    e = refused(data, type_)
    assert e.reason == "malformed", str(e)
    assert str(e).startswith("malformed JSON: ")


@pytest.mark.parametrize("data", WRONG_SHAPE, ids=repr)
@pytest.mark.parametrize("type_", REQUEST_TYPES, ids=lambda t: t.__name__)
def test_json_of_the_wrong_shape_is_invalid(type_: type[Any], data: bytes) -> None:
    e = refused(data, type_)
    assert e.reason == "invalid", str(e)
    assert str(e).startswith(f"invalid {type_.__name__}: ")


def _is_json(data: bytes) -> bool:
    try:
        str(data, "utf-8")
        msgspec.json.decode(data, type=msgspec.Raw)
    except (UnicodeDecodeError, msgspec.DecodeError):
        return False
    return True


_small_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=4),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.sampled_from(["v", "device", "job", "x"]), children, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    _small_json,
    st.integers(min_value=0),
    st.sampled_from([b"", b"x", b",", b"]", b"}", b'"', b"[", b"tru", b":", b"\\", b"\xff"]),
)
def test_malformed_is_exactly_not_json(value: Any, at: int, junk: bytes) -> None:
    # Junk spliced anywhere into any JSON value: malformed if and only if the result is not
    # JSON, for every type, whatever the first value and wherever the first wrong field.
    data = json.dumps(value).encode()
    at %= len(data) + 1
    data = data[:at] + junk + data[at:]
    for type_ in REQUEST_TYPES:
        try:
            wire.decode(data, type_)
        except ProtocolError as e:
            assert (e.reason == "malformed") == (not _is_json(data)), (data, str(e))
        else:
            assert _is_json(data)


# --- 4. every v but 1 is "version" ------------------------------------------------------------


@pytest.mark.parametrize("v", [0, -1, 2, 3, 2**63, 2**70, -(2**70)])
@pytest.mark.parametrize("type_", REQUEST_TYPES, ids=lambda t: t.__name__)
def test_every_other_integer_version_is_version(type_: type[Any], v: int) -> None:
    e = refused(message(type_, v=v), type_)
    assert e.reason == "version"
    assert "version" in str(e) and "speaks 1" in str(e)


@pytest.mark.parametrize("v", [0, -1, 2, 2**70])
def test_version_wins_over_a_body_we_cannot_read(v: int) -> None:
    # A peer of another version may send fields we do not know the shape of.
    data = msgspec.json.encode({"type": "register", "v": v, "devices": {"new": "shape"}})
    assert refused(data, wire.Registration).reason == "version"


def _v2(*members: bytes) -> bytes:
    return b'{"type":"register","v":2,' + b",".join(members) + b"}"


@pytest.mark.parametrize(
    "data",
    [
        # The first bad field holds JSON too deep to parse after it (this
        # was `invalid`), or a field the decoder skips is too deep (it was `malformed`).
        _v2(b'"devices":' + _deep_list(1_000)),
        _v2(b'"devices":' + _deep_list(100_000)),
        _v2(b'"job":"j","replica":"r","devices":[],"x":' + _deep_list(5_000)),
        _v2(b'"x":' + _deep_dict(5_000), b'"y":"}\\"{"'),
        # Only the top-level v counts, wherever it stands.
        b'{"x":{"v":1},"devices":' + _deep_list(2_000) + b',"v":3}',
    ],
    ids=["bad-deep-field", "bad-deep-field-100k", "deep-skipped", "deep-dict-strings", "last"],
)
def test_version_is_answered_before_any_other_fault_of_a_json_object(data: bytes) -> None:
    e = refused(data, wire.Registration, max_bytes=BIG)
    assert e.reason == "version", str(e)


@pytest.mark.parametrize("type_", [wire.Registration, wire.DeviceHealth])
@pytest.mark.parametrize("v", [1, 2])
def test_broken_json_is_malformed_whatever_field_comes_first(type_: type[Any], v: int) -> None:
    # Validation stops at the first bad field; the bytes after it went unread, and bytes that
    # are not JSON were answered `invalid`, unlike the same bytes with the fields in another order.
    data = b'{"v":%d,"devices":"x","device":7,"state":7,"y":tru}' % v
    assert refused(data, type_).reason == "malformed"


def test_a_deep_payload_without_a_version_is_still_malformed() -> None:
    data = b'{"type":"register","x":' + _deep_list(2_000) + b',"y":{"v":2}}'
    assert refused(data, wire.Registration).reason == "malformed"


@pytest.mark.parametrize("v", ["1", 1.0, 1.5, None, True, [1], {"v": 1}])
def test_non_integer_version_is_invalid(v: Any) -> None:
    e = refused(message(wire.Registration, v=v), wire.Registration)
    assert e.reason == "invalid"
    assert "`$.v`" in str(e)


def test_version_1_and_no_version_decode() -> None:
    assert wire.decode(message(wire.Registration, v=1), wire.Registration).v == 1
    assert wire.decode(message(wire.Registration), wire.Registration).v == 1


# --- 5. epochs stay within 2**53 --------------------------------------------------------------

EPOCH_FIELDS = [
    (wire.Registration, "epoch"),
    (wire.Registration, "seen_epoch"),
    (wire.Command, "epoch"),
    (wire.RegisterReply, "epoch"),
    (wire.Ack, "epoch"),
    (wire.AckReply, "epoch"),
    (wire.Report, "epoch"),
    (wire.Action, "epoch"),
]


@pytest.mark.parametrize(("type_", "field"), EPOCH_FIELDS, ids=lambda p: getattr(p, "__name__", p))
def test_epochs_stay_within_2_to_the_53(type_: type[Any], field: str) -> None:
    top = wire.decode(message(type_, **{field: 2**53}), type_)
    assert getattr(top, field) == 2**53 == wire.MAX_EPOCH
    assert getattr(wire.decode(message(type_, **{field: 0}), type_), field) == 0
    for bad in (2**53 + 1, 2**64, -1):
        e = refused(message(type_, **{field: bad}), type_)
        assert e.reason == "invalid"
        assert f"`$.{field}`" in str(e)


def test_a_nested_epoch_is_checked_too() -> None:
    data = msgspec.json.encode({"type": "report_reply", "actions": [{**BASE[wire.Action]}]})
    assert wire.decode(data, wire.ReportReply).actions[0].epoch == 1
    bad = {"type": "report_reply", "actions": [{**BASE[wire.Action], "epoch": 2**53 + 1}]}
    assert "`$.actions[0].epoch`" in str(refused(msgspec.json.encode(bad), wire.ReportReply))


# --- the property: nothing but ProtocolError, whatever the bytes --------------------------------

_FIELD_NAMES = sorted({name for t in REQUEST_TYPES for name in t.__struct_fields__} | {"type"})
_TAGS = sorted({t.__struct_config__.tag for t in REQUEST_TYPES if t.__struct_config__.tag})

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text()
    | st.sampled_from([*_TAGS, "a\n", "ctl", "GPU-0"]),
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=30,
)


def _returns_or_refuses(data: bytes) -> None:
    for type_ in REQUEST_TYPES:
        try:
            msg = wire.decode(data, type_)
        except ProtocolError as e:
            assert e.reason in {"malformed", "empty", "invalid", "version", "oversized"}
        else:
            assert isinstance(msg, type_)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    _returns_or_refuses(data)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_arbitrary_json_decodes_or_raises_protocol_error(value: Any) -> None:
    # json.dumps, not msgspec: NaN and Infinity come out as the non-JSON tokens they are.
    _returns_or_refuses(json.dumps(value).encode())


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(REQUEST_TYPES),
    st.dictionaries(st.sampled_from(_FIELD_NAMES), json_values, max_size=6),
)
def test_spoiled_valid_messages_decode_or_raise_protocol_error(
    type_: type[Any], spoil: dict[str, Any]
) -> None:
    _returns_or_refuses(json.dumps({**BASE[type_], **spoil}).encode())


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(REQUEST_TYPES),
    st.integers(min_value=0),
    st.binary(min_size=1, max_size=16) | st.sampled_from(BAD_UTF8),
)
def test_valid_messages_with_bytes_spliced_in_decode_or_raise_protocol_error(
    type_: type[Any], at: int, junk: bytes
) -> None:
    # Spliced into a valid message, junk lands inside strings, keys and numbers the decoder keeps.
    data = msgspec.json.encode(BASE[type_])
    at %= len(data) + 1
    _returns_or_refuses(data[:at] + junk + data[at:])


@settings(max_examples=50, deadline=None)
@given(
    st.sampled_from(REQUEST_TYPES),
    st.integers(min_value=1, max_value=20_000),
    st.sampled_from([(b"[", b"]"), (b'{"a":', b"}"), (b'[{"a":', b"}]")]),
)
def test_any_nesting_depth_decodes_or_raises_protocol_error(
    type_: type[Any], depth: int, brackets: tuple[bytes, bytes]
) -> None:
    value = brackets[0] * depth + b"0" + brackets[1] * depth
    _returns_or_refuses(msgspec.json.encode(BASE[type_])[:-1] + b',"x":' + value + b"}")
