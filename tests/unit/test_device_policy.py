"""Flap damping, quarantine, drain and host storms, pure: time passed in."""

from __future__ import annotations

from marduk.core.drmap import WorkerKey
from marduk.core.policy import Policy, PolicyConfig
from tests.unit.test_policy import failed, reg


def two_replicas(**config: object) -> Policy:
    p = Policy(PolicyConfig(**config))  # type: ignore[arg-type]
    p.register(reg("r1", ["d1", "d2"]), now=0)
    p.register(reg("r2", ["d2", "d3"], pid=2), now=0)
    return p


def test_a_flapping_device_is_quarantined_even_though_healthy_clears_its_budget() -> None:
    p = two_replicas(flap_limit=2, flap_window_s=100, device_max_failures=10)
    kinds = []
    for i in range(3):
        r = p.on_health(failed("d3", f"f{i}"), now=10 * i + 1)
        kinds.append([c.kind for c in r.outcome.commands])
        p.ack(("j", "r2", 0), p.epoch_of(("j", "r2")), now=10 * i + 2)  # type: ignore[arg-type]
        p.on_health(failed("d3", f"h{i}", state="healthy"), now=10 * i + 3)
    # Two flips are within the limit; the third quarantines: r2 gets fail, not a third restart.
    assert kinds == [["restart"], ["restart"], ["fail"]]
    rec = p.devices["d3"]
    assert rec.quarantined and "flapping" in rec.out_reason and rec.state == "healthy"
    # Out of service: further failures send nothing; status shows it.
    assert not p.on_health(failed("d3", "f9"), now=40).outcome.commands
    [info] = [d for d in p.device_infos() if d.device == "d3"]
    assert info.quarantined and not info.drained


def test_flips_outside_the_window_do_not_count() -> None:
    p = two_replicas(flap_limit=1, flap_window_s=10, device_max_failures=10)
    for i, t in enumerate((0, 20, 40, 60)):
        p.on_health(failed("d1", f"f{i}"), now=t + 1)
        p.ack(("j", "r1", 0), p.epoch_of(("j", "r1")), now=t + 2)  # type: ignore[arg-type]
        p.on_health(failed("d1", f"h{i}", state="healthy"), now=t + 3)
    assert not p.devices["d1"].quarantined


def test_drain_fails_every_scope_on_the_device_and_undrain_brings_it_back() -> None:
    p = two_replicas()
    r = p.drain(["d2"], host="", undrain=False, reason="suspect NVLink", now=5)
    assert r.devices == ["d2"]
    assert sorted((c.replica, c.kind) for c in r.outcome.commands) == [
        ("r1", "fail"),
        ("r2", "fail"),
    ]
    assert all(c.devices == ["d2"] for c in r.outcome.commands)
    assert p.devices["d2"].drained and "suspect NVLink" in p.devices["d2"].out_reason
    assert not p.drain(["d2"], host="", undrain=False, reason="", now=6).outcome.commands  # idem
    # A worker registering with it is told so.
    assert p.register(reg("r3", ["d2", "d9"], pid=3), now=7).unusable == ["d2"]
    # Kept while out of service, even when nobody uses it any more.
    for replica in ("r1", "r2", "r3"):
        p.deregister(WorkerKey("j", replica, 0), "gone", now=8)
    assert "d2" in p.devices
    u = p.drain(["d2"], host="", undrain=True, reason="", now=9)
    assert u.devices == ["d2"] and not u.outcome.commands and not p.devices["d2"].drained
    assert p.register(reg("r3", ["d2"], pid=3), now=10).unusable == []


def test_drain_a_host_takes_every_device_registered_from_it() -> None:
    p = Policy()
    p.register(reg("r1", ["a0", "a1"]), now=0)  # host "h" (the reg helper's)
    other = reg("r2", ["b0"], pid=2)
    other.host = "elsewhere"
    p.register(other, now=0)
    r = p.drain([], host="h", undrain=False, reason="", now=1)
    assert r.devices == ["a0", "a1"] and [c.replica for c in r.outcome.commands] == ["r1"]
    assert not p.devices.get("b0")


