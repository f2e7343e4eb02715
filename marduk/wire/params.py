"""The wire contract of live parameters (decisions.md #20): a job's desired values and versions.

A job's parameters are desired state, like its epochs: the controller stores them (versioned)
before any trainer is told, publishes the whole document on ``<prefix>.<job>.cmd.params``
(one publish, every replica of the job subscribed), and hands it to every registration, so a
restarted trainer starts with the current values. Each worker acknowledges the version it
applied (or the keys it refused, with why) on ``<prefix>.<job>.params.applied``.

The messages have the shape of every other message (``type`` and ``v``: ``ParamsMessage`` is
``protocol.Message``'s twin, kept here so ``protocol`` can embed ``JobParams`` in its
``RegisterReply`` without an import cycle). ``docs/protocol.md`` documents each with an example.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Final, Literal

import msgspec

from marduk.errors import ProtocolError
from marduk.wire.fields import (
    PROTOCOL_VERSION,
    JobName,
    NonNegInt,
    ShortText,
    Text,
    Token,
    Version,
)

MAX_PARAMS: Final = 64
"""Keys per job at most (and per replica override)."""
MAX_OVERRIDES: Final = 64
"""Replicas with values of their own (``--replica``) at most per job."""
MAX_LIST: Final = 16
"""Items of a list value at most."""
MAX_STRING: Final = 256
"""Characters of a string value (or a list item) at most."""
MAX_REJECTED: Final = MAX_PARAMS
KEY_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"
KEY_WORDS: Final = "1-64 letters, digits, '_', '.' or '-', starting with a letter or '_'"

MAX_DOC_BYTES: Final = 16 * 1024
"""A job's whole document (values and overrides), encoded, at most: it travels in every
registration reply and every fan-out, well under the server's max payload."""

_KEY_RE = re.compile(KEY_PATTERN)

ParamKey = Annotated[str, msgspec.Meta(pattern=KEY_PATTERN, description="parameter name")]
Scalar = bool | int | float | Annotated[str, msgspec.Meta(max_length=MAX_STRING)]
ParamValue = Scalar | Annotated[list[Scalar], msgspec.Meta(max_length=MAX_LIST)]
Values = Annotated[dict[ParamKey, ParamValue], msgspec.Meta(max_length=MAX_PARAMS)]
# In a set: null removes the key (the trainer falls back to its own default).
Changes = Annotated[dict[ParamKey, ParamValue | None], msgspec.Meta(max_length=MAX_PARAMS)]


class ParamValueError(ProtocolError):
    """A parameter name or value the contract does not take (``reason``: ``invalid`` or
    ``too_large``); the message is one line naming the key."""


def check_key(key: str) -> str:
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise ParamValueError("invalid", f"invalid parameter name {key!r}: use {KEY_WORDS}")
    return key


def _check_scalar(key: str, value: Any) -> None:
    if isinstance(value, int):  # bool is an int
        if not isinstance(value, bool) and abs(value) > 2**53:
            raise ParamValueError("invalid", f"{key}: integer {value} is beyond +-2^53")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ParamValueError("invalid", f"{key}: {value} is not a finite number")
        return
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ParamValueError(
                "too_large", f"{key}: a string of {len(value)} characters (at most {MAX_STRING})"
            )
        return
    raise ParamValueError(
        "invalid", f"{key}: {type(value).__name__} is not a number, a boolean or a string"
    )


def check_value(key: str, value: Any) -> ParamValue:
    """``value`` if it is a JSON scalar or a short list of them, else ParamsError (one line)."""
    check_key(key)
    if isinstance(value, list):
        if len(value) > MAX_LIST:
            raise ParamValueError(
                "too_large", f"{key}: a list of {len(value)} items (at most {MAX_LIST})"
            )
        for item in value:
            if isinstance(item, list):
                raise ParamValueError("invalid", f"{key}: lists of lists are not parameters")
            _check_scalar(key, item)
        return value
    _check_scalar(key, value)
    return value  # type: ignore[no-any-return]


def parse_assignment(text: str) -> tuple[str, ParamValue | None]:
    """``key=value`` as typed on a command line: the value is JSON if it reads as JSON (``3e-4``,
    ``true``, ``[1, 2]``, ``"x"``), else the text itself; ``null`` removes the key."""
    key, sep, raw = text.partition("=")
    if not sep:
        raise ParamValueError("invalid", f"{text!r} is not KEY=VALUE")
    check_key(key)
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw  # a bare word: a string
    if isinstance(value, dict):
        raise ParamValueError("invalid", f"{key}: objects are not parameters")
    if value is None:
        return key, None
    return key, check_value(key, value)


