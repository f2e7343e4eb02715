"""``peer_failed`` notices, pure: which replicas the policy tells when others fail, and what the
agent's inbox delivers (outside the epochs; a repeat or replay dropped)."""

from __future__ import annotations

import msgspec

from agent.library.client import Command, CommandInbox, Options
from marduk.core.policy import Policy, PolicyConfig
from marduk.wire import protocol as wire
from marduk.wire.protocol import DeviceHealth, Registration, Report


def reg(replica: str, device: str, *, notices: bool = True, job: str = "j", pid: int = 1):
    return Registration(
        job=job, replica=replica, host="h", devices=[device], pid=pid, peer_notices=notices
    )


def failed(device: str, event_id: str) -> DeviceHealth:
    return DeviceHealth(device=device, state="failed", event_id=event_id)


def three_groups(notices: bool = True) -> Policy:
    p = Policy()
    for i in (1, 2, 3):
        p.register(reg(f"g{i}", f"d{i}", notices=notices, pid=i), now=0)
    return p


def notices_of(outcome) -> dict[str, list[tuple[str, int, str]]]:
    return {n.replica: [(q.replica, q.epoch, q.kind) for q in n.peers] for n in outcome.notices}


def test_a_restart_tells_the_other_replicas_that_asked_and_not_the_failed_one() -> None:
    p = three_groups()
    out = p.on_health(failed("d2", "e1"), now=1).outcome
    assert [(c.replica, c.kind, c.epoch) for c in out.commands] == [("g2", "restart", 1)]
    assert notices_of(out) == {"g1": [("g2", 1, "restart")], "g3": [("g2", 1, "restart")]}
    for n in out.notices:
        assert (n.kind, n.scope, n.epoch, n.job) == ("peer_failed", "replica", 0, "j")
        assert n.peers[0].devices == ["d2"] and "d2" in n.reason


def test_a_notice_moves_no_epoch_and_is_not_pending() -> None:
    p = three_groups()
    p.on_health(failed("d2", "e1"), now=1)
    assert [p.epoch_of_worker(k) for k in sorted(p.workers)] == [0, 1, 0]
    # Only g2's restart is resent until confirmed; the notices never are.
    out = p.tick(2.5)
    assert [c.replica for c in out.resent] == ["g2"] and not out.notices


def test_plain_jobs_get_no_notices() -> None:
    p = three_groups(notices=False)
    out = p.on_health(failed("d2", "e1"), now=1).outcome
    assert out.commands and not out.notices


def test_only_the_replicas_that_asked_are_told() -> None:
    p = Policy()
    p.register(reg("g1", "d1", notices=True), now=0)
    p.register(reg("g2", "d2", notices=False, pid=2), now=0)
    p.register(reg("g3", "d3", notices=False, pid=3), now=0)
    out = p.on_health(failed("d3", "e1"), now=1).outcome
    assert list(notices_of(out)) == ["g1"]
    out = p.on_health(failed("d1", "e2"), now=2).outcome  # the one that asked fails: nobody
    assert not out.notices


def test_a_failure_of_two_replicas_names_both_and_tells_neither() -> None:
    p = Policy()
    p.register(reg("g1", "shared"), now=0)
    p.register(reg("g2", "shared", pid=2), now=0)
    p.register(reg("g3", "d3", pid=3), now=0)
    out = p.on_health(failed("shared", "e1"), now=1).outcome
    assert notices_of(out) == {"g3": [("g1", 1, "restart"), ("g2", 1, "restart")]}


def test_a_fail_and_a_crash_report_are_noticed_too() -> None:
    p = Policy(PolicyConfig(device_max_failures=0))
    for i in (1, 2):
        p.register(reg(f"g{i}", f"d{i}", pid=i), now=0)
    out = p.on_health(failed("d2", "e1"), now=1).outcome
    assert notices_of(out) == {"g1": [("g2", 1, "fail")]}
    report = Report(job="j", replica="g1", status="crashed", epoch=0)
    out = p.on_report(report, now=2).outcome
    assert notices_of(out) == {"g2": [("g1", 1, "restart")]}


def test_a_coalesced_failure_sends_no_second_notice() -> None:
    p = three_groups()
    p.on_health(failed("d2", "e1"), now=1)
    out = p.on_health(failed("d2", "e2"), now=1.1).outcome  # the same restart in flight
    assert not out.commands and not out.notices


def test_a_stale_or_removed_replica_is_not_told() -> None:
    p = three_groups()
    p.deregister(next(k for k in p.workers if k.replica == "g3"), "gone", now=1)
    out = p.on_health(failed("d2", "e1"), now=2).outcome
    assert list(notices_of(out)) == ["g1"]


def test_old_peers_decode_the_new_messages_and_new_ones_the_old() -> None:
    p = three_groups()
    notice = p.on_health(failed("d2", "e1"), now=1).outcome.notices[0]
    data = msgspec.json.encode(notice)
    assert wire.decode(data, wire.Command).peers == notice.peers
    old = msgspec.json.encode(
        {"type": "register", "v": 1, "job": "j", "replica": "r", "devices": []}
    )
    assert wire.decode(old, wire.Registration).peer_notices is False


