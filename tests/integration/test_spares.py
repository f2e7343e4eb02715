"""Hot spares, shrink and the held job against a real nats-server: a member out of service hands
its ranks to a spare in one restart written ahead with its epoch; without a spare the job
shrinks; below MIN it is held and forms again; a spare of another shape is never chosen; two
spares never take one rank; a new leader keeps the membership and who was retired."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats

from marduk.controller import Controller
from marduk.store.state import StateStore
from marduk.wire import protocol as wire
from marduk.wire.protocol import decode, encode
from marduk.wire.subjects import Subjects
from tests.conftest import (
    NatsServer,
    controller_settings,
    health_event,
    marduk_cli,
    start_serving,
)

S = Subjects()
JOB = "mesh"


def registration(
    replica: str,
    pid: int,
    *,
    nproc: int = 2,
    lo: int = 1,
    hi: int = 2,
    spare: bool = False,
    job: str = JOB,
    pool: str | None = None,
) -> bytes:
    return encode(
        wire.Registration(
            job=job,
            replica=replica,
            host=f"host-{replica}",
            devices=[f"{replica}-d0"],
            scope="job",
            pid=pid,
            role="supervisor",
            rendezvous=wire.Rendezvous(
                nproc=nproc,
                min_nodes=lo,
                max_nodes=hi,
                addr=f"10.0.0.{pid}",
                ports=[30000 + pid],
                spare=spare,
                pool=pool,
            ),
        )
    )


async def register(nc, replica: str, pid: int, **kw) -> wire.RegisterReply:  # type: ignore[no-untyped-def]
    msg = await nc.request(S.register(JOB), registration(replica, pid, **kw), timeout=5)
    return decode(msg.data, wire.RegisterReply)


async def listen(nc, subject: str, type_):  # type: ignore[no-untyped-def]
    queue: asyncio.Queue = asyncio.Queue()

    async def on(msg) -> None:  # type: ignore[no-untyped-def]
        queue.put_nowait(wire.decode(msg.data, type_))

    await nc.subscribe(subject, cb=on)
    return queue


def ranks(cmd: wire.Command) -> list[tuple[str, int, int]]:
    assert cmd.membership is not None
    return [(m.replica, m.node_rank, m.first_rank) for m in cmd.membership.members]


async def kinds(events: asyncio.Queue, until: str) -> list[wire.ControllerEvent]:  # type: ignore[type-arg]
    seen = []
    while not seen or seen[-1].kind != until:
        seen.append(await asyncio.wait_for(events.get(), 5))
    return seen


async def form(nc, sent, *, lo: int = 1, spares: tuple[tuple[str, int], ...] = (("s", 2),)):  # type: ignore[no-untyped-def]
    """Members a, b (MAX 2) and the spares given as (replica, nproc); the formed command."""
    await register(nc, "a", 1, lo=lo)
    await register(nc, "b", 2, lo=lo)
    formed = await asyncio.wait_for(sent.get(), 5)
    for member in ("a", "b"):  # trainers running at the formed epoch: the restart is done
        running = wire.Report(job=JOB, replica=member, status="running", epoch=formed.epoch)
        await nc.request(S.report(JOB), encode(running), timeout=5)
    for i, (name, nproc) in enumerate(spares):
        reply = await register(nc, name, 10 + i, lo=lo, nproc=nproc, spare=True)
        assert reply.outcome == "new"
    assert ranks(formed) == [("a", 0, 0), ("b", 1, 2)]
    return formed


async def query(nc) -> wire.QueryReply:  # type: ignore[no-untyped-def]
    msg = await nc.request(S.query, encode(wire.Query(what="map", job=JOB)), timeout=5)
    return decode(msg.data, wire.QueryReply)


async def test_a_spare_takes_the_rank_of_a_member_past_its_budget(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    c = await start_serving(
        Controller(controller_settings(nats_server, tmp_path, device_max_failures=0))
    )
    nc = await nats.connect(nats_server.url)
    try:
        sent = await listen(nc, S.job_commands(JOB), wire.Command)
        events = await listen(nc, S.events(JOB), wire.ControllerEvent)
        formed = await form(nc, sent)
        first = await query(nc)
        before = {w.replica: (w.part, w.node_rank) for w in first.workers}
        assert before == {"a": ("member", 0), "b": ("member", 1), "s": ("spare", None)}
        [job] = first.jobs  # what status shows of the job
        assert (job.nodes, job.min_nodes, job.max_nodes, job.spares) == (2, 1, 2, ["s/0"])

        reply = await health_event(nc, "a-d0", event_id="ecc-1")
        [action] = reply.actions
        assert action.kind == "restart"
        swap = await asyncio.wait_for(sent.get(), 5)
        assert swap.epoch == action.epoch > formed.epoch
        # Same world size, the spare at node 0: it coordinates now, on a port it reported.
        assert ranks(swap) == [("s", 0, 0), ("b", 1, 2)]
        assert swap.membership is not None and swap.membership.world_size == 4
        assert (swap.membership.coordinator_addr, swap.membership.coordinator_port) == (
            "10.0.0.10",
            30010,
        )
        assert swap.retired == [wire.WorkerRef(replica="a")]
        seen = [e.kind for e in await kinds(events, "restart_issued")]
        assert "member_replaced" in seen
        # Written ahead: in the store once the command is out.
        store = await StateStore.open(nc, "marduk")
        [record] = [e for e in (await store.load()).epochs if e.job == JOB]
        assert record.membership == swap.membership
        later = await query(nc)
        after = {w.replica: (w.part, w.node_rank) for w in later.workers}
        assert after == {"a": ("retired", None), "b": ("member", 1), "s": ("member", 0)}
        [job] = later.jobs
        assert (job.spares, job.holding, job.last_resize) == ([], ["s/0"], "member_replaced")
        # The retired member, registering again, is told (its agent exits 71).
        again = await register(nc, "a", 1)
        assert again.command == swap
    finally:
        await nc.close()
        await c.stop()


async def test_without_a_spare_the_job_shrinks_and_below_min_it_is_held(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    nc = await nats.connect(nats_server.url)
    try:
        sent = await listen(nc, S.job_commands(JOB), wire.Command)
        events = await listen(nc, S.events(JOB), wire.ControllerEvent)
        await form(nc, sent, spares=(("odd", 1),))  # a spare of another shape: never chosen
        msg = await nc.request(S.drain, encode(wire.Drain(devices=["a-d0"])), timeout=5)
        assert [a.kind for a in decode(msg.data, wire.DrainReply).actions] == ["restart"]
        shrink = await asyncio.wait_for(sent.get(), 5)
        assert ranks(shrink) == [("b", 0, 0)]
        assert shrink.membership is not None and shrink.membership.world_size == 2
        assert shrink.membership.coordinator_addr == "10.0.0.2"  # moved with node 0
        assert "job_shrunk" in [e.kind for e in await kinds(events, "restart_issued")]

        msg = await nc.request(S.drain, encode(wire.Drain(devices=["b-d0"])), timeout=5)
        held = await asyncio.wait_for(sent.get(), 5)
        assert held.kind == "restart" and held.membership is None
        assert {r.replica for r in held.retired} == {"a", "b"}
        seen = await kinds(events, "restart_issued")
        [why] = [e.detail for e in seen if e.kind == "job_held"]
        assert "0 node(s) left, below MIN 1" in why
    finally:
        await nc.close()
        await c.stop()


async def test_held_below_min_then_formed_again_when_workers_are_back(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    c = await start_serving(
        Controller(controller_settings(nats_server, tmp_path, device_max_failures=0))
    )
    nc = await nats.connect(nats_server.url)
    try:
        sent = await listen(nc, S.job_commands(JOB), wire.Command)
        await form(nc, sent, lo=2, spares=())
        await health_event(nc, "b-d0", event_id="ecc-b")
        held = await asyncio.wait_for(sent.get(), 5)
        assert held.membership is None and held.retired == [wire.WorkerRef(replica="b")]
        # A replacement pod (a new worker) brings the job back to MIN: it forms again.
        await register(nc, "c", 3, lo=2)
        again = await asyncio.wait_for(sent.get(), 5)
        assert ranks(again) == [("a", 0, 0), ("c", 1, 2)] and again.epoch > held.epoch
    finally:
        await nc.close()
        await c.stop()


async def test_two_spares_never_take_one_rank(nats_server: NatsServer, tmp_path: Path) -> None:
    c = await start_serving(
        Controller(controller_settings(nats_server, tmp_path, device_max_failures=0))
    )
    nc = await nats.connect(nats_server.url)
    try:
        sent = await listen(nc, S.job_commands(JOB), wire.Command)
        await form(nc, sent, spares=(("s", 2), ("t", 2)))
        reply = await health_event(nc, "b-d0", event_id="ecc-b")
        assert [a.kind for a in reply.actions] == ["restart"]
        swap = await asyncio.wait_for(sent.get(), 5)
        assert ranks(swap) == [("a", 0, 0), ("s", 1, 2)]  # the first spare registered
        parts = {w.replica: w.part for w in (await query(nc)).workers}
        assert parts == {"a": "member", "b": "retired", "s": "member", "t": "spare"}
        # The other spare takes the next loss (once the swap is done), never a rank held.
        for member in ("a", "s"):
            running = wire.Report(job=JOB, replica=member, status="running", epoch=swap.epoch)
            await nc.request(S.report(JOB), encode(running), timeout=5)
        await health_event(nc, "s-d0", event_id="ecc-s")
        second = await asyncio.wait_for(sent.get(), 5)
        assert ranks(second) == [("a", 0, 0), ("t", 1, 2)]
    finally:
        await nc.close()
        await c.stop()


async def test_a_new_leader_keeps_the_membership_and_the_retired(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    first = controller_settings(nats_server, tmp_path / "a", device_max_failures=0)
    leader = await start_serving(Controller(first))
    standby = Controller(controller_settings(nats_server, tmp_path / "b", device_max_failures=0))
    await standby.start()
    nc = await nats.connect(nats_server.url)
    try:
        sent = await listen(nc, S.job_commands(JOB), wire.Command)
        await form(nc, sent)
        await health_event(nc, "a-d0", event_id="ecc-a")
        swap = await asyncio.wait_for(sent.get(), 5)
        await leader.stop()  # mid-change: nobody has confirmed the swap yet
        await asyncio.wait_for(standby.serving.wait(), 15)
        reply = await register(nc, "s", 10, spare=True)
        assert reply.command is not None and reply.command.membership == swap.membership
        parts = {w.replica: w.part for w in (await query(nc)).workers}
        assert parts["a"] == "retired" and parts["s"] == "member"
        # A crash after the takeover renews the swapped membership, the retired still listed.
        crash = wire.Report(job=JOB, replica="b", status="crashed", epoch=swap.epoch)
        await nc.request(S.report(JOB), encode(crash), timeout=5)
        renewed = await asyncio.wait_for(sent.get(), 5)
        while renewed.epoch == swap.epoch:  # the new leader may resend the swap first
            renewed = await asyncio.wait_for(sent.get(), 5)
        assert ranks(renewed) == ranks(swap) and renewed.retired == swap.retired
    finally:
        await nc.close()
        await standby.stop()
        await leader.stop()


async def test_monitor_drain_says_which_member_retired_and_who_took_its_ranks(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    nc = await nats.connect(nats_server.url)
    env = {"MARDUK_ADDR": nats_server.url, "COLUMNS": "200"}

    async def drain(device: str) -> str:
        r = await asyncio.to_thread(marduk_cli, "monitor", "drain", device, env=env)
        assert r.returncode == 0, r.stderr
        return r.stdout

    async def above(epoch: int) -> wire.Command:
        """The next command past ``epoch``: resends of the last one (every second until the
        workers confirm) queue up while the CLI starts."""
        while True:
            command = await asyncio.wait_for(sent.get(), 5)
            if command.epoch > epoch:
                return command

    try:
        sent = await listen(nc, S.job_commands(JOB), wire.Command)
        formed = await form(nc, sent)
        said = await drain("b-d0")  # the spare s takes b's ranks
        swap = await above(formed.epoch)
        assert said.splitlines() == [
            "1 device drained: b-d0",
            "  b/0 (node rank 1) retired (exits 71); spare s/0 takes node rank 1",
            f"  job {JOB} restarts at epoch {swap.epoch} with 2 nodes (world size 4)",
        ]
        assert swap.epoch > formed.epoch and "fail sent" not in said
        said = await drain("a-d0")  # no spare left: the job shrinks to s alone
        shrink = await above(swap.epoch)
        assert said.splitlines()[1:] == [
            "  a/0 (node rank 0) retired (exits 71); no spare fits",
            f"  job {JOB} shrinks to 1 node (world size 2) at epoch {shrink.epoch}",
        ]
        said = await drain("s-d0")  # below MIN 1: held
        held = await above(shrink.epoch)
        assert said.splitlines()[1:] == [
            "  s/0 (node rank 0) retired (exits 71); no spare fits",
            f"  job {JOB} is held below its MIN at epoch {held.epoch}: it forms again once "
            "enough workers are registered",
        ]
        # The reply itself, for scripts (--json).
        r = await asyncio.to_thread(marduk_cli, "monitor", "undrain", "b-d0", "--json", env=env)
        assert r.returncode == 0 and json.loads(r.stdout)["members_out"] == []
    finally:
        await nc.close()
        await c.stop()
