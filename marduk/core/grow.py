"""Growing a job back towards MAX: who joins and when (docs/decisions.md #17). Pure: no I/O,
no clock (``now`` is an argument). ``marduk.core.grow_policy`` applies it.

* **Who** (``free_workers``, ``joining``): a live worker of the job that is not a member, was
  not started with ``--spare`` (a declared spare stays one: it is kept to take a lost member's
  ranks at once), has the members' shape and no device out of service, has been live for
  ``settle`` seconds without going stale in between, and renews on time (heard from within two
  renewal intervals): a worker that flaps (registers, goes silent, registers again) starts
  over each time and never joins, and one already silent is not taken while it is not yet
  stale. Oldest registration first, as many as MAX leaves room for, all in one restart.
  The settle counts from when the worker became ready to start a trainer at once
  (``Rendezvous.ready``: its fork server has imported the framework), not from its
  registration: growing stops the members, and they would wait for the joiner's import. One
  still warming is taken only once ``WARM_UP_CAP_S`` past the settle (``settled``): it then
  starts cold, as a fork server that fails does.
* **When** (``wait_reason``): no restart in flight (it settles first), and ``interval`` since
  the job's last resize (a grow, a shrink, a hold, the membership forming). Only grows wait: a
  member lost is taken out at once, whenever the last resize was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from marduk.core.drmap import WorkerKey
from marduk.core.membership import Candidate, bounds, segment_size, segments
from marduk.wire.protocol import Membership

# A joiner whose fork server still imports this long past the settle is taken anyway (it
# starts its trainers cold): torch imports in 1.5 s, a wedged import must not block a grow.
WARM_UP_CAP_S: Final = 60.0


def free_workers(current: Membership, job: str, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The workers of ``candidates`` (live, usable) that could join ``current``: not members,
    not declared spares, of the members' shape; oldest registration first."""
    members = {WorkerKey(job, m.replica, m.worker) for m in current.members}
    shape = current.members[0].nproc if current.members else None
    free = [
        c
        for c in candidates
        if c.key not in members
        and not c.rendezvous.spare
        and (shape is None or c.rendezvous.nproc == shape)
    ]
    return sorted(free, key=lambda c: (c.registered_at, c.key))


def joining(
    current: Membership,
    job: str,
    candidates: Sequence[Candidate],
    live_since: Mapping[WorkerKey, float],
    heard: Mapping[WorkerKey, float],
    now: float,
    settle: float,
    fresh: float,
    max_nodes: int,
    *,
    ready_since: Mapping[WorkerKey, float] | None = None,
) -> list[Candidate]:
    """Those of ``free_workers`` that ``settled`` (``live_since``, ``ready_since``: see there)
    and heard from within ``fresh`` seconds (``heard``: when last), as many as ``max_nodes``
    has room for."""
    room = max_nodes - len(current.members)
    if room <= 0:
        return []
    ready = ready_since or {}
    chosen = [
        c
        for c in free_workers(current, job, candidates)
        if settled(c, live_since, ready, now, settle) and on_time(c.key, heard, now, fresh)
    ]
    size = segment_size(bounds(candidates)) if candidates else 1
    if size > 1:  # NVLink segments join whole, each of one domain
        return [c for group in segments(chosen, size, room // size) for c in group]
    return chosen[:room]


def settled(
    c: Candidate,
    live_since: Mapping[WorkerKey, float],
    ready_since: Mapping[WorkerKey, float],
    now: float,
    settle: float,
) -> bool:
    """Has ``c`` been ready for ``settle`` seconds without a break? ``live_since``: since when
    each worker has been live (absent: not live); ``ready_since``: since when one that was
    warming is ready (absent: ready since it has been live). Still warming (its registration
    says not ``ready``): only once live for ``settle`` + ``WARM_UP_CAP_S``."""
    live = live_since.get(c.key)
    if live is None:
        return False
    if not c.rendezvous.ready:
        return now - live >= settle + WARM_UP_CAP_S
    return now - max(live, ready_since.get(c.key, live)) >= settle


def on_time(key: WorkerKey, heard: Mapping[WorkerKey, float], now: float, fresh: float) -> bool:
    """Was ``key`` heard from within ``fresh`` seconds (its renewals arrive)?"""
    return key in heard and now - heard[key] <= fresh


def wait_reason(now: float, last_resize: float | None, interval: float, in_flight: bool) -> str:
    """Why a grow that could start must wait ("" if it may start now)."""
    if in_flight:
        return "a restart is in flight"
    if last_resize is not None and now - last_resize < interval:
        return f"the last resize was {now - last_resize:.0f}s ago (interval {interval:g}s)"
    return ""
