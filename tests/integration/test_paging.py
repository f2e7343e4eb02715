"""Every reply fits (docs/decisions.md #12): the pager, pure, and status at scale, real; the
jobs (``QueryReply.jobs``) come once, with the first page, in its budget."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import nats
import pytest
from hypothesis import given
from hypothesis import strategies as st

from marduk.controller import Controller
from marduk.core.paging import ENVELOPE_BYTES, Snapshot, page_end
from marduk.wire import protocol as wire
from marduk.wire.protocol import encode
from marduk.wire.subjects import Subjects
from monitor_cli import client
from tests.conftest import NatsServer, controller_settings, marduk_cli, start_serving


@given(st.lists(st.integers(min_value=1, max_value=500), max_size=200), st.integers(1, 2000))
def test_pages_cover_every_item_once_and_fit_unless_one_item_alone_is_larger(
    sizes: list[int], budget: int
) -> None:
    start, seen = 0, []
    while start < len(sizes):
        end = page_end(sizes, start, budget)
        assert end > start  # progress: at least one item per page
        cost = sum(s + 1 for s in sizes[start:end])
        assert cost <= budget or end == start + 1
        seen.extend(range(start, end))
        start = end
    assert seen == list(range(len(sizes)))


@pytest.mark.e2e
@pytest.mark.timeout(240)
async def test_status_of_2000_replicas_with_nvml_uuids_is_paged_and_complete(
    controller: Controller, nats_server: NatsServer
) -> None:
    """About 2.5 MB of map: over NATS's 1 MiB max payload, so it must come in pages."""
    s = Subjects()
    nc = await nats.connect(nats_server.url)
    replicas = 2000
    try:
        for i in range(replicas):
            reg = wire.Registration(
                job="big",
                replica=f"r{i:04d}",
                host=f"host-{i // 4:04d}.cluster.example.com",
                devices=[f"GPU-{uuid.uuid4()}" for _ in range(8)],
                pid=10_000 + i,
            )
            msg = await nc.request(s.register("big"), encode(reg), timeout=10)
            assert wire.decode(msg.data, wire.RegisterReply).outcome == "new"
    finally:
        await nc.close()
    env = {"MARDUK_ADDR": nats_server.url}
    # In a thread: the controller runs on this test's event loop and must keep serving.
    r = await asyncio.to_thread(marduk_cli, "monitor", "status", "--json", env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) > 1_100_000  # the whole answer is larger than one NATS message
    status = json.loads(r.stdout)
    assert len(status["workers"]) == replicas and status["total_workers"] == replicas
    assert len(status["devices"]) == replicas * 8 == status["total_devices"]
    assert len({w["replica"] for w in status["workers"]}) == replicas
    assert controller.stats["queries.pages"] >= 3
    assert controller.stats["errors.reply_too_large"] == 0
    # The human view too, piped: complete and no traceback.
    r = await asyncio.to_thread(marduk_cli, "monitor", "status", env=env, timeout=120)
    assert r.returncode == 0 and "2,000 workers, 16,000 devices" in r.stdout, r.stderr[-2000:]


def test_the_first_page_carries_the_jobs_in_its_budget_and_no_later_page_does() -> None:
    jobs = [wire.JobInfo(job="j", min_nodes=1, max_nodes=2)]
    snap = Snapshot("q1", 0.0, [], [], [100] * 10, jobs, jobs_size=500)
    first, after = snap.page(0, 1000)
    assert first.jobs == jobs and after == 4  # 4 items of 101 bytes beside the jobs' 500
    second, _ = snap.page(after, 1000)
    assert second.jobs == [] and second.offset == 4


def registration(job: str, replica: str, pid: int, *, nnodes: bool) -> wire.Registration:
    return wire.Registration(
        job=job,
        replica=replica,
        host=f"host-{replica}.cluster.example.com",
        devices=[f"GPU-{uuid.uuid4()}" for _ in range(8)],
        scope="job" if nnodes else "replica",
        pid=pid,
        role="supervisor",
        rendezvous=wire.Rendezvous(min_nodes=1, max_nodes=4, addr=f"10.0.{pid // 250}.{pid % 250}")
        if nnodes
        else None,
    )


async def pages(nc: nats.NATS, job: str | None) -> list[wire.QueryReply]:
    """Every page of one answer, each checked to fit the server's max payload."""
    out, query = [], wire.Query(what="map", job=job)
    while True:
        msg = await nc.request(Subjects().query, encode(query), timeout=5)
        assert len(msg.data) <= nc.max_payload
        out.append(page := wire.decode(msg.data, wire.QueryReply))
        if page.next_offset is None:
            return out
        query = wire.Query(what="map", job=job, offset=page.next_offset, snapshot=page.snapshot)


@pytest.mark.timeout(60)
async def test_a_paged_answer_has_its_jobs_on_the_first_page_filtered_and_every_page_fits(
    tmp_path: Path,
) -> None:
    """A server with a 48 KiB max payload: 40 workers of a job and 60 other jobs come in several
    pages. The page at offset 0 carries the jobs (with --job, that job only), in its budget:
    more than the 16 KiB left for the envelope; later pages carry none. Every reply fits; the
    client's assembled answer, and ``status --json``, have the jobs."""
    conf = tmp_path / "nats.conf"
    conf.write_text("max_payload: 49152\n")
    server = NatsServer(tmp_path / "js", args=["-c", str(conf)]).start()
    ctl = await start_serving(Controller(controller_settings(server, tmp_path)))
    s = Subjects()
    nc = await nats.connect(server.url)
    try:
        for i in range(40):
            reg = registration("mesh", f"r{i:02d}", 1000 + i, nnodes=True)
            await nc.request(s.register("mesh"), encode(reg), timeout=5)
        side = [f"side-job-with-a-long-name-{i:02d}" for i in range(60)]
        for i, job in enumerate([*side, "plain"]):
            reg = registration(job, "x", 2000 + i, nnodes=job != "plain")
            await nc.request(s.register(job), encode(reg), timeout=5)

        everything = await pages(nc, None)
        assert len(everything) >= 3
        assert [j.job for j in everything[0].jobs] == ["mesh", *side]
        assert len(encode(everything[0].jobs)) > ENVELOPE_BYTES
        assert all(p.jobs == [] and p.stats == {} for p in everything[1:])

        mesh = await pages(nc, "mesh")
        assert len(mesh) >= 2 and sum(len(p.workers) for p in mesh) == 40
        assert [j.job for j in mesh[0].jobs] == ["mesh"] and mesh[0].jobs[0].max_nodes == 4
        assert all(p.jobs == [] for p in mesh[1:])
        # Page 0 asked again within its snapshot: the same jobs, of the same moment.
        again = await nc.request(
            s.query, encode(wire.Query(job="mesh", snapshot=mesh[0].snapshot)), timeout=5
        )
        assert wire.decode(again.data, wire.QueryReply).jobs == mesh[0].jobs

        whole = await client.query_on(nc, "marduk", "map", None, 5)
        assert [j.job for j in whole.jobs] == ["mesh", *side] and len(whole.workers) == 101
        env = {"MARDUK_ADDR": server.url}
        r = await asyncio.to_thread(
            marduk_cli, "monitor", "status", "--json", "--job", "mesh", env=env
        )
        assert r.returncode == 0, r.stderr
        status = json.loads(r.stdout)
        assert [j["job"] for j in status["jobs"]] == ["mesh"] and len(status["workers"]) == 40
        assert ctl.stats["errors.reply_too_large"] == 0
    finally:
        await nc.close()
        await ctl.stop()
        server.stop()
