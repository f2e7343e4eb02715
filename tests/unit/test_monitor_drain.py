"""What ``marduk monitor drain`` says a drain did, pure: the controller's ``members_out`` (from
the memberships before and the restart's command and events) and the lines the CLI prints."""

from __future__ import annotations

from marduk.controller.handlers import members_out
from marduk.core.decisions import Outcome
from marduk.wire.protocol import (
    Action,
    Command,
    ControllerEvent,
    DrainReply,
    Member,
    MemberOut,
    Membership,
    WorkerRef,
)
from monitor_cli.admin_cli import drain_lines


def membership(epoch: int, *names: str) -> Membership:
    members = [
        Member(replica=n, node_rank=i, first_rank=2 * i, nproc=2) for i, n in enumerate(names)
    ]
    return Membership(
        epoch=epoch,
        world_size=2 * len(names),
        coordinator_addr="10.0.0.1",
        coordinator_port=29500,
        members=members,
    )


def restart(epoch: int, m: Membership | None) -> Command:
    return Command(
        command_id="c", job="lin", scope="job", kind="restart", epoch=epoch, membership=m
    )


def test_a_swap_and_a_drop_in_one_restart_renumber_the_node_ranks() -> None:
    # a, b, c, d at node ranks 0-3; b and c drained; spare s takes c's ranks, b is dropped:
    # the kept order a, s (c's place), d renumbers to 0, 1, 2.
    new = membership(5, "a", "s", "d")
    out = Outcome(
        commands=[restart(5, new)],
        events=[ControllerEvent(kind="member_replaced", ts=0, job="lin", replica="c", worker=0)],
    )
    found = members_out({"lin": membership(4, "a", "b", "c", "d")}, out)
    assert [(m.member.replica, m.node_rank, m.spare) for m in found] == [
        ("b", 1, None),
        ("c", 2, WorkerRef(replica="s")),
    ]
    assert found[1].spare_node_rank == 1 and (found[1].nodes, found[1].world_size) == (3, 6)
    # A job with no membership before (forming), or a replica's command: nothing to say.
    assert members_out({}, out) == []


def test_drain_lines_say_the_swap_and_fall_back_to_the_command_sent() -> None:
    reply = DrainReply(
        devices=["lin-d2", "d7"],
        actions=[
            Action(job="lin", replica=None, kind="restart", epoch=3),
            Action(job="other", replica="r1", kind="fail", epoch=9),
        ],
        members_out=[
            MemberOut(
                job="lin",
                member=WorkerRef(replica="node1"),
                node_rank=1,
                epoch=3,
                spare=WorkerRef(replica="node2"),
                spare_node_rank=1,
                nodes=2,
                world_size=4,
            )
        ],
    )
    assert drain_lines(reply) == [
        "  node1/0 (node rank 1) retired (exits 71); spare node2/0 takes node rank 1",
        "  job lin restarts at epoch 3 with 2 nodes (world size 4)",
        "  fail sent to other/r1 (epoch 9)",
    ]
    # An older controller's reply has no members_out: the command as it is, not "fail".
    reply.members_out = []
    assert drain_lines(reply)[0] == "  restart sent to lin/(whole job) (epoch 3)"
