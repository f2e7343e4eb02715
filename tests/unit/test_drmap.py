"""DRMap: unit tests and property tests over random operation sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from marduk.core.drmap import DRMap, ReplicaKey, WorkerKey

W = WorkerKey


def test_lookups_both_ways() -> None:
    m = DRMap()
    m.set_worker(W("j", "r1", 0), ["d1", "d2"])
    m.set_worker(W("j", "r2", 0), ["d2", "d3"])
    assert m.replicas_for_device("d2") == {ReplicaKey("j", "r1"), ReplicaKey("j", "r2")}
    assert m.replicas_for_device("d3") == {ReplicaKey("j", "r2")}
    assert m.replicas_for_device("nope") == frozenset()
    assert m.devices_for_replica(ReplicaKey("j", "r1")) == {"d1", "d2"}
    m.check_invariants()


def test_reregistration_replaces_only_that_worker() -> None:
    m = DRMap()
    m.set_worker(W("j", "r1", 0), ["a", "b"])
    m.set_worker(W("j", "r1", 1), ["c"])
    released = m.set_worker(W("j", "r1", 0), ["a", "z"])
    assert released == {"b"}
    assert m.devices_for_replica(ReplicaKey("j", "r1")) == {"a", "z", "c"}
    assert not m.has_device("b")
    m.check_invariants()


def test_remove_worker_replica_device() -> None:
    m = DRMap()
    m.set_worker(W("j", "r1", 0), ["a", "b"])
    m.set_worker(W("j", "r1", 1), ["b", "c"])
    m.set_worker(W("k", "r1", 0), ["b"])
    assert m.remove_device("b") == {W("j", "r1", 0), W("j", "r1", 1), W("k", "r1", 0)}
    assert m.devices_for_worker(W("k", "r1", 0)) == frozenset()
    assert m.has_worker(W("k", "r1", 0))
    assert m.remove_replica(ReplicaKey("j", "r1")) == {W("j", "r1", 0), W("j", "r1", 1)}
    assert m.remove_worker(W("j", "r1", 0)) == frozenset()  # already gone
    assert list(m.workers()) == [W("k", "r1", 0)]
    m.check_invariants()


def test_same_device_in_two_jobs() -> None:
    m = DRMap()
    m.set_worker(W("a", "r", 0), ["gpu0"])
    m.set_worker(W("b", "r", 0), ["gpu0"])
    assert m.replicas_for_device("gpu0") == {ReplicaKey("a", "r"), ReplicaKey("b", "r")}


def test_snapshot_roundtrip() -> None:
    m = DRMap()
    m.set_worker(W("j", "r1", 0), ["d1", "d2"])
    m.set_worker(W("j", "r2", 3), [])
    restored = DRMap.restore(m.snapshot())
    assert restored == m
    assert restored.snapshot() == m.snapshot()


# --- properties ----------------------------------------------------------------------------------

jobs = st.sampled_from(["j1", "j2"])
replicas = st.sampled_from(["r1", "r2", "r3"])
workers = st.builds(W, jobs, replicas, st.integers(0, 2))
devices = st.sampled_from([f"d{i}" for i in range(8)])
ops = st.one_of(
    st.tuples(st.just("set"), workers, st.frozensets(devices, max_size=5)),
    st.tuples(st.just("remove_worker"), workers),
    st.tuples(st.just("remove_replica"), st.builds(ReplicaKey, jobs, replicas)),
    st.tuples(st.just("remove_device"), devices),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=40))
def test_invariant_and_model_after_every_operation(operations: list[tuple]) -> None:
    """After every operation the seed-001 invariant holds and the map equals a naive model."""
    m = DRMap()
    model: dict[WorkerKey, frozenset[str]] = {}
    for op in operations:
        if op[0] == "set":
            m.set_worker(op[1], op[2])
            model[op[1]] = op[2]
        elif op[0] == "remove_worker":
            m.remove_worker(op[1])
            model.pop(op[1], None)
        elif op[0] == "remove_replica":
            m.remove_replica(op[1])
            model = {k: v for k, v in model.items() if k.replica_key != op[1]}
        else:
            m.remove_device(op[1])
            model = {k: v - {op[1]} for k, v in model.items()}
        m.check_invariants()
        for device in {d for v in model.values() for d in v} | {"d0", "d7"}:
            expected = {k.replica_key for k, v in model.items() if device in v}
            assert m.replicas_for_device(device) == expected
        for key, devs in model.items():
            assert m.devices_for_worker(key) == devs
            assert m.devices_for_replica(key.replica_key) == frozenset().union(
                *(v for k, v in model.items() if k.replica_key == key.replica_key)
            )
        assert set(m.workers()) == set(model)
    assert DRMap.restore(m.snapshot()) == m
