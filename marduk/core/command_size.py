"""The size of a job's membership command, reckoned ahead of it: every command of a job whose
node ranks the controller assigns carries its whole membership, and agents refuse a message
over ``MAX_MESSAGE_BYTES``, so a job whose membership cannot fit would never start. Pure: no
I/O, no clock.

``MembershipSizes`` keeps, per job (and local ranks per node: only workers of the job's shape
are ever members together), the encoded size of each worker's entry (``Member``: its replica
name, worker, ranks and ``--local-addr``). A first registration asks ``bound``: the largest
membership command the job's workers and the newcomer could ever make, that is the MAX largest
entries (members are at most MAX; a spare, or a worker beyond MAX, may take any member's place)
around the command's other fields at their largest (``FRAME_RESERVE``). Exact for the entries,
their commas and the digits of their ranks; conservative for the rest by at most
``FRAME_RESERVE``. Kept up to date on each change of a worker's entry (``put``, ``remove``), not
on a renewal (same entry: one look-up), so renewals stay on their fast path.

A member that left keeps its place in the membership (``membership.renew``) until one is issued
without it: its entry is kept meanwhile (a *ghost*, ``settle`` drops it).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Final

from marduk.core.drmap import WorkerKey
from marduk.wire.protocol import (
    MAX_EPOCH,
    MAX_MESSAGE_BYTES,
    Command,
    Member,
    Membership,
    Rendezvous,
    encode,
)

# The most a command may encode to: it also travels inside a registration reply, whose other
# fields need room. Agents refuse (``oversized``) any message over MAX_MESSAGE_BYTES, well
# under the NATS server's default max payload (1 MiB).
COMMAND_BUDGET: Final = MAX_MESSAGE_BYTES - 4 * 1024
# Room kept, in the bound, for what a command of the job carries besides its members and
# cannot be known at registration: its reason (a restart's cause, the members lost), the
# devices that failed, the cause's event id, its time, the coordinator's address (up to 256
# bytes). 2 KiB: a job is refused at most this much (under 1% of the budget) before its
# forming command would really overflow, and its later restarts, whose reasons are longer, fit.
FRAME_RESERVE: Final = 2 * 1024


def entry_size(replica: str, worker: int, nproc: int, addr: str) -> int:
    """The bytes of a member's entry in a membership, its node and first ranks 0 (their other
    digits are the position's: ``rank_digits``)."""
    m = Member(replica=replica, worker=worker, node_rank=0, first_rank=0, nproc=nproc, addr=addr)
    return len(encode(m))


def rank_digits(n: int, nproc: int) -> int:
    """The digits the node and first ranks of ``n`` members of ``nproc`` local ranks add beyond
    one each (node rank ``i``, first rank ``i * nproc``): exact, in O(log n)."""
    return _extra_digits(n, 1) + _extra_digits(n, nproc)


def _extra_digits(n: int, step: int) -> int:
    """Sum over ``i < n`` of the digits of ``i * step``, less one each."""
    total, bound = 0, 10
    while True:
        first = -(-bound // step)  # the least i with i * step >= bound: one digit more
        if first >= n:
            return total
        total += n - first
        bound *= 10


def frame_size(job: str, nodes: int, nproc: int) -> int:
    """A membership command of ``job`` with no member entries, its numbers and names at their
    largest, and ``FRAME_RESERVE`` for what varies."""
    membership = Membership(
        epoch=MAX_EPOCH,
        world_size=max(nodes * nproc, 1),
        coordinator_addr="",
        coordinator_port=65535,
        members=[],
    )
    command = Command(
        command_id=f"{job}/*/{MAX_EPOCH}",
        job=job,
        scope="job",
        kind="checkpoint",  # the longest kind a membership rides in
        epoch=MAX_EPOCH,
        membership=membership,
    )
    return len(encode(command)) + FRAME_RESERVE


@dataclass(frozen=True, slots=True)
class Bound:
    """The largest membership command a job's workers could make: ``size`` bytes, ``nodes``
    members."""

    size: int
    nodes: int

    @property
    def fits(self) -> bool:
        return self.size <= COMMAND_BUDGET


@dataclass(slots=True)
class _Shape:
    """The entries of one job's workers of one shape: each worker's, and all sorted."""

    entries: dict[WorkerKey, int] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)  # ascending
    total: int = 0

    def add(self, key: WorkerKey, size: int) -> None:
        self.entries[key] = size
        bisect.insort(self.sizes, size)
        self.total += size

    def drop(self, key: WorkerKey) -> None:
        size = self.entries.pop(key)
        del self.sizes[bisect.bisect_left(self.sizes, size)]
        self.total -= size


