"""Where this node sits at an epoch when the controller assigns the node ranks (``marduk agent
run --nnodes MIN:MAX`` without ``--node-rank``; marduk/core/membership.py decides).

The agent holds its trainers until the membership naming this worker has come with a command at
the epoch it starts at, or a later one (the published command, or the command of a registration
reply: it registers again each second while it waits, so a lost command costs a second). Then
each rank gets torchrun's variables from it (``LaunchSpec.placed``). When this node is the
coordinator of an epoch, its agent picks fresh free ports for the next one and registers them,
so the controller never names the port of the coordinator that is stopping now.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec

from agent.library.nats_client import AsyncClient
from agent.library.options import Options
from agent.supervise.ports import coordinator_ports
from marduk.wire.protocol import Member, Membership

log = logging.getLogger("agent.supervisor")

ASK_EVERY_S = 1.0  # while waiting: register again this often (level-triggered)


async def membership_for(
    client: Callable[[], AsyncClient | None],
    opts: Options,
    epoch: int,
    move: Callable[[str], Awaitable[None]],
) -> tuple[int, Membership, Member]:
    """The newest membership naming this worker, carried by a command at ``epoch`` or later:
    (that command's epoch, the membership, this worker's entry). Waits as long as it takes
    (the caller races it against signals). A spare of a pool that a job claims ``move``s to
    that job first (``ControllerLink.move``) and has its membership from there."""
    said = ""
    while True:
        c = client()
        if c is not None and c.claimed_by is not None:
            await move(c.claimed_by)
            continue
        if c is not None:
            c.membership_changed.clear()
            got = c.membership
            if got is not None and got[0] >= epoch:
                me = got[1].member(opts.replica, opts.worker)
                if me is not None:
                    return got[0], got[1], me
                why = _not_a_member(opts, got[0], len(got[1].members))
            else:
                why = f"waiting for the controller to assign this node's ranks (epoch {epoch})"
        else:
            why = "waiting for the controller"
        if why != said:
            # Waiting for a place is what a spare, and every node at the start, does.
            log.log(logging.WARNING if c is None else logging.INFO, "%s", why)
            said = why
        if c is None:
            await asyncio.sleep(ASK_EVERY_S)
            continue
        try:
            await asyncio.wait_for(c.membership_changed.wait(), ASK_EVERY_S)
        except TimeoutError:
            await c.reregister()


def _not_a_member(opts: Options, epoch: int, nodes: int) -> str:
    spare = opts.rendezvous is not None and opts.rendezvous.spare
    if spare:
        return (
            f"a spare of the job ({nodes} node(s) at epoch {epoch}): waiting, its trainers not "
            "started, until the controller gives it a lost member's ranks"
        )
    return (
        f"not a member of the job at epoch {epoch} ({nodes} node(s)): waiting, its trainers "
        "not started, until the controller gives it ranks (the job may grow, or lose a member)"
    )


def refresh_ports(opts: Options, membership: Membership, me: Member) -> bool:
    """This node coordinates ``membership`` on one of the ports it reported: report fresh ones
    for the next epoch (True: register again)."""
    r = opts.rendezvous
    if r is None or me.node_rank != 0 or membership.coordinator_port not in r.ports:
        return False
    fresh = coordinator_ports(len(r.ports), frozenset({membership.coordinator_port}))
    opts.rendezvous = msgspec.structs.replace(r, ports=fresh)
    return True


def describe(epoch: int, membership: Membership, me: Member) -> str:
    last = me.first_rank + me.nproc - 1
    return (
        f"epoch {epoch}: node rank {me.node_rank} of {len(membership.members)}, ranks "
        f"{me.first_rank}-{last} of {membership.world_size}, coordinator "
        f"{membership.coordinator_addr}:{membership.coordinator_port}"
    )
