"""The rule by which an agent of a job with a membership, on a node that does not host the
coordinator, starts its trainers only once the coordinator accepts (agent/supervise/ports.py)."""

from __future__ import annotations

from agent.supervise.ports import (
    COORDINATOR_WAIT_S,
    CoordinatorFirst,
    coordinator_first,
    keep_waiting,
)


def test_it_applies_only_to_a_job_with_a_membership_off_the_coordinators_node() -> None:
    assert coordinator_first(True, node_rank=1, nnodes=2, learned=True)
    assert not coordinator_first(False, node_rank=1, nnodes=2, learned=True)  # no membership
    assert not coordinator_first(True, node_rank=0, nnodes=2, learned=True)  # hosts it
    assert not coordinator_first(True, node_rank=0, nnodes=1, learned=True)  # one node


def test_it_waits_only_once_learned() -> None:
    # The first incarnation, or a trainer that never listens there: no waiting.
    assert not coordinator_first(True, node_rank=1, nnodes=2, learned=False)
    c = CoordinatorFirst(applies=True)
    c.placed(nnodes=3, node_rank=2, addr="10.0.0.1", port=29511)
    assert not c.wanted
    assert c.should_learn(0) and not c.should_learn(1)
    c.learned = True
    assert c.wanted
    c.placed(nnodes=3, node_rank=0, addr="10.0.0.2", port=29512)  # it coordinates now
    assert not c.wanted and not c.should_learn(0)


def test_it_waits_until_the_coordinator_accepts() -> None:
    assert keep_waiting(accepted=False, waited_s=0.0)
    assert keep_waiting(accepted=False, waited_s=COORDINATOR_WAIT_S / 2)
    assert not keep_waiting(accepted=True, waited_s=0.0)


def test_it_gives_up_after_the_limit() -> None:
    assert not keep_waiting(accepted=False, waited_s=COORDINATOR_WAIT_S + 0.01)
    assert not keep_waiting(accepted=False, waited_s=0.6, limit_s=0.5)
