"""NVLink segments against a real nats-server and controller: workers with synthetic
ClusterUUIDs (two domains) form whole segments in contiguous node ranks; a member's trainer asks
to exclude its node, and the spare of its own domain takes its ranks, not the older spare of the
other domain; status shows each device's domain."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats

from marduk.controller import Controller
from marduk.wire import protocol as wire
from marduk.wire.protocol import decode, encode
from marduk.wire.subjects import Subjects
from tests.conftest import NatsServer, controller_settings, start_serving
from tests.integration.test_spares import listen, ranks

S = Subjects()
JOB = "seg"
DOMAIN = {"A": "0a0a0a0a-0000-4000-8000-00000000000a", "B": "0b0b0b0b-0000-4000-8000-00000000000b"}


def registration(replica: str, pid: int, domain: str, *, spare: bool = False) -> bytes:
    return encode(
        wire.Registration(
            job=JOB,
            replica=replica,
            host=f"host-{replica}",
            devices=[f"{replica}-d0"],
            scope="job",
            pid=pid,
            role="supervisor",
            rendezvous=wire.Rendezvous(
                nproc=1,
                min_nodes=2,
                max_nodes=4,
                addr=f"10.0.0.{pid}",
                ports=[30000 + pid],
                spare=spare,
                segment=2,
            ),
            nvlink_domain=DOMAIN[domain],
        )
    )


async def test_segments_form_whole_and_a_spare_of_the_lost_members_domain_takes_its_ranks(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    nc = await nats.connect(nats_server.url)
    try:
        sent = await listen(nc, S.job_commands(JOB), wire.Command)
        nodes = [("a1", "A"), ("b1", "B"), ("a2", "A"), ("b2", "B")]
        for pid, (name, domain) in enumerate(nodes, start=1):
            await nc.request(S.register(JOB), registration(name, pid, domain), timeout=5)
        formed = await asyncio.wait_for(sent.get(), 5)
        # Registration order interleaves the domains; the segments do not.
        assert ranks(formed) == [("a1", 0, 0), ("a2", 1, 1), ("b1", 2, 2), ("b2", 3, 3)]
        for name, _ in nodes:
            running = wire.Report(job=JOB, replica=name, status="running", epoch=formed.epoch)
            await nc.request(S.report(JOB), encode(running), timeout=5)
        for pid, (name, domain) in enumerate([("sb", "B"), ("sa", "A")], start=10):
            await nc.request(S.register(JOB), registration(name, pid, domain, spare=True))

        ask = wire.WorkloadRequest(job=JOB, replica="a2", kind="exclude_node", reason="ECC")
        msg = await nc.request(S.request(JOB), encode(ask), timeout=5)
        reply = decode(msg.data, wire.WorkloadReply)
        assert reply.devices == ["a2-d0"], reply
        swap = await asyncio.wait_for(sent.get(), 5)
        assert ranks(swap) == [("a1", 0, 0), ("sa", 1, 1), ("b1", 2, 2), ("b2", 3, 3)]
        assert swap.retired == [wire.WorkerRef(replica="a2")]

        q = await nc.request(S.query, encode(wire.Query(what="devices", job=JOB)), timeout=5)
        devices = {d.device: d.nvlink_domain for d in decode(q.data, wire.QueryReply).devices}
        assert devices["sa-d0"] == DOMAIN["A"] and devices["b2-d0"] == DOMAIN["B"]
        assert c.stats["errors.internal"] == 0
    finally:
        await nc.close()
        await c.stop()
