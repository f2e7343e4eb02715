"""Encoding and strict decoding of wire messages: the size cap, the version check, UTF-8, and
errors that say what is wrong in words. ``marduk.wire.protocol`` re-exports ``encode``,
``decode`` and ``to_builtins``; import them from there.
"""

from __future__ import annotations

import re
from typing import Any, Final, TypeVar

import msgspec

from marduk.errors import ProtocolError
from marduk.wire.fields import MAX_MESSAGE_BYTES, PATTERN_TEXT, PROTOCOL_VERSION

_encoder = msgspec.json.Encoder()
T = TypeVar("T")
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, type_: type[T], *, max_bytes: int = MAX_MESSAGE_BYTES) -> T:
    """Decode ``data`` as ``type_`` or raise ProtocolError with a reason and a clear message.

    Whatever the bytes, nothing but ProtocolError comes out: a peer cannot make the controller
    answer ``internal``.
    """
    if len(data) > max_bytes:
        raise ProtocolError("oversized", f"message of {len(data)} bytes exceeds {max_bytes}")
    if not data:
        raise ProtocolError("empty", "empty message")
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.json.Decoder(type_)
    try:
        # JSON is UTF-8. msgspec checks only the strings it keeps, and raises UnicodeDecodeError
        # (not one of its own errors) for those; it skips unknown fields unchecked. Check it all.
        str(data, "utf-8")
        msg = decoder.decode(data)
    except msgspec.ValidationError as e:
        # Validation stops at the first value of the wrong shape (the very first byte, when the
        # payload is not an object), before the bytes after it are read: read them all first.
        _check_json(data)
        raise ProtocolError("invalid", f"invalid {_name(type_)}: {_readable(e)}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError("malformed", f"malformed JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise ProtocolError("malformed", f"malformed JSON: not UTF-8 at byte {e.start}") from None
    except RecursionError:
        _check_json(data)
        raise _too_deep() from None
    except Exception as e:  # the sender's bytes, never our bug: see the docstring
        raise ProtocolError("malformed", f"malformed JSON: {type(e).__name__}: {e}") from None
    _check_version(getattr(msg, "v", PROTOCOL_VERSION))
    return msg  # type: ignore[no-any-return]


class _Envelope(msgspec.Struct):
    v: object = PROTOCOL_VERSION


def _check_json(data: bytes) -> None:
    """What comes before the schema, for a payload the typed decoder refused: not JSON
    (``malformed``), then a top-level ``v`` other than 1 (``version``), then nesting too deep
    for the decoder (``malformed``). Returns if the payload is JSON it can read, of version 1.

    Only refused payloads pay for this second pass; a valid message is parsed once.
    """
    try:
        try:
            version = msgspec.json.decode(data, type=_Envelope).v
        except msgspec.ValidationError:  # not an object: no version, but is it JSON at all?
            msgspec.json.decode(data, type=msgspec.Raw)
            return
    except msgspec.DecodeError as e:
        raise ProtocolError("malformed", f"malformed JSON: {e}") from None
    except RecursionError:
        # Past the decoder's depth its syntax is not checked: nested too deeply is malformed
        # anyway, unless a newer peer's top-level v says why we cannot read it.
        _check_version(_scan_version(data))
        raise _too_deep() from None
    _check_version(version)


def _too_deep() -> ProtocolError:
    # msgspec guards its recursion with the interpreter's limit (about 1,000 levels).
    return ProtocolError("malformed", "malformed JSON: nested too deeply")


# A JSON string (group 1: the string "v"); a top-level-looking "v" member with an integer value (up
# to 4,000 digits: Python's int() stops at 4,300).
_STRING: Final = re.compile(rb'"(v)"|"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: fast on long ones
_V_MEMBER: Final = re.compile(rb'"v"\s*:\s*(-?\d{1,4000})\s*[,}]')


def _scan_version(data: bytes) -> object:
    """The top-level ``v`` of a payload nested too deeply for the decoder, or PROTOCOL_VERSION
    if none is found. No recursion, and no Python loop per byte: junk must stay cheap."""
    if not data.lstrip().startswith(b"{"):
        return PROTOCOL_VERSION
    flat = _STRING.sub(rb'"\1"', data)  # every string emptied but "v": no bracket inside
    depth, done, version = 0, 0, PROTOCOL_VERSION
    for member in _V_MEMBER.finditer(flat):
        part = flat[done : member.start()]
        depth += part.count(b"{") + part.count(b"[") - part.count(b"}") - part.count(b"]")
        done = member.start()
        if depth == 1:
            version = int(member.group(1))  # the last one wins, as in the decoder
    return version


def _check_version(version: object) -> None:
    # bool is an int in Python, and True == 1: only a real integer is a version.
    if type(version) is not int or version == PROTOCOL_VERSION:
        return
    shown = str(version) if abs(version) < 10**20 else f"{str(version)[:20]}..."
    why = "upgrade this side" if version > PROTOCOL_VERSION else "versions start at 1"
    raise ProtocolError(
        "version",
        f"unsupported protocol version {shown}: this side speaks {PROTOCOL_VERSION} ({why})",
    )


def _readable(error: msgspec.ValidationError) -> str:
    text = str(error)
    for pattern, meaning in PATTERN_TEXT.items():
        text = text.replace(f"matching regex {pattern!r}", f"({meaning})")
    return text


def _name(type_: Any) -> str:
    return getattr(type_, "__name__", None) or str(type_)


def to_builtins(msg: msgspec.Struct) -> Any:
    return msgspec.to_builtins(msg)
