"""Live parameters, the pure part (decisions.md #20): validate, apply a set, tell who is behind.

Data in, data out: no I/O, the time is an argument. The controller's ``ParamsDesk`` stores what
``apply_set`` returns (compare-and-set on the version) before it tells any trainer; the CLI
checks its input with ``parse_assignment`` before anything is sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from marduk.core.decisions import PolicyError
from marduk.wire.params import (
    MAX_DOC_BYTES,
    MAX_OVERRIDES,
    MAX_PARAMS,
    JobParams,
    ParamsState,
    ParamValue,
    RankApplied,
    RankParams,
    WorkerParams,
    check_key,
    check_value,
)


class ParamsError(PolicyError, ValueError):
    """A set the rules refuse (``code``: ``invalid``, ``too_large``, ``conflict``, ...); the
    message is one line."""


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


class Ack(NamedTuple):
    """What a worker acknowledged: the version (with several local ranks, the lowest any of
    them runs), the keys refused and why, and each local rank's word (``[]``: one rank)."""

    version: int
    rejected: Mapping[str, str]
    ranks: tuple[RankApplied, ...] = ()


Applied = Mapping[tuple[str, int], Ack]
"""What each worker acknowledged: (replica, worker) -> its ``Ack``."""


def _state(current: int, version: int | None, rejected: Mapping[str, str]) -> ParamsState:
    if version is None:
        return "unknown" if current == 0 else "behind"
    if version < current:
        return "behind"
    return "rejected" if rejected else "applied"


def worker_states(
    params: JobParams, workers: Iterable[tuple[str, int]], applied: Applied
) -> list[WorkerParams]:
    """Who runs which version: each registered worker's acknowledged version and state, and
    each of its local ranks' when it has several."""
    rows = []
    for replica, worker in sorted(workers):
        ack = applied.get((replica, worker))
        version, rejected = (ack.version, ack.rejected) if ack is not None else (None, {})
        rows.append(
            WorkerParams(
                replica=replica,
                worker=worker,
                version=version or 0,
                state=_state(params.version, version, rejected),
                rejected=dict(rejected),
                ranks=[
                    RankParams(
                        rank=r.rank,
                        version=r.version,
                        state=_state(params.version, r.version, r.rejected),
                        rejected=dict(r.rejected),
                    )
                    for r in (ack.ranks if ack is not None else ())
                ],
            )
        )
    return rows


def behind(params: JobParams, workers: Iterable[tuple[str, int]], applied: Applied) -> int:
    """How many of ``workers`` have not acknowledged ``params.version`` (level-triggered: the
    controller publishes the document again while any is behind)."""
    if params.version == 0:
        return 0
    return sum(1 for w in workers if applied.get(w, (0, {}))[0] < params.version)