class MembershipSizes:
    """The entries of each job's workers that may be members (see the module)."""

    def __init__(self) -> None:
        self._shapes: dict[tuple[str, int], _Shape] = {}
        # Each worker's entry: (local ranks, address, size); a renewal's look-up.
        self._of: dict[WorkerKey, tuple[int, str, int]] = {}
        # Each job's membership in force and its members (replica, worker), and the ghosts:
        # members no longer registered whose entries are kept while the membership lists them.
        self._members: dict[str, tuple[Membership, frozenset[tuple[str, int]]]] = {}
        self._ghosts: dict[str, set[WorkerKey]] = {}

    def put(self, key: WorkerKey, r: Rendezvous) -> None:
        """The worker's entry as its registration ``r`` gives it (a renewal: unchanged)."""
        self._put(key, r.nproc, r.addr, registered=True)

    def remove(self, key: WorkerKey) -> None:
        """The worker is no longer registered: its entry goes, unless it is a member (kept as
        a ghost until a membership without it is issued)."""
        if key not in self._of:
            return
        settled = self._members.get(key.job)
        if settled is not None and (key.replica, key.worker) in settled[1]:
            self._ghosts.setdefault(key.job, set()).add(key)
        else:
            self._drop(key)

    def settle(self, job: str, membership: Membership | None) -> None:
        """``membership`` is the job's from now on (None: it has none): ghosts no longer in it
        go; its members not registered (a new leader reads it) are kept as ghosts. Cheap when
        it is the one settled last (every command of the job carries it)."""
        settled = self._members.get(job)
        if settled is not None and settled[0] is membership:
            return
        listed = membership.members if membership is not None else []
        members = frozenset((m.replica, m.worker) for m in listed)
        if membership is not None:
            self._members[job] = (membership, members)
        else:
            self._members.pop(job, None)
        ghosts = self._ghosts.pop(job, set())
        for key in ghosts:
            if (key.replica, key.worker) not in members:
                self._drop(key)
        kept = {g for g in ghosts if (g.replica, g.worker) in members}
        for m in listed:
            key = WorkerKey(job, m.replica, m.worker)
            if key not in self._of:
                self._put(key, m.nproc, m.addr, registered=False)
                kept.add(key)
        if kept:
            self._ghosts[job] = kept

    def bound(self, key: WorkerKey, r: Rendezvous, max_nodes: int) -> Bound:
        """The largest membership command the job's workers (of ``r``'s shape) and ``key``
        registering as ``r`` could make, with at most ``max_nodes`` members."""
        new = entry_size(key.replica, key.worker, r.nproc, r.addr)
        shape = self._shapes.get((key.job, r.nproc), _Shape())
        sizes, total = shape.sizes, shape.total
        if key in shape.entries:  # its own entry (a ghost) is replaced
            old = shape.entries[key]
            sizes = sizes.copy()
            del sizes[bisect.bisect_left(sizes, old)]
            total -= old
        count = len(sizes) + 1
        nodes = min(count, max_nodes)
        # The MAX largest: all but the (count - MAX) smallest of them and the new one.
        smallest = sorted([*sizes[: count - nodes], new])[: count - nodes]
        entries = total + new - sum(smallest)
        size = frame_size(key.job, nodes, r.nproc) + entries + nodes - 1
        return Bound(size + rank_digits(nodes, r.nproc), nodes)

    def _put(self, key: WorkerKey, nproc: int, addr: str, *, registered: bool) -> None:
        old = self._of.get(key)
        if registered:
            ghosts = self._ghosts.get(key.job)
            if ghosts is not None:
                ghosts.discard(key)
        if old is not None and old[0] == nproc and old[1] == addr:
            return
        if old is not None:
            self._drop(key)
        size = entry_size(key.replica, key.worker, nproc, addr)
        self._of[key] = (nproc, addr, size)
        self._shapes.setdefault((key.job, nproc), _Shape()).add(key, size)

    def _drop(self, key: WorkerKey) -> None:
        nproc, _, _ = self._of.pop(key)
        shape = self._shapes[(key.job, nproc)]
        shape.drop(key)
        if not shape.entries:
            del self._shapes[(key.job, nproc)]
