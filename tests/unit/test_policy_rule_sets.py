"""The policy's parts alone: the Fleet, the Issuer and rule sets built over them with fakes for
what they are handed (marduk/core/policy.py composes them). Pure: time passed in."""

from __future__ import annotations

from marduk.core.decisions import Outcome, event_at
from marduk.core.device_policy import DeviceRules
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.core.grow_policy import GrowRules
from marduk.core.issuer import Issuer
from marduk.core.policy import Policy, PolicyConfig
from marduk.core.records import EpochKey, EpochRecord, GrowRecord
from marduk.core.service_policy import ServiceRules
from marduk.wire.protocol import Command
from tests.unit.test_policy import acceptance_map, failed, reg

R1, R2 = EpochKey("j", "r1"), EpochKey("j", "r2")


class Replacer:
    """A stand-in for ``MembershipRules.issue_or_replace``: records each call, sends nothing
    (as for a job whose only workers on the device are spares)."""

    def __init__(self) -> None:
        self.calls: list[tuple[EpochKey, str, list[str], str]] = []

    def __call__(
        self,
        ekey: EpochKey,
        kind: str,
        reason: str,
        devices: list[str],
        cause: str,
        now: float,
        out: Outcome,
    ) -> Command | None:
        self.calls.append((ekey, kind, devices, cause))
        return None


class Budget:
    """A stand-in for ``MembershipRules.spends_budget``: yes for the scopes named (the real one
    says so only for a job with a membership; tests/unit/test_spares.py), and what it was asked."""

    def __init__(self, *spent: EpochKey) -> None:
        self.spent = set(spent)
        self.asked: list[tuple[EpochKey, str]] = []

    def __call__(self, ekey: EpochKey, device: str, now: float) -> bool:
        self.asked.append((ekey, device))
        return ekey in self.spent


def test_the_issuer_reserves_a_block_ahead_only_past_the_ceiling() -> None:
    p = Policy(PolicyConfig(epoch_block=2))
    p.register(reg("r1", ["d1"]), now=0)  # reserves epochs up to 2
    issuer = Issuer(p.fleet)
    epochs, ahead = [], []
    for t in range(3):
        out = Outcome()
        epochs.append(issuer.issue(R1, "restart", "why", [], "", now=t, out=out).epoch)
        ahead.append([r.ceiling for r in out.write_ahead])
        assert out.put_epochs == ([] if out.write_ahead else [p.epochs[R1]])
    assert epochs == [1, 2, 3]
    assert ahead == [[], [], [4]]  # epoch 3 is past 2: the next block (3, 4) first


def test_the_issuer_awaits_only_live_workers_and_a_checkpoint_nobody() -> None:
    p = Policy(PolicyConfig(pending_timeout_s=10))
    p.register(reg("r1", ["d1"]), now=0)
    p.register(reg("r1", ["d2"], worker=1, pid=2), now=0)
    p.fleet.stale.add(WorkerKey("j", "r1", 1))
    issuer = Issuer(p.fleet)
    issuer.issue(R1, "restart", "why", [], "", now=5, out=Outcome())
    assert p.awaiting(R1) == {WorkerKey("j", "r1", 0)}
    assert issuer.pending(R1, now=14) and not issuer.pending(R1, now=15)
    issuer.issue(R1, "checkpoint", "save", [], "", now=6, out=Outcome(), pending=False)
    assert not p.awaiting(R1) and not issuer.pending(R1, now=6)


def test_removing_a_worker_vacates_its_scope_and_forgets_devices_nobody_uses() -> None:
    p = acceptance_map()  # r1 on d1, d2; r2 on d2, d3
    p.on_health(failed("d1", "e1"), now=1)  # d1 has a record; r1 awaits its restart
    out = Outcome()
    key = WorkerKey("j", "r1", 0)
    assert p.fleet.remove_worker(key, out, now=2)
    assert out.deleted_workers == [key] and out.deleted_devices == ["d1"]  # d2: r2 uses it
    assert not p.awaiting(R1) and key not in p.last_seen
    assert p.fleet.scopes.vacant_for(0, now=2) == [R1]
    assert not p.fleet.remove_worker(key, Outcome(), now=3)


