"""The structs of a job whose ranks the controller assigns: what a worker brings to the
rendezvous, the membership the controller forms, and what a query shows of the job
(``JobInfo``). ``marduk.wire.protocol`` re-exports them.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from marduk.wire.fields import (
    MAX_MEMBERS,
    Epoch,
    JobName,
    NonNegInt,
    Port,
    PosInt,
    ShortText,
    Text,
    Token,
)


class Rendezvous(msgspec.Struct, kw_only=True):
    """What a worker of a job whose ranks the controller assigns brings to that rendezvous
    (``marduk agent run --nnodes MIN:MAX``, scope ``job``): its shape, the node rank it was
    given (if any), where its local rank 0 would serve as the job's coordinator and free ports
    its agent picked for that."""

    nproc: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    min_nodes: Annotated[int, msgspec.Meta(ge=1, le=MAX_MEMBERS)]
    max_nodes: Annotated[int, msgspec.Meta(ge=1, le=MAX_MEMBERS)]
    # --node-rank, when the agent was given one: the controller keeps it.
    node_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_MEMBERS)] | None = None
    addr: ShortText
    # Free ports on ``addr``; the controller never names the previous epoch's port again.
    ports: Annotated[list[Port], msgspec.Meta(max_length=8)] = []
    # A hot spare (``--spare``): registered, no trainer, never in the first membership; it
    # takes the ranks of a member that goes out of service. Workers beyond MAX are spares too.
    spare: bool = False
    # A pool of hot spares (``--spare-pool NAME``). On a job's worker: the pool the job may
    # draw a spare from when no spare of its own fits. On a spare (``--spare``) registered under
    # the job named like the pool: a spare of that pool, free for any job that names it; once
    # a job claims it, it registers under that job (``RegisterReply.claimed_by``).
    pool: JobName | None = None
    # Can it start a trainer at once (its fork server has imported the framework, or it has
    # none)? False while the fork server warms up; the agent registers again once it is ready.
    # A grow's settle counts from then (docs/decisions.md #17). Older agents: always true.
    ready: bool = True
    # Why this node failed its checks before a start (``marduk agent run``'s
    # ``--node-check-endpoint``, ``--storage-check``, ``--check-mounts``); "" while it passes.
    # Set, the node is unusable as a drained one is: it takes no rank and is no spare, and a
    # member saying so is retired at once (a spare takes its ranks, or the job shrinks). Older
    # controllers ignore it.
    unhealthy: Text = ""
    # NVLink segments (``--segment N``; 0 or 1: none): node ranks in groups of N contiguous
    # ranks, each group's nodes in one NVLink domain (``Registration.nvlink_domain``), only
    # whole groups in the membership; MIN and MAX are multiples of N.
    segment: Annotated[int, msgspec.Meta(ge=0, le=MAX_MEMBERS)] = 0


class Member(msgspec.Struct, kw_only=True, frozen=True):
    """One worker of a membership: its node's ranks are ``first_rank`` .. + ``nproc`` - 1."""

    replica: Token
    worker: NonNegInt = 0
    node_rank: NonNegInt
    first_rank: NonNegInt
    nproc: PosInt = 1
    addr: ShortText = ""


class WorkerRef(msgspec.Struct, kw_only=True, frozen=True):
    """One worker of a job, by name."""

    replica: Token
    worker: NonNegInt = 0


class Membership(msgspec.Struct, kw_only=True, frozen=True):
    """Who takes part in a job of scope ``job`` from ``epoch`` on: the members in node-rank
    order, the world size and the coordinator (member 0's address and a port its agent chose)."""

    epoch: Epoch
    world_size: PosInt
    coordinator_addr: ShortText
    coordinator_port: Port
    members: Annotated[list[Member], msgspec.Meta(max_length=MAX_MEMBERS)]

    def member(self, replica: str, worker: int) -> Member | None:
        for m in self.members:
            if m.replica == replica and m.worker == worker:
                return m
        return None


class JobInfo(msgspec.Struct, kw_only=True):
    """A job whose node ranks the controller assigns (``--nnodes MIN:MAX``): its size, its
    spares and its resizes, as ``marduk monitor status`` shows them (marduk/core/job_views.py)."""

    job: str
    min_nodes: int
    max_nodes: int
    nodes: int = 0  # members of the membership in force; 0: forming or held
    world_size: int = 0
    epoch: int = 0
    spares: list[str] = []  # free spares ("replica/worker"), ready to take a lost member's ranks
    holding: list[str] = []  # spares that took a lost member's place ("replica/worker")
    joining: list[str] = []  # free workers that will grow the job (not --spare, below MAX)
    # A resize under way: "forming", "held", "joining" (a new worker settles or the resize
    # interval runs), "checkpoint" (a grow waits for it), "applying" (a new membership is out,
    # not every member runs it yet); "" when none. Since when, and what it waits for.
    resize: str = ""
    resize_detail: str = ""
    resize_since: float = 0.0
    # The last membership change this leader made: the event (membership_formed,
    # member_replaced, job_shrunk, job_held, member_added), its epoch, time and detail.
    last_resize: str = ""
    last_resize_epoch: int = 0
    last_resize_at: float = 0.0
    last_resize_detail: str = ""
    # Pools of spares (``--spare-pool``). On a job: the pool it draws from, and the pool spares
    # it claimed ("replica/worker"). On a pool (``is_pool``: ``job`` is the pool's name, every
    # worker a pool spare): ``spares`` are the free ones, ``claimed`` "replica/worker by JOB".
    pool: str = ""
    is_pool: bool = False
    claimed: list[str] = []