def test_a_storm_from_one_host_yields_one_restart_per_scope() -> None:
    """All 8 devices of a host fail at once: each scope gets one new epoch; the other failures
    are merged into it (same epoch), so messages per scope stay bounded by its devices."""
    p = Policy()
    host = [f"g{i}" for i in range(8)]
    p.register(reg("r1", host[:4]), now=0)
    p.register(reg("r2", host[4:], pid=2), now=0)
    new, resent = [], []
    for i, d in enumerate(host):
        r = p.on_health(failed(d, f"e{i}"), now=1)
        new += [(c.replica, c.epoch) for c in r.outcome.commands]
        resent += [(c.replica, c.epoch) for c in r.outcome.resent]
    assert new == [("r1", 1), ("r2", 1)]
    assert len(resent) == 6 and {e for _, e in resent} == {1}
    assert p.epochs[("j", "r1")].command.devices == host[:4]  # type: ignore[index,union-attr]


def test_preempting_asks_each_scope_on_the_host_to_checkpoint_once_and_holds_nothing() -> None:
    p = two_replicas()
    r = p.on_health(failed("d2", "p1", state="preempting"), now=1)
    assert sorted((c.replica, c.kind) for c in r.outcome.commands) == [
        ("r1", "checkpoint"),
        ("r2", "checkpoint"),
    ]
    # Every device of the host gets the notice: one checkpoint per scope, the rest coalesced.
    r = p.on_health(failed("d1", "p2", state="preempting"), now=2)
    assert not r.outcome.commands and all(a.coalesced for a in r.reply.actions)
    # Nothing is held pending, not even after agents re-register having seen but not applied
    # the checkpoint's epoch: a real failure still restarts at once.
    p.register(reg("r1", ["d1", "d2"]), now=3)
    r = p.on_health(failed("d1", "f1"), now=4)
    assert [(c.replica, c.kind, c.epoch) for c in r.outcome.commands] == [("r1", "restart", 2)]


def test_a_device_another_job_holds_on_another_host_cannot_be_claimed_until_it_is_free() -> None:
    import pytest

    from marduk.core.decisions import PolicyError

    p = Policy(PolicyConfig(worker_ttl_s=15, exclusive_devices=True))
    p.register(reg("b1", ["dB"], job="B"), now=0)  # host "h"
    evil = reg("a1", ["dA", "dB"], job="A", pid=2)
    evil.host = "attacker"
    with pytest.raises(PolicyError, match="device dB is held by worker B/b1/0 on h") as e:
        p.register(evil, now=1)
    assert e.value.code == "device_claimed" and WorkerKey("A", "a1", 0) not in p.workers
    # Another job on the same host may (jobs sharing a node's device); so may the same job on
    # another host (a replica moving).
    p.register(reg("c1", ["dB"], job="C", pid=3), now=1)
    moved = reg("b2", ["dA"], job="A", pid=4)
    moved.host = "other"
    p.register(moved, now=1)
    # Holders silent for the TTL no longer hold it.
    p.register(reg("c1", ["dB"], job="C", pid=3), now=20)  # renews; b1 went silent
    with pytest.raises(PolicyError, match="held by worker C/c1/0 on h"):
        p.register(evil, now=20)
    assert p.register(evil, now=40).result == "new"


def test_drain_by_host_leaves_devices_another_host_claims_and_says_so() -> None:
    p = Policy()
    p.register(reg("r1", ["a0", "shared"]), now=0)  # host "h"
    other = reg("r2", ["shared"], pid=2)
    other.host = "elsewhere"
    p.register(other, now=0)
    r = p.drain([], host="h", undrain=False, reason="", now=1)
    assert r.devices == ["a0"] and [c.replica for c in r.outcome.commands] == ["r1"]
    assert r.conflicts == [
        "shared: also claimed by j/r2/0 on elsewhere; not drained by host (name it to drain it)"
    ]
    # Named, it is drained: the operator decided.
    assert p.drain(["shared"], host="", undrain=False, reason="", now=2).devices == ["shared"]


def test_without_exclusive_devices_jobs_on_different_hosts_share_a_device() -> None:
    """Kubernetes: the agent's host is its pod's name, so two pods of different jobs
    time-slicing one GPU look like two hosts; without auth no claim can be trusted anyway."""
    p = Policy(PolicyConfig(worker_ttl_s=15))
    p.register(reg("b1", ["dB"], job="B"), now=0)
    pod = reg("a1", ["dB"], job="A", pid=2)
    pod.host = "podA"
    assert p.register(pod, now=1).result == "new"
