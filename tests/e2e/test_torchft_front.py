"""``marduk torchft-lighthouse`` end to end: a real controller, torchft's real lighthouse behind
Marduk's front, three real replica groups (examples/torchft_ddp.py, gloo on CPU), each under
``marduk agent run``, with ``agent.torchft.FRONT_ENV`` as docs/operations.md asks.

A device failure of one group: the front drops that group's incarnation at the controller's
restart (``dropped g2:...``); the group heals as under torchft's lighthouse alone (the stall
is printed, never asserted: bench/bench_torchft.py measures it). Then the front's process is
SIGKILLed: its supervisor starts it again, the Managers reconnect and retry the quorum call it
cut, and every group keeps committing steps with no trainer restarted.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time

import pytest

from agent.torchft import FRONT_ENV, front_command
from tests.conftest import free_port
from tests.e2e.test_torchft import (
    JOB,
    commits,
    group,
    heals,
    in_one_quorum,
    survivors_kept_committing,
    until,
)
from tests.processes import Proc, controller, inject

pytestmark = pytest.mark.e2e

if os.environ.get("CI"):
    import grpc  # noqa: F401  # in the torchft extra: missing in CI is a failure, not a skip
    import torchft  # noqa: F401
else:
    pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[dev]'")
    pytest.importorskip("grpc", reason="grpcio is not installed: pip install -e '.[dev]'")


def front(env: dict[str, str]) -> tuple[Proc, str]:
    port = free_port()
    # python -m marduk torchft-lighthouse ...: the README's command from this checkout
    args = [sys.executable, "-m", *front_command(JOB, 2, f"127.0.0.1:{port}")]
    p = Proc(args, {**env, "RUST_LOG": "warn"})
    p.expect("listening on", timeout=30)
    return p, f"http://127.0.0.1:{port}"


def front_pid(p: Proc) -> int:
    line = next(ln for ln in reversed(p.all) if "front started (pid " in ln)
    return int(line.split("front started (pid ")[1].split(")")[0])


def test_the_front_drops_a_failed_group_at_once_and_its_death_stops_no_training(
    env: dict[str, str],
) -> None:
    env = {**env, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", **FRONT_ENV}
    ctl = controller(env)
    lh, addr = front(env)
    groups = {r: group(env, r, addr) for r in ("g1", "g2", "g3")}
    g1, g2, g3 = groups["g1"], groups["g2"], groups["g3"]
    every = [*groups.values(), lh]
    try:
        in_one_quorum(list(groups.values()), every)
        t0 = time.time()
        inject(env, f"{JOB}-g2-d0")
        print(lh.expect("g2 restart at epoch 1: dropped g2:", timeout=10).strip())
        heals("device failure behind the front", g2, [g1, g3], t0, every)

        # The front's process SIGKILLed: started again, the groups go on, none restarts.
        killed = front_pid(lh)
        t1 = time.time()
        os.kill(killed, signal.SIGKILL)
        lh.expect("the front exited", timeout=10)
        until("a new front", lambda: front_pid(lh) != killed, every, timeout=10)
        until(
            "every group commits again with all three",
            lambda: all(
                sum(c.t > t1 and c.groups == 3 for c in commits(g)) >= 10 for g in groups.values()
            ),
            every,
            timeout=60,
        )
        assert survivors_kept_committing(list(groups.values()), t1, 10)
        for name, g in groups.items():
            ts = [c.t for c in commits(g)]
            gap = max(b - a for a, b in itertools.pairwise(ts) if b > t1)
            print(f"{name}: longest gap between commits after the front's SIGKILL {gap:.2f} s")
        starts = {r: sum(" joining at step " in ln for ln in g.all) for r, g in groups.items()}
        assert starts == {"g1": 1, "g2": 2, "g3": 1}, starts
    finally:
        for p in groups.values():
            p.stop()
        lh.stop()
        ctl.stop()
