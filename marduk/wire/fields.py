"""The wire's vocabulary: its limits, the field types every message is built from, and what
their patterns mean in words (for error messages). ``marduk.wire.protocol`` re-exports each name;
import them from there.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

import msgspec

from marduk.wire.subjects import RESERVED_JOBS, TOKEN_PATTERN

PROTOCOL_VERSION: Final = 1
# Well under NATS's default max_payload (1 MiB). A registration of 4,096 devices fits.
MAX_MESSAGE_BYTES: Final = 256 * 1024
MAX_DEVICES_PER_WORKER: Final = 4096

# Above this, a JSON peer that reads numbers as doubles (JavaScript, jq, many JSON libraries)
# silently rounds: two different epochs would compare equal.
MAX_EPOCH: Final = 2**53

# --- field types -------------------------------------------------------------------------------

# Patterns are anchored with \A and \Z, not ^ and $: msgspec applies them with ``re.search``, and
# ``$`` also matches before a trailing newline, so "a\n" would pass as a token.
_TOKEN_PATTERN: Final = rf"\A{TOKEN_PATTERN}\Z"
# A token that is not a reserved job name (those would collide with the controller's subjects).
_RESERVED = "|".join(re.escape(job) for job in sorted(RESERVED_JOBS))
_JOB_PATTERN: Final = rf"\A(?!(?:{_RESERVED})\Z){TOKEN_PATTERN}\Z"
_DEVICE_PATTERN: Final = r"\A[\x21-\x7e]+\Z"

Token = Annotated[str, msgspec.Meta(pattern=_TOKEN_PATTERN, description="subject token")]
JobName = Annotated[str, msgspec.Meta(pattern=_JOB_PATTERN, description="job name")]
DeviceId = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=_DEVICE_PATTERN)]
ShortText = Annotated[str, msgspec.Meta(max_length=256)]
MAX_TEXT: Final = 4096
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]


def clip_text(text: str) -> str:
    """``text`` within ``MAX_TEXT``, saying how much was cut: a peer refuses a whole message
    whose ``Text`` field is longer, and a text that lists workers or devices grows with the job."""
    if len(text) <= MAX_TEXT:
        return text
    return text[: MAX_TEXT - 64] + f"... ({len(text) - MAX_TEXT + 64} more characters)"


NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Epoch = Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH)]
# How many failures were merged into an epoch's command after it was issued (0: as issued);
# bounded like an epoch, for the same JSON peers.
Revision = Annotated[int, msgspec.Meta(ge=0, le=MAX_EPOCH)]
# Any integer decodes; decode() answers every value but PROTOCOL_VERSION with reason "version".
Version = int

Scope = Literal["replica", "job"]
# preempting: the device's host is about to go away (maintenance, preemption): checkpoint now.
HealthState = Literal["failed", "degraded", "preempting", "healthy"]
# checkpoint: save now (the host is about to go away); not a restart: keep training.
# peer_failed: a notice that other replicas of the job restart or fail (their ``peers``); not a
# restart either, and outside the recipient's epochs. Sent only to replicas that asked for it
# (``Registration.peer_notices``): older agents never see the kind.
CommandKind = Literal["restart", "fail", "stop", "checkpoint", "peer_failed"]
FailureKind = Literal["restart", "fail"]
# A notice lists at most this many failed replicas (a larger storm gives several notices).
MAX_PEERS_PER_NOTICE: Final = 256
Role = Literal["library", "supervisor"]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
# A membership lists at most this many workers (one per node): it travels in every command of
# its job and must fit the message cap with room to spare (about 120 bytes each).
MAX_MEMBERS: Final = 1024
QueryWhat = Literal["map", "devices", "stats", "ping"]

# msgspec names a failed pattern by its regex; say what it means instead.
PATTERN_TEXT: Final = {
    _TOKEN_PATTERN: "1-128 of A-Z a-z 0-9 _ -, starting with a letter or digit",
    _JOB_PATTERN: "1-128 of A-Z a-z 0-9 _ -, starting with a letter or digit, and not "
    + " or ".join(repr(job) for job in sorted(RESERVED_JOBS)),
    _DEVICE_PATTERN: "printable ASCII without spaces",
}
