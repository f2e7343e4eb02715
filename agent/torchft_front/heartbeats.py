"""The front's heartbeat table, pure (no I/O, no clock: every call is given ``now``).

Each torchft Manager heartbeats with its replica id, ``name:uuid`` (torchft appends a fresh
uuid to Marduk's replica id per incarnation). An id is *live* while its last heartbeat is
younger than ``timeout_s`` (the front's own timeout, as torchft's ``--heartbeat_timeout_ms``);
the front keeps heartbeating every live id toward torchft's real lighthouse, whose own timeout
is short, so an id that leaves this table leaves the lighthouse's healthy set within that short
timeout. An id leaves when it ages out, or at once when Marduk orders its group (``name``)
restarted or failed (``order``): every incarnation of the group heard before the order is
*dropped*, and its later heartbeats are refused, so a process told to exit that still beats for
a moment is not counted healthy again. A new incarnation (a new uuid) is a new id.

Orders are the controller's commands, which it resends about once a second until the group
confirms: an order whose epoch is not above the last one seen for its scope (a group, or the
whole job) is a resend and drops nothing, so it never drops the incarnation the restart
started. Dropped ids are remembered for ``forget_after_s`` (a dropped process exits within
seconds) and at most ``MAX_DROPPED``; the table holds at most ``MAX_LIVE`` ids (a heartbeat
that would pass it is refused and counted).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Final

MAX_LIVE: Final = 100_000
MAX_DROPPED: Final = 100_000
MAX_ID_CHARS: Final = 1024  # torchft's ids are a name and a uuid: ~40-170 characters
JOB_SCOPE: Final = ""  # the epoch scope of a job-wide command (replica null)


def group_of(ft_id: str) -> str:
    """Marduk's replica id (the group) from torchft's ``name:uuid``."""
    return ft_id.split(":", 1)[0]


@dataclass
class Beat:
    first: float
    last: float


@dataclass
class Heartbeats:
    """Live and dropped torchft ids. ``counts``: what happened, for the front's log and
    metrics (``accepted``, ``new``, ``refused_dropped``, ``refused_full``, ``refused_id``,
    ``aged_out``, ``dropped``, ``orders``, ``orders_resent``)."""

    timeout_s: float
    forget_after_s: float = 600.0
    live: dict[str, Beat] = field(default_factory=dict)
    dropped: dict[str, float] = field(default_factory=dict)  # id -> when it was dropped
    epochs: dict[str, int] = field(default_factory=dict)  # scope -> last epoch ordered
    counts: Counter[str] = field(default_factory=Counter)

    def beat(self, ft_id: str, now: float) -> bool:
        """A Manager's heartbeat: True if it counts (forward it), False if refused (an
        incarnation Marduk ordered restarted or failed, an unusable id, a full table)."""
        if not ft_id or len(ft_id) > MAX_ID_CHARS:
            self.counts["refused_id"] += 1
            return False
        if ft_id in self.dropped:
            self.counts["refused_dropped"] += 1
            return False
        known = self.live.get(ft_id)
        if known is None:
            if len(self.live) >= MAX_LIVE:
                self.counts["refused_full"] += 1
                return False
            self.live[ft_id] = Beat(now, now)
            self.counts["new"] += 1
        else:
            known.last = now
        self.counts["accepted"] += 1
        return True

    def is_new(self, ft_id: str) -> bool:
        """Heard once only so far (the front forwards a new id at once, not at its next beat)."""
        b = self.live.get(ft_id)
        return b is not None and b.first == b.last

    def order(self, group: str | None, epoch: int, now: float) -> list[str]:
        """Marduk ordered ``group`` (None: every group of the job) restarted or failed at
        ``epoch``: drop its incarnations heard so far and return them (sorted). A resend (an
        epoch not above the last seen for that scope) drops nothing."""
        scope = JOB_SCOPE if group is None else group
        last = self.epochs.get(scope)
        if last is not None and epoch <= last:
            self.counts["orders_resent"] += 1
            return []
        self.epochs[scope] = epoch
        self.counts["orders"] += 1
        gone = sorted(i for i in self.live if group is None or group_of(i) == group)
        for i in gone:
            del self.live[i]
            self.dropped[i] = now
        self.counts["dropped"] += len(gone)
        self._bound_dropped(now)
        return gone

    def expire(self, now: float) -> list[str]:
        """Age out the ids silent for ``timeout_s`` (and forget old drops); return the aged
        ones. Call before ``ids()``."""
        aged = [i for i, b in self.live.items() if now - b.last >= self.timeout_s]
        for i in aged:
            del self.live[i]
        self.counts["aged_out"] += len(aged)
        self._bound_dropped(now)
        return aged

    def ids(self) -> list[str]:
        """The live ids: the ones to heartbeat toward the real lighthouse."""
        return list(self.live)

    def _bound_dropped(self, now: float) -> None:
        old = [i for i, t in self.dropped.items() if now - t >= self.forget_after_s]
        for i in old:
            del self.dropped[i]
        while len(self.dropped) > MAX_DROPPED:  # oldest first (dicts keep insertion order)
            del self.dropped[next(iter(self.dropped))]
