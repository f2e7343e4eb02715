"""torchft under Marduk, end to end: a real controller, torchft's real lighthouse, three real
replica groups (examples/torchft_ddp.py, gloo on CPU), each under ``marduk agent run``.

A device failure of one group: the controller restarts that group only; the other two keep
committing steps; the restarted group rejoins the quorum and heals from a peer (its step and
weights equal the others'). Then a trainer crash of another group: the same, through the agent.
The leader controller SIGKILLed mid-way: torchft never notices (Marduk is not on its data
path), no group restarts, and the standby that takes over restarts the next failed group.
And a standalone group (no agent): the command makes the Manager abandon its step and the
process exit with ``RESTART_EXIT``. Figures are printed, never asserted (``pytest -s``).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.torchft import lighthouse_command
from tests.conftest import NatsServer, eventually_sync, free_port
from tests.processes import Proc, agent_run, controller, external_controller, inject, status

pytestmark = pytest.mark.e2e

if os.environ.get("CI"):
    import torchft  # noqa: F401  # in the dev extra: missing in CI is a failure, not a skip
else:
    pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[dev]'")

JOB = "ft"
COMMITTED = re.compile(r"^step (\d+) committed weights (\w+) loss \S+ groups (\d+) t ([0-9.]+)")


@dataclass(frozen=True)
class Commit:
    incarnation: int  # 0: the first trainer of this group, 1: the one after a restart, ...
    step: int
    weights: str
    groups: int
    t: float


def commits(p: Proc) -> list[Commit]:
    out, incarnation = [], -1
    for line in list(p.all):
        if " joining at step " in line:
            incarnation += 1
        m = COMMITTED.match(line)
        if m:
            step, weights, groups, t = m.groups()
            out.append(Commit(incarnation, int(step), weights, int(groups), float(t)))
    return out


def until(what: str, check: Callable[[], bool], procs: list[Proc], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            tails = "\n".join("".join(p.all[-15:]) for p in procs)
            raise AssertionError(f"{what}: not within {timeout:g}s; output tails:\n{tails}")
        time.sleep(0.1)


def trainer_args(lighthouse: str) -> list[str]:
    return [
        sys.executable,
        "examples/torchft_ddp.py",
        *("--lighthouse", lighthouse, "--step-seconds", "0.1"),
    ]


@pytest.fixture
def ft_env(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {**env, "RUST_LOG": "warn", "OMP_NUM_THREADS": "1"}


def lighthouse(env: dict[str, str], min_replicas: int) -> tuple[Proc, str]:
    """torchft's lighthouse as the README runs it under Marduk (``LIGHTHOUSE_FLAGS``)."""
    port = free_port()
    binary = str(Path(sys.executable).parent / "torchft_lighthouse")
    args = lighthouse_command(min_replicas, f"127.0.0.1:{port}", binary=binary)
    return Proc(args, {**env, "RUST_LOG": "info"}), f"http://127.0.0.1:{port}"


def group(
    env: dict[str, str],
    replica: str,
    lighthouse_addr: str,
    trainer: str = "examples/torchft_ddp.py",
) -> Proc:
    return agent_run(
        env,
        *("--job", JOB, "--replica", replica, "--devices", f"{JOB}-{replica}-d0"),
        *("--preload", "torch,torchft", "--grace", "5", "--startup-timeout", "120"),
        cmd=[sys.executable, trainer, *trainer_args(lighthouse_addr)[2:]],
    )


def healed_and_equal(g: Proc, others: list[Proc], incarnation: int) -> Commit | None:
    """The first step the new incarnation committed, once another group committed it too,
    with the same weights as every group that did; None until then. (A healthy group that
    asks for that quorum late may be left out of it and heal past the step.)"""
    mine = [c for c in commits(g) if c.incarnation == incarnation]
    if not mine:
        return None
    first = mine[0]
    seen = False
    for o in others:
        theirs = [c for c in commits(o) if c.step == first.step]
        if theirs:
            assert theirs[-1].weights == first.weights, (first, theirs[-1])
            seen = True
    return first if seen else None


def in_one_quorum(groups: list[Proc], every: list[Proc]) -> None:
    """Wait (90 s at most) for every group to have committed a step with all of them."""
    n = len(groups)
    until(
        f"all {n} groups commit in one quorum",
        lambda: all(any(c.groups == n for c in commits(g)) for g in groups),
        every,
        timeout=90,
    )


def survivors_kept_committing(healthy: list[Proc], since: float, steps: int) -> bool:
    return all(sum(c.t > since for c in commits(h)) >= steps for h in healthy)


