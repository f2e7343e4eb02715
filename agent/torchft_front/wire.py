"""The one field of torchft's messages the front reads, pure: ``replica_id`` (field 1, a
string) of ``LighthouseHeartbeatRequest`` (torchft's proto/torchft.proto, 0.2.0 and later).
Decoded by hand from the protobuf wire format (a tag, a length, the bytes), so the front needs
neither protobuf nor torchft's generated code; unknown fields are skipped, as protobuf does,
and the request is forwarded as it came. ``Quorum`` is never decoded: its bytes pass through.
"""

from __future__ import annotations

from typing import Final

HEARTBEAT_SERVICE: Final = "torchft.LighthouseService"
QUORUM_METHOD: Final = f"/{HEARTBEAT_SERVICE}/Quorum"
HEARTBEAT_METHOD: Final = f"/{HEARTBEAT_SERVICE}/Heartbeat"
MAX_REQUEST_BYTES: Final = 4096  # a heartbeat is a replica id (MAX_ID_CHARS) and a tag


class MalformedMessage(ValueError):
    """Not a heartbeat request torchft would send."""


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise MalformedMessage("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7


def heartbeat_replica_id(data: bytes) -> str:
    """The ``replica_id`` of a serialized ``LighthouseHeartbeatRequest`` (the last one, as
    protobuf merges repeated scalars); MalformedMessage for bytes that are not one."""
    if len(data) > MAX_REQUEST_BYTES:
        raise MalformedMessage(f"{len(data)} bytes, over {MAX_REQUEST_BYTES}")
    found: str | None = None
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, kind = key >> 3, key & 7
        if number == 0:
            raise MalformedMessage("field number 0")
        if kind == 0:
            _, at = _varint(data, at)
        elif kind == 1:
            at += 8
        elif kind == 5:
            at += 4
        elif kind == 2:
            size, at = _varint(data, at)
            end = at + size
            if end > len(data):
                raise MalformedMessage("truncated field")
            if number == 1:
                try:
                    found = data[at:end].decode("utf-8")
                except UnicodeDecodeError:
                    raise MalformedMessage("replica_id is not UTF-8") from None
            at = end
        else:
            raise MalformedMessage(f"wire type {kind}")
        if at > len(data):
            raise MalformedMessage("truncated field")
    if not found:
        raise MalformedMessage("no replica_id")
    return found


def heartbeat_request(replica_id: str) -> bytes:
    """A serialized ``LighthouseHeartbeatRequest`` for ``replica_id``."""
    raw = replica_id.encode("utf-8")
    size, prefix = len(raw), bytearray(b"\x0a")
    while True:
        prefix.append((size & 0x7F) | (0x80 if size > 0x7F else 0))
        size >>= 7
        if not size:
            break
    return bytes(prefix) + raw
