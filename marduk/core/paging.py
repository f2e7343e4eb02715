"""Pages that fit: split an answer of many items into replies under a byte budget (no I/O).

decisions.md #12: no message exceeds the server's max payload. The controller measures
each item's encoded size once, then cuts pages greedily; a page always holds at least one item
(an item larger than the budget is the caller's error to report).

The items are the workers, then the devices. The jobs (``QueryReply.jobs``) describe the whole
answer, not the items of a page: they are taken with the snapshot and sent once, with the page
at offset 0, whose budget counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from marduk.wire.protocol import DeviceInfo, JobInfo, WorkerInfo

# Room for the envelope of a page (controller info, counters, paging fields).
ENVELOPE_BYTES = 16 * 1024


def page_end(sizes: Sequence[int], start: int, budget: int) -> int:
    """The end (exclusive) of the page starting at ``start`` whose items fit in ``budget``.

    Each item costs its size plus one byte (the comma between list items).
    """
    end, used = start, 0
    while end < len(sizes):
        cost = sizes[end] + 1
        if end > start and used + cost > budget:
            break
        used += cost
        end += 1
    return end


@dataclass(slots=True)
class Snapshot:
    """One query's answer, kept while its pages are fetched (consistent across pages)."""

    id: str
    at: float
    workers: list[WorkerInfo]
    devices: list[DeviceInfo]
    sizes: list[int]  # encoded size of each item: the workers, then the devices
    jobs: list[JobInfo] = field(default_factory=list)  # sent with the page at offset 0 only
    jobs_size: int = 0  # their encoded size

    def page(self, offset: int, budget: int) -> tuple[Page, int | None]:
        """The items from ``offset`` that fit ``budget``, and the next offset (None: done).
        The page at offset 0 carries the jobs too, in the same budget."""
        start = min(offset, len(self.sizes))
        first = start == 0
        end = page_end(self.sizes, start, budget - (self.jobs_size if first else 0))
        nw = len(self.workers)
        page = Page(
            start,
            self.workers[min(start, nw) : min(end, nw)],
            self.devices[max(start - nw, 0) : max(end - nw, 0)],
            self.jobs if first else [],
        )
        return page, (end if end < len(self.sizes) else None)


@dataclass(slots=True)
class Page:
    offset: int
    workers: list[WorkerInfo]
    devices: list[DeviceInfo]
    jobs: list[JobInfo] = field(default_factory=list)


class SnapshotCache:
    """Answers computed once per query and kept ``keep_s`` for their next pages (8 at most)."""

    def __init__(self, keep_s: float = 30.0, capacity: int = 8) -> None:
        self.keep_s, self.capacity = keep_s, capacity
        self._snapshots: dict[str, Snapshot] = {}
        self._seq = 0
        self._enc = msgspec.json.Encoder()

    def get(
        self,
        snapshot_id: str,
        now: float,
        compute: Callable[[], tuple[list[WorkerInfo], list[DeviceInfo], list[JobInfo]]],
    ) -> Snapshot:
        for key in [k for k, v in self._snapshots.items() if now - v.at > self.keep_s]:
            del self._snapshots[key]
        snap = self._snapshots.get(snapshot_id) if snapshot_id else None
        if snap is not None:
            return snap
        workers, devices, jobs = compute()
        sizes = [len(self._enc.encode(w)) for w in workers]
        sizes += [len(self._enc.encode(d)) for d in devices]
        self._seq += 1
        jobs_size = len(self._enc.encode(jobs))
        snap = Snapshot(f"q{self._seq}", now, workers, devices, sizes, jobs, jobs_size)
        if sizes:
            self._snapshots[snap.id] = snap
            while len(self._snapshots) > self.capacity:
                self._snapshots.pop(next(iter(self._snapshots)))
        return snap