def report(what: str, t0: float, back: Commit, healthy: list[Proc]) -> None:
    """Print the healthy groups' longest wait between two committed steps from the step before
    the fault until the failed group committed again, and when that was."""
    for h in healthy:
        ts = [c.t for c in commits(h)]
        window = [t for t in ts if t <= t0][-1:] + [t for t in ts if t0 < t <= back.t + 1]
        gap = max(b - a for a, b in itertools.pairwise(window))
        print(f"{what}: a healthy group's longest gap between committed steps {gap * 1000:.0f} ms")
    print(
        f"{what}: the group committed again, healed at step {back.step}, "
        f"{(back.t - t0) * 1000:.0f} ms after the fault"
    )


def heals(what: str, failed: Proc, healthy: list[Proc], t0: float, every: list[Proc]) -> None:
    """The failed group's next incarnation commits at the others' step with their weights (no
    checkpoint exists: only a peer can have given it that step), and the healthy groups went on
    committing meanwhile."""
    until(
        f"{what}: the group heals to the others' step and weights",
        lambda: healed_and_equal(failed, healthy, incarnation=1) is not None,
        every,
    )
    until(
        f"{what}: the others keep committing",
        lambda: survivors_kept_committing(healthy, t0, 10),
        every,
    )
    back = healed_and_equal(failed, healthy, incarnation=1)
    assert back is not None
    before = max(c.step for c in commits(failed) if c.incarnation == 0)
    assert back.step > before, (back, before)
    report(what, t0, back, healthy)


def test_device_failure_and_crash_cost_the_healthy_groups_no_restart(
    ft_env: dict[str, str],
) -> None:
    env = ft_env
    t_start = time.monotonic()
    ctl = controller(env)
    lh, addr = lighthouse(env, min_replicas=2)
    groups = {r: group(env, r, addr) for r in ("g1", "g2", "g3")}
    g1, g2, g3 = groups["g1"], groups["g2"], groups["g3"]
    every = [*groups.values(), lh]
    try:
        in_one_quorum(list(groups.values()), every)
        print(f"three groups training after {time.monotonic() - t_start:.1f} s")

        # A device of g2 fails: g2 only is restarted, heals, and the others never stop.
        t0 = time.time()
        out = inject(env, f"{JOB}-g2-d0")
        assert "g2" in out, out
        g2.expect("stopping the trainer", timeout=10)
        # The healthy groups are told at once (a notice, not a restart) and abandon the step
        # in flight if g2 was in their last quorum.
        for h in (g1, g3):
            line = h.expect("marduk: peer_failed: g2 restart at epoch 1", timeout=10)
            assert any(w in line for w in ("abandoning", "last quorum", "quorum is forming")), line
            print(f"a healthy group: {line.strip()}")
        assert not any("peer_failed" in ln for ln in g2.all)  # not told about itself
        heals("device failure", g2, [g1, g3], t0, every)

        # g3's trainer crashes (SIGKILL): its agent restarts it; it heals the same way.
        pid = int(next(ln for ln in reversed(g3.all) if " joining at step " in ln).split()[3])
        t1 = time.time()
        os.kill(pid, signal.SIGKILL)
        g3.expect("trainer crashed", timeout=10)
        # g3 is gone already when the others hear of it (its crash report restarts it): the
        # notice must cost them no restart, and they keep committing (heals).
        for h in (g1, g2):
            print(f"a healthy group: {h.expect('marduk: peer_failed: g3 restart', 10).strip()}")
        heals("trainer crash", g3, [g1, g2], t1, every)

        # Exactly one restart each for g2 and g3; none for g1.
        starts = {r: sum(" joining at step " in ln for ln in g.all) for r, g in groups.items()}
        assert starts == {"g1": 1, "g2": 2, "g3": 2}, starts
        print(f"wall time {time.monotonic() - t_start:.1f} s")
    finally:
        for p in groups.values():
            p.stop()
        lh.stop()
        ctl.stop()


