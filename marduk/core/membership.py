"""Membership per epoch: who takes part in a job whose ranks the controller assigns. Pure: no
I/O, no clock (``now`` is an argument).

A job of scope ``job`` started with ``marduk agent run --nnodes MIN:MAX`` has its node ranks
from the controller, which is the job's rendezvous (torchrun's elastic form, without its c10d
store). Each worker registers with a ``Rendezvous``: its shape (local ranks per node), MIN:MAX,
the node rank it was given if any (``--node-rank``), and where its local rank 0 would serve as
the job's coordinator, with a few free ports its agent picked.

* **Admission** (``check``): every worker of the job has the same shape and MIN:MAX; a node rank
  is held by one live worker at a time. A second claim is refused with a reason, not queued.
* **Forming** (``ready``, ``form``): at the first epoch, once MAX workers have registered, or
  MIN and the join timeout has passed since MIN was reached. Given node ranks are kept; the
  others get the free ones in order of registration. A worker beyond MAX is not a member: its
  agent holds its trainers.
* **Each restart** (``renew``): the same members at the same ranks, and a new coordinator port:
  the first port rank 0's agent reported that is not the previous epoch's (its agent reports
  fresh ones after each start), so a restarted rank never reaches the previous incarnation's
  coordinator and the new one never binds a port left in TIME_WAIT. A member no longer
  registered keeps its rank unless a live worker claims that rank (``--node-rank``): a
  replacement pod with another identity takes its place.

* **A member out of service** (``replace``; docs/decisions.md #16): a free spare of its shape
  (``--spare``, or a worker beyond MAX) takes its node rank and ranks; with none the others close
  ranks (shrink); below MIN there is no membership (the job is held until it forms again).
* **Workers joining a job below MAX** (``grow``; docs/decisions.md #17): the members keep their
  node ranks, the new ones take the next, in the order given.
* **NVLink segments** (``--segment N``, ``segments``): node ranks in groups of N contiguous
  ranks whose nodes share one NVLink domain (NVML's ClusterUUID); a domain gives as many whole
  segments as it has nodes for, and only whole segments are members (forming, a grow). A lost
  member's ranks go to a spare of its segment's domain; with none, its segment leaves whole
  (``_replace_segments``). Without ``--segment`` nothing of this applies.

The membership is written ahead with its epoch record (``EpochRecord.membership``) and carried
in every command of the job (``Command.membership``); docs/decisions.md #14.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from marduk.core.drmap import WorkerKey
from marduk.wire.protocol import Member, Membership, Rendezvous

# The coordinator port when rank 0's agent reported none (an older agent): torchrun's default,
# moved by the epoch over a span of ports as agents without a controller do.
FALLBACK_PORT = 29500
FALLBACK_SPAN = 16


class MembershipError(ValueError):
    """A worker that cannot join the job's membership; ``code`` is stable (the wire's error
    code), the message one line that says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Candidate:
    """A registered worker of the job, as the rendezvous sees it."""

    key: WorkerKey
    rendezvous: Rendezvous
    registered_at: float = 0.0
    devices: int = 0  # how many devices it registered (a pool spare's shape; 0: not asked)
    domain: str = ""  # its node's NVLink domain (``Registration.nvlink_domain``; "": unknown)


