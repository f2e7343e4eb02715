"""The lease rule, pure: who may take the lease, at which term, and whether a leader may serve.

``marduk.controller.leadership`` reads the lease key and its revision, asks ``campaign`` what to
do with them, and makes the compare-and-set write it returns; this module reads no clock
(``now`` is an argument, monotonic seconds) and does no I/O, so every rule is tested with a fake
clock.

* A standby notes, on its own clock, when it first saw the lease's current revision
  (``Sighting``). When the lease's TTL passes without a new revision, the holder has missed
  every renewal: take it, compare-and-set on that revision (only one taker can win), at the
  next term.
* No lease at all: create it (compare-and-set on "absent").
* The lease names us (ours from before an outage, untouched since): take it back at once.
* A leader serves only while its last successful renewal was *sent* less than ``FENCE * ttl``
  ago. The standby's clock started when that renewal was already stored, so the old leader
  stops at least ``(1 - FENCE) * ttl`` before anyone may take over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec

FENCE: Final = 0.75
"""The leader stops serving when its last renewal was sent this fraction of the TTL ago."""


class Lease(msgspec.Struct, kw_only=True):
    """The value of the lease key."""

    holder: str
    term: int
    ttl: float
    pid: int = 0
    host: str = ""
    acquired_at: float = 0.0
    alive: str = ""
    """The holder's liveness subject (empty: a controller that has none is never probed)."""


@dataclass(frozen=True, slots=True)
class Sighting:
    """The lease as a standby last saw it: its revision (0: none seen), since when (monotonic
    seconds, on the standby's clock) and its value (None: absent or unreadable)."""

    revision: int = 0
    since: float = 0.0
    lease: Lease | None = None


@dataclass(frozen=True, slots=True)
class Take:
    """Write the lease for ``term``, compare-and-set on ``last`` (0: the key must be absent)."""

    last: int
    term: int


def campaign(
    seen: Sighting,
    revision: int | None,
    lease: Lease | None,
    *,
    me: str,
    my_term: int,
    ttl: float,
    now: float,
) -> tuple[Sighting, Take | None]:
    """One look at the lease key: ``revision`` None when the key is absent, ``lease`` its
    decoded value. Returns what the standby knows afterwards, and the write to make (None:
    wait)."""
    if revision is None:
        floor = max(my_term, seen.lease.term if seen.lease else 0)
        return seen, Take(0, floor + 1)
    if revision != seen.revision:
        fresh = Sighting(revision, now, lease)
        if lease is not None and lease.holder == me:
            return fresh, Take(revision, lease.term + 1)  # ours from before an outage
        return fresh, None
    if lease is not None and lease.holder == me:
        # Ours, untouched since we last wrote it (we stepped down because we could not
        # renew): nobody took it over, so take it back at once.
        return seen, Take(revision, lease.term + 1)
    lapse = lease.ttl if lease is not None else ttl
    if now - seen.since >= lapse:
        return seen, Take(revision, (lease.term if lease is not None else 0) + 1)
    return seen, None


def term_to_claim(term: int, floor: int) -> int:
    """The term to write: above every term the store has seen claimed (the lease bucket may
    have been recreated, restarting its terms at 1, while the state kept its term key)."""
    return max(term, floor + 1)


def serving(is_leader: bool, renewed_sent: float, ttl: float, now: float) -> bool:
    """May a leader whose last successful renewal was sent at ``renewed_sent`` act now?"""
    return is_leader and now - renewed_sent < FENCE * ttl
