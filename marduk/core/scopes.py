"""Every restart scope's epoch state in one place. Pure: no I/O, no clock (``now`` is passed).

A scope (a replica, or a whole job for scope ``job``) has a persisted ``EpochRecord`` (its
epoch, the block reserved ahead, the command that set it) and, in memory only, what the policy
derives about it:

* **awaiting**: the live workers that have not confirmed the current epoch (by an ack, a
  ``running`` report or a fresh registration); while any is left the restart is in flight,
  further failures are merged into it, and its command is resent;
* **floor**: read from the store, the epoch every next command must be above (commands up to
  the reserved ceiling may have gone out after the record's last exact write);
* **inherited**: the restart in flight was read from the store, not decided by this leader:
  whether its workers applied it is unknown (acks are not persisted), so a failure meeting it
  takes a new epoch rather than being merged into it;
* **last sent**: when its command in flight was last (re)sent;
* **vacant since**: when its last worker left; after the retention its record is deleted.

``Scopes`` keeps them together, so a scope is added, changed and dropped in one place, and
keeps the orders the policy's time-driven scans rely on (vacancies oldest first).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from marduk.core.drmap import WorkerKey
from marduk.core.records import EpochKey, EpochRecord


class Scopes:
    """The restart scopes' records and the state derived from them (see the module)."""

    def __init__(self) -> None:
        self.records: dict[EpochKey, EpochRecord] = {}
        self._awaiting: dict[EpochKey, set[WorkerKey]] = {}
        self._floor: dict[EpochKey, int] = {}
        self._inherited: set[EpochKey] = set()
        self._last_sent: dict[EpochKey, float] = {}
        self._vacant_since: dict[EpochKey, float] = {}  # oldest first

    # --- records ---------------------------------------------------------------------------------

    def get(self, ekey: EpochKey) -> EpochRecord | None:
        return self.records.get(ekey)

    def __contains__(self, ekey: object) -> bool:
        return ekey in self.records

    def __iter__(self) -> Iterator[EpochKey]:
        return iter(self.records)

    def restore(self, record: EpochRecord) -> None:
        """A record read from the store: its next epoch is above its reserved ceiling."""
        ekey = EpochKey(record.job, record.replica)
        self.records[ekey] = record
        self._floor[ekey] = max(record.epoch, record.ceiling)

    def put(self, ekey: EpochKey, record: EpochRecord) -> None:
        self.records[ekey] = record

    def next_epoch(self, ekey: EpochKey) -> int:
        """The epoch of the scope's next command (the floor read from the store is used up)."""
        record = self.records.get(ekey)
        return max(record.epoch if record else 0, self._floor.pop(ekey, 0)) + 1

    def next_epoch_peek(self, ekey: EpochKey) -> int:
        """What ``next_epoch`` will answer, without using up the floor."""
        record = self.records.get(ekey)
        return max(record.epoch if record else 0, self._floor.get(ekey, 0)) + 1

    def drop(self, ekey: EpochKey) -> bool:
        """Forget the scope entirely; False if it had no record."""
        for table in (self._floor, self._last_sent, self._awaiting, self._vacant_since):
            table.pop(ekey, None)
        self._inherited.discard(ekey)
        return self.records.pop(ekey, None) is not None

    # --- confirmation ----------------------------------------------------------------------------

    def issued(self, ekey: EpochKey, awaiting: Iterable[WorkerKey] | None, now: float) -> None:
        """This leader issued the scope's command: ``awaiting`` must confirm it (None: nobody,
        a checkpoint is not held pending)."""
        self._inherited.discard(ekey)  # in flight by our own decision now
        if awaiting is None:
            self._awaiting.pop(ekey, None)
            return
        self._awaiting[ekey] = set(awaiting)
        self._last_sent[ekey] = now

    def inherit(self, ekey: EpochKey, key: WorkerKey) -> None:
        """Read from the store: ``key`` had not applied the scope's restart in flight."""
        self._awaiting.setdefault(ekey, set()).add(key)
        self._inherited.add(ekey)

    def inherited(self, ekey: EpochKey) -> bool:
        return ekey in self._inherited

    def wait_for(self, ekey: EpochKey, key: WorkerKey) -> None:
        """``key`` has yet to confirm the scope's epoch."""
        self._awaiting.setdefault(ekey, set()).add(key)

    def confirm(self, ekey: EpochKey, key: WorkerKey) -> None:
        waiting = self._awaiting.get(ekey)
        if waiting is not None:
            waiting.discard(key)
            if not waiting:
                del self._awaiting[ekey]

    def awaiting(self, ekey: EpochKey) -> frozenset[WorkerKey]:
        return frozenset(self._awaiting.get(ekey, ()))

    def in_flight(self, ekey: EpochKey) -> bool:
        """Some worker has yet to confirm the scope's epoch."""
        return bool(self._awaiting.get(ekey))

    # --- resends ---------------------------------------------------------------------------------

    def sent(self, ekey: EpochKey, now: float) -> None:
        self._last_sent[ekey] = now

    def due(self, now: float, interval: float) -> list[EpochKey]:
        """Scopes in flight whose command was last sent ``interval`` ago or more (the caller
        resends those still pending and marks them ``sent``); scopes no longer in flight stop
        being tracked."""
        for ekey in [k for k in self._last_sent if not self._awaiting.get(k)]:
            del self._last_sent[ekey]
        return [ekey for ekey in self._awaiting if now - self._last_sent.get(ekey, 0.0) >= interval]

    # --- vacancy ---------------------------------------------------------------------------------

    def vacated(self, ekey: EpochKey, now: float) -> None:
        """The scope's last worker left at ``now``."""
        if ekey in self.records:
            self._vacant_since.pop(ekey, None)
            self._vacant_since[ekey] = now  # to the end: the dict stays oldest first

    def occupied(self, ekey: EpochKey) -> None:
        self._vacant_since.pop(ekey, None)

    def vacant_all(self, occupied: set[EpochKey], now: float) -> None:
        """After a takeover: every scope not in ``occupied`` counts as vacant from ``now`` (when
        they were vacated is not stored)."""
        self._vacant_since = {k: now for k in self.records if k not in occupied}

    def vacant_for(self, retention: float, now: float) -> list[EpochKey]:
        """The scopes vacant ``retention`` seconds or more, no longer tracked as vacant."""
        expired = []
        for ekey, since in self._vacant_since.items():  # oldest first
            if now - since < retention:
                break
            expired.append(ekey)
        for ekey in expired:
            del self._vacant_since[ekey]
        return expired