def check(
    new: Candidate,
    others: Iterable[Candidate],
    current: Membership | None,
    is_live: Callable[[WorkerKey], bool] | None = None,
) -> None:
    """Refuse (MembershipError) a worker that cannot take part next to the job's other live
    workers ``others``: a wrong range, another shape, or a node rank someone else holds.
    ``is_live``: whether a worker is live (a member holding the rank claimed); default: one of
    ``others``."""
    r = new.rendezvous
    if r.min_nodes > r.max_nodes:
        raise MembershipError("invalid", f"--nnodes {r.min_nodes}:{r.max_nodes}: MIN above MAX")
    if r.spare and r.node_rank is not None:
        raise MembershipError("invalid", "a spare (--spare) takes no --node-rank")
    if r.node_rank is not None and r.node_rank >= r.max_nodes:
        raise MembershipError(
            "invalid", f"node rank {r.node_rank} is not below the job's {r.max_nodes} nodes"
        )
    live = {}
    for other in others:
        if other.key == new.key:
            continue
        live[other.key] = other
        q = other.rendezvous
        if r.spare or q.spare:
            pass  # a spare of another shape may wait here: it is never chosen
        elif q.nproc != r.nproc:
            raise MembershipError(
                "shape_mismatch",
                f"job {new.key.job!r} runs {q.nproc} local rank(s) per node (worker "
                f"{_name(other.key)}); worker {_name(new.key)} has {r.nproc}",
            )
        elif q.segment != r.segment:
            raise MembershipError(
                "shape_mismatch",
                f"job {new.key.job!r} has --segment {q.segment} (worker {_name(other.key)}); "
                f"worker {_name(new.key)} asked for {r.segment}",
            )
        elif (q.min_nodes, q.max_nodes) != (r.min_nodes, r.max_nodes):
            raise MembershipError(
                "shape_mismatch",
                f"job {new.key.job!r} has --nnodes {q.min_nodes}:{q.max_nodes} (worker "
                f"{_name(other.key)}); worker {_name(new.key)} asked for "
                f"{r.min_nodes}:{r.max_nodes}",
            )
        if r.node_rank is not None and q.node_rank == r.node_rank:
            raise MembershipError(
                "rank_conflict",
                f"node rank {r.node_rank} of job {new.key.job!r} is claimed by live worker "
                f"{_name(other.key)}; worker {_name(new.key)} may not claim it too",
            )
    check_claim(new, is_live or live.__contains__, current)


def check_claim(
    new: Candidate, is_live: Callable[[WorkerKey], bool], current: Membership | None
) -> None:
    """Refuse (MembershipError) a worker's ``--node-rank`` that a live member of the job's
    ``current`` membership holds (a spare that took it, say)."""
    r = new.rendezvous
    if current is not None and r.node_rank is not None:
        for m in current.members:
            key = WorkerKey(new.key.job, m.replica, m.worker)
            if m.node_rank == r.node_rank and key != new.key and is_live(key):
                raise MembershipError(
                    "rank_conflict",
                    f"node rank {r.node_rank} of job {new.key.job!r} is held by live worker "
                    f"{_name(key)} since epoch {current.epoch}; worker {_name(new.key)} may "
                    "not claim it too",
                )