# --- the agent's side ---------------------------------------------------------------------------


def inbox(*, notices: bool = True, epoch: int = 0) -> tuple[CommandInbox, list[Command]]:
    got: list[Command] = []
    opts = Options(
        job="j", replica="g1", worker=0, devices=["d1"], addr="", prefix="marduk",
        scope="replica", timeout=1, incarnation=0, epoch=epoch, peer_notices=notices,
    )  # fmt: skip
    return CommandInbox(opts, None, got.append), got


def notice(*peers: tuple[str, int]) -> wire.Command:
    return wire.Command(
        command_id="n",
        job="j",
        replica="g1",
        kind="peer_failed",
        epoch=0,
        peers=[wire.PeerFailure(replica=r, epoch=e) for r, e in peers],
    )


def restart(epoch: int) -> wire.Command:
    return wire.Command(command_id=f"c{epoch}", job="j", replica="g1", kind="restart", epoch=epoch)


def test_a_notice_is_delivered_without_touching_the_epochs() -> None:
    box, got = inbox(epoch=3)
    box._accept(notice(("g2", 7)))
    assert [(c.kind, c.epoch, [p.replica for p in c.peers]) for c in got] == [
        ("peer_failed", 0, ["g2"])
    ]
    assert got[0].is_notice and not got[0].is_failure
    assert not box.failed and box.epoch == 3 and box.fence.acked == 3
    # Our own restart at epoch 4 is still news, and one at 3 still stale.
    box._accept(restart(3))
    box._accept(restart(4))
    assert [c.epoch for c in got[1:]] == [4]


def test_a_notice_above_our_epoch_does_not_fence_out_our_restart() -> None:
    box, got = inbox()
    box._accept(notice(("g2", 500)))
    box._accept(restart(1))
    assert [c.kind for c in got] == ["peer_failed", "restart"] and box.failed


def test_a_repeat_or_replay_of_a_notice_is_dropped() -> None:
    box, got = inbox()
    box._accept(notice(("g2", 2)))
    box._accept(notice(("g2", 2)))  # repeated
    box._accept(notice(("g2", 1)))  # an older one, replayed
    assert len(got) == 1 and box.stats["dropped_notices.seen"] == 2
    box._accept(notice(("g2", 2), ("g3", 1)))  # only g3 is news
    box._accept(notice(("g2", 3)))  # g2 failed again
    assert [[(p.replica, p.epoch) for p in c.peers] for c in got[1:]] == [[("g3", 1)], [("g2", 3)]]


def test_a_notice_about_ourselves_or_unasked_is_dropped() -> None:
    box, got = inbox()
    box._accept(notice(("g1", 4)))
    assert not got and box.epoch == 0
    box, got = inbox(notices=False)
    box._accept(notice(("g2", 4)))
    assert not got and box.stats["dropped_notices.unasked"] == 1


def test_a_command_round_trips_its_peers() -> None:
    box, got = inbox()
    box._accept(notice(("g2", 2)))
    wired = got[0].to_wire()
    assert wired.kind == "peer_failed" and [(p.replica, p.epoch) for p in wired.peers] == [
        ("g2", 2)
    ]


def test_a_replica_that_registers_again_is_told_as_its_last_registration_asked() -> None:
    p = three_groups()
    p.register(reg("g3", "d3", notices=False, pid=3), now=1)  # asks no more
    p.register(reg("g4", "d4", notices=False, pid=4), now=1)
    p.register(reg("g4", "d4", notices=True, pid=4), now=1)  # asks now
    out = p.on_health(failed("d2", "e1"), now=2).outcome
    assert sorted(notices_of(out)) == ["g1", "g4"]


def test_the_replicas_told_are_those_a_scan_of_every_worker_finds() -> None:
    """``Fleet.notice_replicas`` keeps an index of the workers that asked, not a scan of the
    job's workers on every restart: after any mix of registrations, registrations again with
    and without asking, deregistrations and workers going stale, it names the same replicas."""
    import random

    rng = random.Random(7)
    p = Policy()
    for step in range(600):
        job = rng.choice(["j", "k"])
        replica, worker = f"g{rng.randrange(12)}", rng.randrange(2)
        keys = [k for k in p.workers if k.job == job]
        roll = rng.random()
        if roll < 0.6 or not keys:
            registration = reg(replica, f"{job}-{replica}-{worker}", job=job, pid=worker + 1)
            registration.worker = worker
            registration.peer_notices = rng.random() < 0.5
            p.register(registration, now=step)
        elif roll < 0.8:
            p.deregister(rng.choice(keys), "gone", now=step)
        else:
            p.fleet.stale.add(rng.choice(keys))
        for j in ("j", "k"):
            scanned = {
                k.replica
                for k, rec in p.workers.items()
                if k.job == j and k not in p.fleet.stale and rec.registration.peer_notices
            }
            assert p.fleet.notice_replicas(j) == scanned, step
