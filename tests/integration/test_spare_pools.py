"""Pools of hot spares against a real nats-server: a member of job ``ja`` out of service takes the
free spare of the pool both jobs name, in one restart written ahead with the claim; the spare is
told at its next registration and registers under ``ja``; job ``jb`` is untouched and, the pool
empty, shrinks on a loss of its own; a new leader keeps the claim."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import nats
import pytest
from prometheus_client import CollectorRegistry

from agent.library.options import resolve_options
from agent.supervise.controller_link import ControllerLink
from marduk.controller import Controller
from marduk.store.state import StateStore
from marduk.wire import protocol as wire
from marduk.wire.protocol import decode, encode
from marduk.wire.subjects import Subjects
from tests.conftest import (
    NatsServer,
    controller_settings,
    eventually,
    health_event,
    start_serving,
)
from tests.integration.test_auth_roles import auth_dir, creds, secure  # noqa: F401 (fixtures)
from tests.integration.test_spares import listen, ranks, registration

S = Subjects()
POOL = "gpu2"


async def register(  # type: ignore[no-untyped-def]
    nc, job: str, replica: str, pid: int, *, spare: bool = False
) -> wire.RegisterReply:
    data = registration(replica, pid, job=job, pool=POOL, spare=spare)
    msg = await nc.request(S.register(job), data, timeout=5)
    return decode(msg.data, wire.RegisterReply)


async def form(nc, job: str, names: tuple[str, str], pid: int, sent) -> wire.Command:  # type: ignore[no-untyped-def]
    await register(nc, job, names[0], pid)
    await register(nc, job, names[1], pid + 1)
    formed = await asyncio.wait_for(sent.get(), 5)
    for member in names:
        running = wire.Report(job=job, replica=member, status="running", epoch=formed.epoch)
        await nc.request(S.report(job), encode(running), timeout=5)
    return formed


async def jobs(nc) -> dict[str, wire.JobInfo]:  # type: ignore[no-untyped-def]
    msg = await nc.request(S.query, encode(wire.Query(what="map")), timeout=5)
    return {j.job: j for j in decode(msg.data, wire.QueryReply).jobs}


async def test_a_lost_member_takes_the_pool_spare_and_a_new_leader_keeps_the_claim(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    policy = {"device_max_failures": 0}
    leader = await start_serving(
        Controller(controller_settings(nats_server, tmp_path / "a", **policy))
    )
    standby = Controller(controller_settings(nats_server, tmp_path / "b", **policy))
    await standby.start()
    nc = await nats.connect(nats_server.url)
    try:
        sent_a = await listen(nc, S.job_commands("ja"), wire.Command)
        sent_b = await listen(nc, S.job_commands("jb"), wire.Command)
        await form(nc, "ja", ("a0", "a1"), 1, sent_a)
        formed_b = await form(nc, "jb", ("b0", "b1"), 11, sent_b)
        free = await register(nc, POOL, "s0", 30, spare=True)
        assert free.outcome == "new" and free.claimed_by is None and free.command is None
        shown = await jobs(nc)
        assert shown[POOL].is_pool and shown[POOL].spares == ["s0/0"]
        assert shown["ja"].pool == POOL and shown["jb"].pool == POOL

        await health_event(nc, "a1-d0", event_id="ecc-a1")
        swap = await asyncio.wait_for(sent_a.get(), 5)
        assert ranks(swap) == [("a0", 0, 0), ("s0", 1, 2)]
        assert swap.membership is not None and swap.membership.world_size == 4
        assert swap.retired == [wire.WorkerRef(replica="a1")]
        # The claim is in the store with the membership once the command is out.
        store = await StateStore.open(nc, "marduk")
        [record] = [e for e in (await store.load()).epochs if e.job == "ja"]
        assert record.membership == swap.membership
        assert [(c.pool, c.replica) for c in record.claims] == [(POOL, "s0")]

        await leader.stop()  # before the spare heard of it: the standby finishes the hand-over
        await asyncio.wait_for(standby.serving.wait(), 15)
        told = await register(nc, POOL, "s0", 30, spare=True)
        assert told.claimed_by == "ja"
        there = await register(nc, "ja", "s0", 30, spare=True)
        assert there.command is not None and there.command.membership == swap.membership
        shown = await jobs(nc)
        assert shown[POOL].spares == [] and shown[POOL].claimed == ["s0/0 by ja"]
        assert shown["ja"].claimed == ["s0/0"] and shown["ja"].holding == ["s0/0"]
        assert sent_b.empty()  # jb untouched

        # jb loses a member: the pool has nothing free, jb shrinks.
        await health_event(nc, "b0-d0", event_id="ecc-b0")
        shrink = await asyncio.wait_for(sent_b.get(), 10)
        while shrink.epoch == formed_b.epoch:  # the new leader may resend the formed one
            shrink = await asyncio.wait_for(sent_b.get(), 10)
        assert ranks(shrink) == [("b1", 0, 0)]
    finally:
        await nc.close()
        await standby.stop()
        await leader.stop()


async def test_a_pool_spare_moves_with_the_plain_agent_credential_and_says_why_it_cannot_with_a_per_job_one(
    secure: tuple[NatsServer, Controller],  # noqa: F811 (test_auth_roles' fixtures)
    auth_dir: Path,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``ControllerLink.move`` under auth: the plain agent credential registers under the
    claiming job; a credential of the pool's job alone (``agent-big``, the pool here being
    ``big``) is refused by the server, and the agent says which credential it needs
    (docs/operations.md, *Pools of spares*)."""
    server, _ = secure
    links = []
    try:
        for name, replica in (("agent", "s0"), ("agent-big", "s1")):
            opts = resolve_options(
                replica,
                [f"{replica}-d0"],
                "big",
                server.url,
                "job",
                timeout=5,
                role="supervisor",
                credentials=creds(auth_dir, name),
            )
            opts.rendezvous = wire.Rendezvous(
                nproc=2, min_nodes=1, max_nodes=2, addr="h", spare=True, pool="big"
            )
            link = ControllerLink(
                opts,
                on_command=lambda _c: None,
                registry=CollectorRegistry(),
                join_interval_s=0.2,
                spawn=lambda coro, name: asyncio.get_running_loop().create_task(coro, name=name),
            )
            links.append(link)
            await link.connect()
        await asyncio.wait_for(links[0].move("ja"), 10)
        assert links[0].client is not None and links[0].client.state == "registered"
        assert links[0].opts.job == "ja"
        stuck = asyncio.create_task(links[1].move("ja"))
        with caplog.at_level(logging.ERROR, logger="agent.supervisor"):
            await eventually(lambda: "may not register under job ja" in caplog.text, timeout=15)
        assert not stuck.done()
        stuck.cancel()
    finally:
        for link in links:
            await link.close(deregister=False)


