"""The rule by which an agent of a job across nodes, on a node that does not host the
coordinator, starts its trainers only once the coordinator accepts (agent/supervise/ports.py)."""

from __future__ import annotations

from agent.supervise.ports import (
    COORDINATOR_WAIT_S,
    CoordinatorFirst,
    coordinator_first,
    keep_waiting,
)


def test_it_applies_only_to_a_job_across_nodes_off_the_coordinators_node() -> None:
    assert coordinator_first(True, node_rank=1, nnodes=2, learned=True)
    assert not coordinator_first(False, node_rank=1, nnodes=2, learned=True)  # no launch spec
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


def test_it_waits_as_long_as_the_previous_coordinator_is_still_stopping() -> None:
    """Rank 0's agent is still stopping the old coordinator (a trainer that swallows SIGTERM
    gets its grace): the new one cannot listen before it is gone, and a client started
    meanwhile would sit in gRPC's reconnect backoff (1 s, then 1.6 times longer each try)."""
    still_stopping = {"previous_seen_s": 20.0, "stopping_s": 30.0}
    assert keep_waiting(accepted=False, waited_s=21.0, **still_stopping)
    assert keep_waiting(accepted=False, waited_s=20.0 + COORDINATOR_WAIT_S, **still_stopping)
    assert not keep_waiting(accepted=False, waited_s=22.5, **still_stopping)  # gone 2.5 s ago
    assert not keep_waiting(accepted=True, waited_s=21.0, **still_stopping)
    # At most the grace a stop may take, then the usual limit.
    forever = {"previous_seen_s": 100.0, "stopping_s": 30.0}
    assert not keep_waiting(accepted=False, waited_s=30.0 + COORDINATOR_WAIT_S + 0.1, **forever)


def test_it_remembers_the_previous_coordinator_only_where_it_moved() -> None:
    c = CoordinatorFirst(applies=True)  # static ranks: the port moves with the epoch
    c.placed(nnodes=2, node_rank=1, addr="10.0.0.1", port=29500)
    assert c.previous is None  # the first incarnation
    c.placed(nnodes=2, node_rank=1, addr="10.0.0.1", port=29501)
    assert c.previous == ("10.0.0.1", 29500)
    c.placed(nnodes=2, node_rank=1, addr="10.0.0.1", port=29501)  # standalone: no new epoch
    assert c.previous is None


async def test_a_newer_command_ends_the_wait_without_unlearning() -> None:
    c = CoordinatorFirst(applies=True, superseded=lambda: True)  # asked before any probe
    c.placed(nnodes=2, node_rank=1, addr="127.0.0.1", port=29501)
    c.learned = True
    assert not await c.wait()
    assert c.learned  # rank 0 moved on to the newer epoch: its coordinator will listen there
