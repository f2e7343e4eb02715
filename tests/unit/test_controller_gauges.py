"""The controller's gauges (marduk/controller/telemetry.py) read from the policy's state: a
real policy, no server."""

from __future__ import annotations

from marduk.controller.telemetry import gauges
from marduk.core.drmap import WorkerKey
from marduk.core.policy import Policy
from tests.unit.test_spares import reg


def values(policy: Policy) -> dict[str, dict[str, float]]:
    return {
        m.name: {s.labels[next(iter(s.labels))]: s.value for s in m.samples if s.labels}
        for m in gauges(True, policy, lambda: 1)
    }


def test_the_gauges_count_live_workers_spares_and_standbys() -> None:
    p = Policy()
    p.register(reg("a"), now=0)
    p.register(reg("b"), now=0)  # MAX 2: the membership forms
    p.register(reg("s", spare=True), now=1)
    p.fleet.stale.add(WorkerKey("j", "b", 0))
    got = values(p)
    assert got["marduk_workers"] == {"live": 2.0, "stale": 1.0}
    assert got["marduk_spares"] == {"j": 1.0}
    assert got["marduk_standbys"] == {"all": 1.0}
    assert got["marduk_devices"]["healthy"] == 3.0


def test_a_standby_shows_only_that_it_does_not_lead() -> None:
    def never() -> int:
        raise AssertionError("a standby's gauges ask nothing of the standbys")

    p = Policy()
    p.register(reg("a"), now=0)
    got = {m.name: [s.value for s in m.samples] for m in gauges(False, p, never)}
    assert got == {"marduk_leader": [0.0]}