async def test_a_held_job_whose_workers_are_all_gone_forms_again_from_pool_spares_on_a_new_leader(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Job ``ja`` (MIN 2) held after losing a member, then its last worker gone (expired): the
    hold kept its pool and shape on its epoch record, so a new leader, with nothing else of the
    job, forms it again from two free spares of the pool."""
    policy = {
        "device_max_failures": 0,
        "join_timeout_s": 0.5,
        "worker_ttl_s": 0.6,
        "worker_expiry_s": 1.2,
    }
    leader = await start_serving(
        Controller(controller_settings(nats_server, tmp_path / "a", **policy))
    )
    standby = Controller(controller_settings(nats_server, tmp_path / "b", **policy))
    await standby.start()
    nc = await nats.connect(nats_server.url)
    renewing: asyncio.Task[None] | None = None
    try:
        sent = await listen(nc, S.job_commands("ja"), wire.Command)
        for replica, pid in (("a0", 1), ("a1", 2)):
            data = registration(replica, pid, job="ja", pool=POOL, lo=2, hi=2)
            await nc.request(S.register("ja"), data, timeout=5)
        formed = await asyncio.wait_for(sent.get(), 5)
        await health_event(nc, "a0-d0", event_id="ecc-a0")
        held = await asyncio.wait_for(sent.get(), 5)
        assert held.epoch > formed.epoch and held.membership is None
        await eventually(lambda: not leader.policy.fleet.job_workers.get("ja"))  # all expired
        await leader.stop()
        await asyncio.wait_for(standby.serving.wait(), 10)

        async def spares_renew() -> None:
            while True:
                for replica, pid in (("s0", 30), ("s1", 31)):
                    try:
                        await register(nc, POOL, replica, pid, spare=True)
                    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                        pass
                await asyncio.sleep(0.1)

        renewing = asyncio.create_task(spares_renew())
        again = await asyncio.wait_for(sent.get(), 10)
        while again.epoch <= held.epoch:  # resends of the hold (nobody confirms it)
            again = await asyncio.wait_for(sent.get(), 10)
        assert sorted(ranks(again)) == [("s0", 0, 0), ("s1", 1, 2)]
        store = await StateStore.open(nc, "marduk")
        [rec] = [e for e in (await store.load()).epochs if e.job == "ja" and e.replica is None]
        assert sorted(c.replica for c in rec.claims) == ["s0", "s1"]
        assert rec.membership == again.membership
        assert rec.shape is not None and (rec.shape.min_nodes, rec.shape.pool) == (2, POOL)
    finally:
        if renewing is not None:
            renewing.cancel()
        await nc.close()
        await standby.stop()
        await leader.stop()
