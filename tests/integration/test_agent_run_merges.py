"""``marduk agent run`` and a failure merged into the restart it is carrying out (issue 24).

A real supervisor and its trainer, a controller in this process and a TCP proxy between the
supervisor and NATS that holds what the supervisor sends, so that its ack of a restart is
still on the way when the device fails again: the rule that a failure is covered by a restart
only if the restart's incarnation starts after it, seen from the agent's side.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import nats

from marduk.controller import Controller
from marduk.core.records import EpochKey
from tests.conftest import (
    NatsServer,
    controller_settings,
    eventually,
    health_event,
    start_serving,
)
from tests.processes import Proc, agent_run
from tests.tcp_proxy import TcpProxy

TRAINER = """\
import os, time
print(f"START epoch={os.environ['MARDUK_EPOCH']}", flush=True)
while True:
    print("step", flush=True)
    time.sleep(0.1)
"""


async def started_at(p: Proc, epoch: int) -> None:
    await asyncio.to_thread(p.expect, f"START epoch={epoch}", 30)


def supervise(addr: str, tmp_path: Path, trainer: str, *options: str) -> Proc:
    """``marduk agent run`` of replica r1 on device d1, reaching NATS at ``addr``."""
    (tmp_path / "train.py").write_text(trainer)
    return agent_run(
        {"MARDUK_ADDR": addr, "PYTHONUNBUFFERED": "1"},
        *("--replica", "r1", "--devices", "d1", "--preload", "none", *options),
        cmd=[sys.executable, str(tmp_path / "train.py")],
    )


async def test_a_failure_after_the_new_trainer_started_restarts_it_again(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """d1 fails: the supervisor stops its trainer, acks epoch 1 (held in the proxy) and starts
    the next one. d1 fails again now, before the ack reached the leader: merged into epoch 1
    at revision 1, and the update reaches the supervisor after it acted (not taken in). Its
    ack says revision 0: the leader restarts r1 again at epoch 2, and the supervisor starts a
    third trainer. (Before revisions, the repeat was "coalesced" and nothing more was sent.)"""
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path / "ctl")))
    proxy = await TcpProxy(nats_server.port).start()
    nc = await nats.connect(nats_server.url)
    sup = supervise(proxy.url, tmp_path, TRAINER)
    try:
        await started_at(sup, 0)
        proxy.hold(down=False)  # what the supervisor sends waits; it still receives
        first = await health_event(nc, "d1", event_id="e1")
        assert [(a.epoch, a.coalesced) for a in first.actions] == [(1, False)]
        await started_at(sup, 1)  # its ack of epoch 1 is held in the proxy
        again = await health_event(nc, "d1", event_id="e2")
        assert [(a.epoch, a.coalesced) for a in again.actions] == [(1, True)]
        proxy.pass_()
        await started_at(sup, 2)
        command = c.policy.epochs[EpochKey("default", "r1")].command
        assert command is not None and (command.epoch, command.event_id) == (2, "e2")
        await eventually(lambda: not c.policy.awaiting(EpochKey("default", "r1")))
        assert c.policy.epoch_of(EpochKey("default", "r1")) == 2
    finally:
        sup.stop()
        await nc.close()
        await proxy.stop()
        await c.stop()


async def test_a_failure_while_the_old_trainer_stops_is_covered_by_the_restart(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The second failure reaches the supervisor while it is still stopping the old trainer
    (one that takes 2.5 s to end on SIGTERM; a repeat of a listed device goes out with the
    next resend, within a second): the update is taken in before the ack, the next trainer
    starts after both failures, and one restart covers them (no epoch 2)."""
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path / "ctl")))
    nc = await nats.connect(nats_server.url)
    slow = TRAINER.replace(
        "import os, time\n",
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(2.5), sys.exit(0)))\n",
    )
    # A restart stops a trainer after --restart-grace (0.5 s): give this one its 2.5 s.
    sup = supervise(nats_server.url, tmp_path, slow, "--restart-grace", "10")
    try:
        await started_at(sup, 0)
        await health_event(nc, "d1", event_id="e1")
        await asyncio.to_thread(sup.expect, "stopping", 10)
        again = await health_event(nc, "d1", event_id="e2")
        assert [(a.epoch, a.coalesced) for a in again.actions] == [(1, True)]
        await started_at(sup, 1)
        await eventually(lambda: not c.policy.awaiting(EpochKey("default", "r1")))
        await asyncio.sleep(1.5)  # a restart again would have been sent by now
        assert c.policy.epoch_of(EpochKey("default", "r1")) == 1
        assert not any("START epoch=2" in line for line in sup.all), "".join(sup.all)
    finally:
        sup.stop()
        await nc.close()
        await c.stop()