def test_service_rules_fail_each_scope_through_what_they_are_handed() -> None:
    p = acceptance_map()
    replace = Replacer()
    result = ServiceRules(p.fleet, replace).drain(["d2"], "", False, "bad link", now=5)
    assert replace.calls == [(R1, "fail", ["d2"], "drain:d2"), (R2, "fail", ["d2"], "drain:d2")]
    # Nothing sent for a scope the replacement spared: no action, no *_issued event.
    assert result.actions == [] and not result.outcome.commands
    assert [e.kind for e in result.outcome.events] == ["device_drained"]
    assert p.devices["d2"].drained


def test_device_rules_restart_through_the_membership_and_remember_the_event() -> None:
    p = acceptance_map()
    replace = Replacer()
    rules = DeviceRules(p.fleet, Issuer(p.fleet), ServiceRules(p.fleet, replace), replace, Budget())
    result = rules.on_health(failed("d1", "e1"), now=1)
    assert replace.calls == [(R1, "restart", ["d1"], "e1")]
    assert result.reply.actions == [] and not result.outcome.commands
    assert result.outcome.handled == [result.reply] and p.devices["d1"].state == "failed"
    assert rules.on_health(failed("d1", "e1"), now=2).reply.duplicate


def test_abandoning_a_grow_clears_it_and_writes_its_record_once() -> None:
    fleet = Fleet(PolicyConfig())
    grow = GrowRules(fleet, Issuer(fleet))
    state = EpochRecord(job="j", replica=None, epoch=4, grow=GrowRecord(epoch=4, started_at=0))
    grow.confirmed["j"] = {WorkerKey("j", "a", 0)}
    out = Outcome()
    grow.abandon(EpochKey("j", None), state, "superseded", now=9, out=out)
    grow.abandon(EpochKey("j", None), state, "again", now=9, out=out)
    assert state.grow is None and "j" not in grow.confirmed
    assert out.put_epochs == [state]
    event = out.events[0]
    assert (event.kind, event.job, event.replica, event.epoch) == ("grow_abandoned", "j", None, 4)


def test_event_at_names_a_worker_or_a_scope() -> None:
    worker = event_at(WorkerKey("j", "r", 2), "worker_stale", 5.0, detail="silent")
    assert (worker.job, worker.replica, worker.worker, worker.ts) == ("j", "r", 2, 5.0)
    job = event_at(EpochKey("j", None), "job_held", 6.0, epoch=3)
    assert (job.job, job.replica, job.worker, job.epoch) == ("j", None, None, 3)
    assert event_at(R1, "restart_issued", 7.0, worker=1).worker == 1
    registration = event_at(reg("r1", [], worker=3), "registered", 8.0)
    assert (registration.replica, registration.worker) == ("r1", 3)


def test_device_rules_ask_whether_a_failure_spends_its_budget_before_merging_it() -> None:
    """A failure of a scope with a restart in flight joins it, unless what the rules are handed
    says it spends its device's budget: then it takes a new epoch (the membership's to decide
    which); a scope with nothing in flight takes one without asking."""
    actions = []
    for budget in (Budget(), Budget(R1)):
        p = acceptance_map()  # r1 on d1, d2; r2 on d2, d3
        issuer = Issuer(p.fleet)
        rules = DeviceRules(
            p.fleet, issuer, ServiceRules(p.fleet, issuer.issue), issuer.issue, budget
        )
        rules.on_health(failed("d1", "e1"), now=1)  # r1's restart at epoch 1 is in flight
        reply = rules.on_health(failed("d2", "e2"), now=2).reply
        actions.append([(a.replica, a.epoch, a.coalesced) for a in reply.actions])
        assert budget.asked == [(R1, "d2")]
    assert actions == [
        [("r1", 1, True), ("r2", 1, False)],  # merged into r1's restart in flight
        [("r1", 2, False), ("r2", 1, False)],  # its budget spent: a new epoch for r1
    ]