class JobParams(msgspec.Struct, kw_only=True):
    """A job's desired parameters at ``version`` (0: none were ever set).

    A replica runs ``values`` updated with ``overrides[replica]``, if any (``effective``)."""

    job: JobName
    version: NonNegInt = 0
    values: Values = {}
    overrides: Annotated[dict[Token, Values], msgspec.Meta(max_length=MAX_OVERRIDES)] = {}
    set_by: ShortText = ""
    set_at: float = 0.0

    def effective(self, replica: str) -> dict[str, ParamValue]:
        """What ``replica`` runs: the job's values, then its own."""
        own = self.overrides.get(replica)
        return {**self.values, **own} if own else dict(self.values)


class ParamsMessage(msgspec.Struct, kw_only=True, tag_field="type", omit_defaults=False):
    """Base of the parameters' messages: the tag ``type`` and the version ``v``."""

    v: Version = PROTOCOL_VERSION


class ParamsSet(ParamsMessage, tag="params_set", kw_only=True):
    """An operator changes a job's parameters (``marduk monitor set``; admin only)."""

    job: JobName
    replica: Token | None = None  # its values only (an override); null: the job's
    values: Changes
    by: ShortText = ""  # who (the CLI says the user and host; only admins may publish this)
    # Compare-and-set: refuse unless the stored version is this one (null: apply on top of
    # whatever is stored; concurrent sets of other keys are merged, never lost).
    if_version: NonNegInt | None = None


class ParamsSetReply(ParamsMessage, tag="params_set_reply", kw_only=True):
    params: JobParams  # as stored, before any trainer is told
    changed: list[str] = []  # the keys whose value changed ([]: the set changed nothing)


class Params(ParamsMessage, tag="params", kw_only=True):
    """The controller's fan-out on ``<prefix>.<job>.cmd.params``: the whole desired state."""

    params: JobParams


ParamsState = Literal["applied", "rejected", "behind", "unknown"]


MAX_LOCAL_RANKS: Final = 256
"""Local ranks one worker's acknowledgement details (``--nproc-per-node``)."""


class RankApplied(msgspec.Struct, kw_only=True):
    """One local rank's acknowledgement, as its worker's supervisor relays it."""

    rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_LOCAL_RANKS)]
    version: NonNegInt
    rejected: Annotated[dict[ParamKey, ShortText], msgspec.Meta(max_length=MAX_REJECTED)] = {}


class ParamsApplied(ParamsMessage, tag="params_applied", kw_only=True):
    """A worker applied ``version`` at a step boundary, except the keys in ``rejected``. A
    supervisor of several local ranks says the lowest version any of them runs (a rank that
    has not acknowledged counts as 0) and each rank's word in ``ranks``."""

    job: JobName
    replica: Token
    worker: NonNegInt = 0
    version: NonNegInt
    rejected: Annotated[dict[ParamKey, ShortText], msgspec.Meta(max_length=MAX_REJECTED)] = {}
    ranks: Annotated[list[RankApplied], msgspec.Meta(max_length=MAX_LOCAL_RANKS)] = []


class ParamsAppliedReply(ParamsMessage, tag="params_applied_reply", kw_only=True):
    version: NonNegInt  # the job's current version


class ParamsQuery(ParamsMessage, tag="params_query", kw_only=True):
    job: JobName


class RankParams(msgspec.Struct, kw_only=True):
    rank: int
    version: int = 0
    state: ParamsState = "unknown"
    rejected: dict[str, str] = {}


class WorkerParams(msgspec.Struct, kw_only=True):
    """What one registered worker runs: the version it acknowledged (0: none yet); with
    several local ranks, the lowest of theirs, and each rank's in ``ranks``."""

    replica: str
    worker: int
    version: int = 0
    state: ParamsState = "unknown"
    rejected: dict[str, str] = {}
    ranks: list[RankParams] = []


class ParamsQueryReply(ParamsMessage, tag="params_query_reply", kw_only=True):
    params: JobParams
    workers: list[WorkerParams] = []
    note: Text = ""


__all__ = [
    "MAX_DOC_BYTES",
    "MAX_LIST",
    "MAX_OVERRIDES",
    "MAX_PARAMS",
    "MAX_STRING",
    "Changes",
    "JobParams",
    "ParamKey",
    "ParamValue",
    "ParamValueError",
    "Params",
    "ParamsApplied",
    "ParamsAppliedReply",
    "ParamsMessage",
    "ParamsQuery",
    "ParamsQueryReply",
    "ParamsSet",
    "ParamsSetReply",
    "ParamsState",
    "RankApplied",
    "RankParams",
    "Values",
    "WorkerParams",
    "check_key",
    "check_value",
    "parse_assignment",
]