def ready(
    candidates: Sequence[Candidate], since: float | None, now: float, join_timeout: float
) -> bool:
    """May the first membership form now? MAX workers are here, or MIN have been for the join
    timeout (``since``: when MIN were first here; None: not yet)."""
    if not candidates:
        return False
    r = bounds(candidates)
    fit = [c for c in candidates if c.rendezvous.nproc == r.nproc]
    n = segment_size(r)
    if n > 1:  # only whole segments count, each in one domain
        whole = len(segments([c for c in fit if not c.rendezvous.spare], n, r.max_nodes // n))
        if whole * n >= r.max_nodes:
            return True
        whole = len(segments(fit, n, r.max_nodes // n))
        return whole * n >= r.min_nodes and since is not None and now - since >= join_timeout
    if sum(not c.rendezvous.spare for c in fit) >= r.max_nodes:
        return True
    return len(fit) >= r.min_nodes and since is not None and now - since >= join_timeout


def quorum_since(candidates: Sequence[Candidate]) -> float | None:
    """Since when MIN of ``candidates`` (of the job's shape) have been registered: the
    registration time of the MIN-th, oldest first (None: fewer than MIN are here). Derived from
    the workers' records, which are persisted, so the join timeout survives a new leader."""
    if not candidates:
        return None
    r = bounds(candidates)
    times = sorted(c.registered_at for c in candidates if c.rendezvous.nproc == r.nproc)
    n = max(r.min_nodes, 1)
    return times[n - 1] if len(times) >= n else None


def form(epoch: int, candidates: Sequence[Candidate]) -> Membership | None:
    """The first membership, at ``epoch``, of the live ``candidates`` (checked); None when the
    given node ranks do not fit the workers there are (a rank 3 among two workers: wait)."""
    if not candidates:
        return None
    # Spares last: they are members only when the job cannot form without them.
    ordered = sorted(candidates, key=lambda c: (c.rendezvous.spare, c.registered_at, c.key))
    shape = bounds(ordered)
    ordered = [c for c in ordered if c.rendezvous.nproc == shape.nproc]
    size = segment_size(shape)
    if size > 1:  # whole segments only, each one domain's, in contiguous node ranks
        groups = segments(ordered, size, shape.max_nodes // size)
        if len(groups) * size < shape.min_nodes:
            return None
        chosen = [c for group in groups for c in group]
        return _membership(epoch, dict(enumerate(chosen)), None)
    n = min(len(ordered), shape.max_nodes)
    given = [c for c in ordered if c.rendezvous.node_rank is not None]
    if any(c.rendezvous.node_rank is not None and c.rendezvous.node_rank >= n for c in given):
        return None
    unranked = [c for c in ordered if c.rendezvous.node_rank is None][: n - len(given)]
    taken = {c.rendezvous.node_rank for c in given}
    free = [rank for rank in range(n) if rank not in taken]
    placed = [(c.rendezvous.node_rank, c) for c in given]
    placed += list(zip(free, unranked, strict=True))
    return _membership(epoch, {rank: c for rank, c in placed if rank is not None}, None)


def renew(
    previous: Membership, epoch: int, job: str, candidates: Sequence[Candidate]
) -> Membership:
    """The membership of a restart of ``job`` at ``epoch``: the previous members at their ranks
    (a member gone is replaced by a live worker claiming its rank), a coordinator port not the
    previous one."""
    live = {c.key: c for c in candidates}
    members = {WorkerKey(job, m.replica, m.worker) for m in previous.members}
    by_rank: dict[int, Candidate | Member] = {}
    for m in previous.members:
        c = live.get(WorkerKey(job, m.replica, m.worker))
        if c is None:
            claimant = next(
                (
                    c
                    for c in candidates
                    if c.rendezvous.node_rank == m.node_rank and c.key not in members
                ),
                None,
            )
            by_rank[m.node_rank] = claimant or m
        else:
            by_rank[m.node_rank] = c
    return _membership(epoch, by_rank, previous)


@dataclass(frozen=True, slots=True)
class Change:
    """A membership without some members (``replace``): ``membership`` is None when fewer than
    MIN nodes would be left (the job is held until enough workers are back)."""

    membership: Membership | None
    replaced: tuple[tuple[Member, Candidate], ...] = ()  # a lost member, the spare in its place
    dropped: tuple[Member, ...] = ()  # lost members no spare replaced (the job shrinks)


def free_spares(current: Membership, job: str, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The live workers of ``job`` not in ``current``, in the order they are taken: declared
    spares first (``--spare``), then workers beyond MAX, each by time of registration."""
    members = {WorkerKey(job, m.replica, m.worker) for m in current.members}
    free = [c for c in candidates if c.key not in members]
    return sorted(free, key=lambda c: (not c.rendezvous.spare, c.registered_at, c.key))


def replace(
    previous: Membership,
    epoch: int,
    job: str,
    lost: Collection[WorkerKey],
    candidates: Sequence[Candidate],
    min_nodes: int,
    pool: Sequence[Candidate] = (),
    sizes: Mapping[WorkerKey, int] | None = None,
) -> Change:
    """The membership at ``epoch`` without the members ``lost``. Each lost member's node rank
    and ranks go to a free spare of its shape (same world size: the checkpoint restores
    unchanged); each spare takes one rank at most. A lost member no spare fits is dropped: the
    others keep their order with node ranks contiguous again (the coordinator moves with
    node 0); fewer than ``min_nodes`` left: no membership (held). ``candidates``: the live
    workers of the job that may take part (the caller leaves out those out of service).
    ``pool``: spares of the job's pool, taken after its own, as keys of the job; one fits a
    member of its local ranks with as many devices as the member had (``sizes``)."""
    live = {c.key: c for c in candidates if c.key not in lost}
    free = [c for c in free_spares(previous, job, candidates) if c.key not in lost]
    free += [c for c in pool if c.key not in live and c.key not in lost]
    segment = segment_size(bounds(candidates)) if candidates else 0
    if segment > 1:
        return _replace_segments(previous, epoch, job, lost, live, free, min_nodes, segment)
    sizes = sizes or {}
    by_rank: dict[int, Candidate | Member] = {}
    replaced: list[tuple[Member, Candidate]] = []
    dropped: list[Member] = []
    for m in previous.members:
        key = WorkerKey(job, m.replica, m.worker)
        if key not in lost:
            by_rank[m.node_rank] = live.get(key, m)
            continue
        size = sizes.get(key)
        spare = next((c for c in free if _fits(c, m, size)), None)
        if spare is None:
            dropped.append(m)
            continue
        free.remove(spare)
        by_rank[m.node_rank] = spare
        replaced.append((m, spare))
    if len(by_rank) < max(min_nodes, 1):
        return Change(None, tuple(replaced), tuple(dropped))
    if dropped:  # node ranks contiguous again, in the previous order
        by_rank = {
            new: held
            if isinstance(held, Candidate)
            else msgspec.structs.replace(held, node_rank=new)
            for new, (_, held) in enumerate(sorted(by_rank.items()))
        }
    return Change(_membership(epoch, by_rank, previous), tuple(replaced), tuple(dropped))


def segment_size(r: Rendezvous) -> int:
    """Nodes per NVLink segment of the job (``--segment``); 1: no segments."""
    return max(r.segment, 1)


def segments(candidates: Sequence[Candidate], size: int, most: int) -> list[list[Candidate]]:
    """Whole segments of ``size`` nodes, each of one NVLink domain, at most ``most``: the
    domains in order of their first candidate, each giving as many whole segments as it has
    nodes for (its candidates in the given order); the nodes left over take no part. Nodes
    whose domain is not known ("") count as one domain."""
    by_domain: dict[str, list[Candidate]] = {}
    for c in candidates:
        by_domain.setdefault(c.domain, []).append(c)
    out: list[list[Candidate]] = []
    for group in by_domain.values():
        for i in range(0, len(group) - size + 1, size):
            if len(out) >= most:
                return out
            out.append(group[i : i + size])
    return out


def _replace_segments(
    previous: Membership,
    epoch: int,
    job: str,
    lost: Collection[WorkerKey],
    live: Mapping[WorkerKey, Candidate],
    free: list[Candidate],
    min_nodes: int,
    size: int,
) -> Change:
    """``replace`` for a job of NVLink segments: a lost member's ranks go to a free spare of
    its shape in its segment's domain (the domain of the segment's members still live); a
    segment no spare can keep whole leaves the membership whole (its live members become free
    workers, not retired), the segments after it move down, node ranks contiguous."""
    kept: list[Candidate | Member] = []
    replaced: list[tuple[Member, Candidate]] = []
    dropped: list[Member] = []
    ordered = sorted(previous.members, key=lambda m: m.node_rank)
    for start in range(0, len(ordered), size):
        segment = ordered[start : start + size]
        keys = [WorkerKey(job, m.replica, m.worker) for m in segment]
        domains = {live[k].domain for k in keys if k not in lost and k in live}
        held: list[Candidate | Member] = []
        swaps: list[tuple[Member, Candidate]] = []
        taken: list[Candidate] = []
        for m, key in zip(segment, keys, strict=True):
            if key not in lost:
                held.append(live.get(key, m))
                continue
            spare = next(
                (
                    c
                    for c in free
                    if c not in taken
                    and c.rendezvous.nproc == m.nproc
                    and (not domains or c.domain in domains)
                ),
                None,
            )
            if spare is None:
                break
            domains = domains or {spare.domain}
            taken.append(spare)
            held.append(spare)
            swaps.append((m, spare))
        if len(held) < len(segment) or len(segment) < size:
            dropped.extend(segment)
            continue
        for spare in taken:
            free.remove(spare)
        replaced.extend(swaps)
        kept.extend(held)
    if len(kept) < max(min_nodes, 1):
        return Change(None, tuple(replaced), tuple(dropped))
    by_rank: dict[int, Candidate | Member] = {
        rank: held if isinstance(held, Candidate) else msgspec.structs.replace(held, node_rank=rank)
        for rank, held in enumerate(kept)
    }
    return Change(_membership(epoch, by_rank, previous), tuple(replaced), tuple(dropped))


def _fits(c: Candidate, m: Member, size: int | None) -> bool:
    """Can spare ``c`` take member ``m``'s ranks: its local ranks, and a pool spare's devices
    (``size``: the member's device count, when known)."""
    if c.rendezvous.nproc != m.nproc:
        return False
    return not c.devices or size is None or c.devices == size


def grow(
    previous: Membership,
    epoch: int,
    job: str,
    candidates: Sequence[Candidate],
    joining: Sequence[Candidate],
) -> Membership:
    """The membership at ``epoch`` with the workers ``joining`` added (checked: not members,
    of the members' shape, no more than MAX allows): the members keep their node ranks, the
    new ones take the next ones in the given order, ranks contiguous; a coordinator port not
    the previous one. ``candidates``: the job's live workers (rank 0's fresh ports)."""
    live = {c.key: c for c in candidates}
    by_rank: dict[int, Candidate | Member] = {
        m.node_rank: live.get(WorkerKey(job, m.replica, m.worker), m) for m in previous.members
    }
    taken = {WorkerKey(job, m.replica, m.worker) for m in previous.members}
    for c in joining:
        if c.key in taken:
            raise ValueError(f"worker {_name(c.key)} is a member already")
        taken.add(c.key)
        by_rank[len(by_rank)] = c  # node ranks are contiguous: the next one is the count
    return _membership(epoch, by_rank, previous)


def coordinator_port(
    ports: Sequence[int], addr: str, previous: Membership | None, epoch: int
) -> int:
    """The first of rank 0's reported ``ports`` that is not the previous coordinator's (on the
    same address); with none, one of a fixed span moved by the epoch."""
    used = (
        previous.coordinator_port
        if previous is not None and previous.coordinator_addr == addr
        else None
    )
    for port in ports:
        if port != used:
            return port
    port = FALLBACK_PORT + epoch % FALLBACK_SPAN
    return port if port != used else FALLBACK_PORT + (epoch + 1) % FALLBACK_SPAN


def _membership(
    epoch: int, by_rank: dict[int, Candidate | Member], previous: Membership | None
) -> Membership:
    members = []
    for rank in sorted(by_rank):
        held = by_rank[rank]
        if isinstance(held, Member):
            members.append(held)
            continue
        r = held.rendezvous
        members.append(
            Member(
                replica=held.key.replica,
                worker=held.key.worker,
                node_rank=rank,
                first_rank=0,
                nproc=r.nproc,
                addr=r.addr,
            )
        )
    first = 0
    placed = []
    for m in members:  # ranks follow node-rank order: node k's are after node k-1's
        placed.append(
            Member(
                replica=m.replica,
                worker=m.worker,
                node_rank=m.node_rank,
                first_rank=first,
                nproc=m.nproc,
                addr=m.addr,
            )
        )
        first += m.nproc
    zero = by_rank[placed[0].node_rank]
    ports = zero.rendezvous.ports if isinstance(zero, Candidate) else []
    return Membership(
        epoch=epoch,
        world_size=first,
        coordinator_addr=placed[0].addr,
        coordinator_port=coordinator_port(ports, placed[0].addr, previous, epoch),
        members=placed,
    )


def span(m: Member) -> str:
    """A member's global ranks, first-last (as events name them)."""
    return f"{m.first_rank}-{m.first_rank + m.nproc - 1}"


def bounds(candidates: Sequence[Candidate]) -> Rendezvous:
    """The job's shape and MIN:MAX: a non-spare's (spares may have another shape)."""
    return next(
        (c.rendezvous for c in candidates if not c.rendezvous.spare), candidates[0].rendezvous
    )


def _name(key: WorkerKey) -> str:
    return f"{key.replica}/{key.worker}"
