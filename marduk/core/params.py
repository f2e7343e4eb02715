"""Live parameters, the pure part (decisions.md #20): validate, apply a set, tell who is behind.

Data in, data out: no I/O, the time is an argument. The controller's ``ParamsDesk`` stores what
``apply_set`` returns (compare-and-set on the version) before it tells any trainer; the CLI
checks its input with ``parse_assignment`` before anything is sent.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from marduk.core.decisions import PolicyError
from marduk.wire.params import (
    KEY_PATTERN,
    KEY_WORDS,
    MAX_LIST,
    MAX_OVERRIDES,
    MAX_PARAMS,
    MAX_STRING,
    JobParams,
    ParamValue,
    WorkerParams,
)

MAX_DOC_BYTES: Final = 64 * 1024
"""A job's whole document (values and overrides), encoded, at most: it travels in every
registration reply and every fan-out, well under the server's max payload."""

_KEY_RE = re.compile(KEY_PATTERN)


class ParamsError(PolicyError, ValueError):
    """A set the rules refuse (``code``: ``invalid``, ``too_large``, ``conflict``, ...); the
    message is one line."""


def check_key(key: str) -> str:
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise ParamsError("invalid", f"invalid parameter name {key!r}: use {KEY_WORDS}")
    return key


def _check_scalar(key: str, value: Any) -> None:
    if isinstance(value, int):  # bool is an int
        if not isinstance(value, bool) and abs(value) > 2**53:
            raise ParamsError("invalid", f"{key}: integer {value} is beyond +-2^53")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ParamsError("invalid", f"{key}: {value} is not a finite number")
        return
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ParamsError(
                "too_large", f"{key}: a string of {len(value)} characters (at most {MAX_STRING})"
            )
        return
    raise ParamsError(
        "invalid", f"{key}: {type(value).__name__} is not a number, a boolean or a string"
    )


def check_value(key: str, value: Any) -> ParamValue:
    """``value`` if it is a JSON scalar or a short list of them, else ParamsError (one line)."""
    check_key(key)
    if isinstance(value, list):
        if len(value) > MAX_LIST:
            raise ParamsError(
                "too_large", f"{key}: a list of {len(value)} items (at most {MAX_LIST})"
            )
        for item in value:
            if isinstance(item, list):
                raise ParamsError("invalid", f"{key}: lists of lists are not parameters")
            _check_scalar(key, item)
        return value
    _check_scalar(key, value)
    return value  # type: ignore[no-any-return]


def parse_assignment(text: str) -> tuple[str, ParamValue | None]:
    """``key=value`` as typed on a command line: the value is JSON if it reads as JSON (``3e-4``,
    ``true``, ``[1, 2]``, ``"x"``), else the text itself; ``null`` removes the key."""
    key, sep, raw = text.partition("=")
    if not sep:
        raise ParamsError("invalid", f"{text!r} is not KEY=VALUE")
    check_key(key)
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw  # a bare word: a string
    if isinstance(value, dict):
        raise ParamsError("invalid", f"{key}: objects are not parameters")
    if value is None:
        return key, None
    return key, check_value(key, value)


@dataclass(frozen=True, slots=True)
class SetResult:
    params: JobParams  # the new document (version + 1), or the current one if nothing changed
    changed: list[str]
    old: dict[str, ParamValue | None]  # the changed keys' values before (None: unset)
    new: dict[str, ParamValue | None]


def apply_set(
    current: JobParams,
    changes: Mapping[str, ParamValue | None],
    *,
    replica: str | None,
    by: str,
    now: float,
    if_version: int | None = None,
) -> SetResult:
    """The document after ``changes`` (``None``: remove the key), for the job or one replica.

    A set that changes nothing keeps the version (a repeated set is not news to any trainer).
    """
    if if_version is not None and if_version != current.version:
        raise ParamsError(
            "conflict",
            f"job {current.job} is at version {current.version}, not {if_version}: "
            "someone else set it; read it again (marduk monitor params)",
        )
    if not changes:
        raise ParamsError("invalid", "nothing to set: give KEY=VALUE")
    for key, value in changes.items():
        if value is not None:
            check_value(key, value)
        else:
            check_key(key)
    values = dict(current.values if replica is None else current.overrides.get(replica, {}))
    old: dict[str, ParamValue | None] = {}
    new: dict[str, ParamValue | None] = {}
    for key, value in changes.items():
        before = values.get(key)
        if _same(before, value):
            continue
        old[key], new[key] = before, value
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    if not new:
        return SetResult(current, [], {}, {})
    if len(values) > MAX_PARAMS:
        raise ParamsError("too_large", f"{len(values)} parameters (at most {MAX_PARAMS})")
    overrides = dict(current.overrides)
    if replica is None:
        job_values = values
    else:
        job_values = dict(current.values)
        if values:
            overrides[replica] = values
        else:
            overrides.pop(replica, None)
        if len(overrides) > MAX_OVERRIDES:
            raise ParamsError(
                "too_large",
                f"{len(overrides)} replicas with values of their own (at most {MAX_OVERRIDES})",
            )
    params = JobParams(
        job=current.job,
        version=current.version + 1,
        values=job_values,
        overrides=overrides,
        set_by=by,
        set_at=now,
    )
    size = len(msgspec.json.encode(params))
    if size > MAX_DOC_BYTES:
        raise ParamsError(
            "too_large",
            f"the parameters of {current.job} would take {size} bytes (at most {MAX_DOC_BYTES})",
        )
    return SetResult(params, sorted(new), old, new)


def _same(a: Any, b: Any) -> bool:
    # 1 and True (and 1.0) are equal in Python, not as parameters.
    return type(a) is type(b) and a == b


def describe_change(result: SetResult, replica: str | None) -> str:
    """One line for the ``params_set`` event: every changed key, old -> new."""
    where = f" (replica {replica})" if replica else ""
    parts = [
        f"{k}: {_show(result.old.get(k))} -> {_show(result.new.get(k))}" for k in result.changed
    ]
    return f"version {result.params.version}{where}: " + ", ".join(parts)


def _show(value: ParamValue | None) -> str:
    return "unset" if value is None else json.dumps(value)


Applied = Mapping[tuple[str, int], tuple[int, Mapping[str, str]]]
"""What each worker acknowledged: (replica, worker) -> (version, rejected keys and why)."""


def worker_states(
    params: JobParams, workers: Iterable[tuple[str, int]], applied: Applied
) -> list[WorkerParams]:
    """Who runs which version: each registered worker's acknowledged version and state."""
    rows = []
    for replica, worker in sorted(workers):
        version, rejected = applied.get((replica, worker), (0, {}))
        if (replica, worker) not in applied:
            state = "unknown" if params.version == 0 else "behind"
        elif version < params.version:
            state = "behind"
        elif rejected:
            state = "rejected"
        else:
            state = "applied"
        rows.append(
            WorkerParams(
                replica=replica,
                worker=worker,
                version=version,
                state=state,  # type: ignore[arg-type]
                rejected=dict(rejected),
            )
        )
    return rows


def behind(params: JobParams, workers: Iterable[tuple[str, int]], applied: Applied) -> int:
    """How many of ``workers`` have not acknowledged ``params.version`` (level-triggered: the
    controller publishes the document again while any is behind)."""
    if params.version == 0:
        return 0
    return sum(1 for w in workers if applied.get(w, (0, {}))[0] < params.version)