def test_a_quorum_issued_with_a_group_just_before_it_dies_costs_no_configure_timeout(
    ft_env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 19, made certain (tests/trainers/torchft_race.py): the lighthouse answers a quorum
    with g3, g3's trainer is SIGKILLed right after, and g1 and g2 hold that answer 2 s, so the
    notice comes while their quorum call is in flight and the answer still holds g3's dead
    incarnation. They refuse it instead of configuring a process group with it (which waited
    the trainers' 10 s torchft timeout for g3's store key): the healthy groups' gap is about
    the hold, not hold + timeout; g3 heals as after any crash."""
    hold = 2.0
    env = {
        **ft_env,
        "MARDUK_TEST_RACE_STEP": "30",
        "MARDUK_TEST_RACE_DIES": "g3",
        "MARDUK_TEST_RACE_DELAY": str(hold),
        "MARDUK_TEST_RACE_DIR": str(tmp_path),
    }
    ctl = controller(env)
    lh, addr = lighthouse(env, min_replicas=2)
    groups = {r: group(env, r, addr, "tests/trainers/torchft_race.py") for r in ("g1", "g2", "g3")}
    g1, g2, g3 = groups["g1"], groups["g2"], groups["g3"]
    every = [*groups.values(), lh]
    try:
        line = g3.expect("race: dying after quorum", timeout=120)
        t0 = time.time()
        quorum = line.split("race: dying after quorum ", 1)[1].split()[0]
        g3.expect("trainer crashed", timeout=10)
        for h in (g1, g2):
            h.expect(f"race: holding quorum {quorum}", timeout=10)
            told = h.expect("marduk: peer_failed: g3 restart", timeout=10)
            assert (
                "the next quorum is forming" in told
                and "refused if the next quorum includes g3:" in told
            )
            refused = h.expect(f"marduk: quorum {quorum} includes g3:", timeout=10)
            print(f"a healthy group: {refused.strip()}")
        heals("quorum with a dying group", g3, [g1, g2], t0, every)
        for h in (g1, g2):
            after = [c.t for c in commits(h) if c.t > t0]
            before = [c.t for c in commits(h) if c.t <= t0]
            gap = after[0] - before[-1]
            assert gap < hold + 5, gap  # hold + 10 s with the configure timeout
        starts = {r: sum(" joining at step " in ln for ln in g.all) for r, g in groups.items()}
        assert starts == {"g1": 1, "g2": 1, "g3": 2}, starts
    finally:
        for p in groups.values():
            p.stop()
        lh.stop()
        ctl.stop()


def test_the_leader_killed_mid_way_costs_torchft_nothing_and_the_standby_takes_over(
    ft_env: dict[str, str], nats_server: NatsServer, tmp_path: Path
) -> None:
    env = {**ft_env, "MARDUK_ADDR": nats_server.url}
    a = external_controller(env, str(tmp_path / "a"))
    b = external_controller(env, str(tmp_path / "b"))
    lh, addr = lighthouse(env, min_replicas=2)
    groups = {r: group(env, r, addr) for r in ("g1", "g2", "g3")}
    every = [*groups.values(), lh, a, b]
    try:
        in_one_quorum(list(groups.values()), every)
        eventually_sync(lambda: len(status(env)["standbys"]) == 1, timeout=20)
        leader = {a.proc.pid: a, b.proc.pid: b}[int(status(env)["controller"]["pid"])]
        standby = b if leader is a else a
        t_kill = time.time()
        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait(10)
        standby.expect("serving prefix", timeout=30)
        print(f"the standby serves {time.time() - t_kill:.2f} s after the leader's SIGKILL")
        # torchft never noticed: every group kept committing, none restarted.
        until(
            "the groups keep committing with the leader dead",
            lambda: survivors_kept_committing(list(groups.values()), t_kill, 10),
            every,
        )
        starts = {r: sum(" joining at step " in ln for ln in g.all) for r, g in groups.items()}
        assert starts == {"g1": 1, "g2": 1, "g3": 1}, starts
        # The new leader has the map (from the agents' registrations and the store): a device
        # failure restarts exactly its group, which heals from a peer.
        t0 = time.time()
        out = inject(env, f"{JOB}-g2-d0")
        assert "g2" in out, out
        heals(
            "device failure after a takeover", groups["g2"], [groups["g1"], groups["g3"]], t0, every
        )
        starts = {r: sum(" joining at step " in ln for ln in g.all) for r, g in groups.items()}
        assert starts == {"g1": 1, "g2": 2, "g3": 1}, starts
    finally:
        for p in groups.values():
            p.stop()
        lh.stop()
        a.stop()
        b.stop()


def test_a_command_makes_a_standalone_group_abandon_its_step_and_exit(
    ft_env: dict[str, str],
) -> None:
    """No agent: the library registers the group itself; the command reaches the Manager."""
    from agent.torchft import RESTART_EXIT

    env = ft_env
    ctl = controller(env)
    lh, addr = lighthouse(env, min_replicas=1)
    solo_env = {**env, "MARDUK_JOB": JOB, "MARDUK_REPLICA_ID": "solo", "MARDUK_DEVICES": "ft-s-d0"}
    solo = Proc(trainer_args(addr), solo_env)
    try:
        solo.expect("step 5 committed", timeout=90)
        t0 = time.monotonic()
        inject(env, "ft-s-d0")
        line = solo.expect("marduk: restart at epoch 1 (devices ft-s-d0): abandoning step", 10)
        assert solo.proc.wait(10) == RESTART_EXIT
        # The step in flight was abandoned (report_error: should_commit said no), not committed.
        abandoned = int(line.split()[-1])
        assert not any(c.step > abandoned for c in commits(solo)), line
        print(f"standalone group: command -> exit {(time.monotonic() - t0) * 1000:.0f} ms")
        assert not any("did not reach guard.step()" in line for line in solo.all)
    finally:
        solo.stop()
        lh.stop()
        ctl.stop()
