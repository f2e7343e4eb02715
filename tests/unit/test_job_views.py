"""What status, top and the metrics show of a job whose ranks the controller assigns, pure: its
size against MIN:MAX, its spares (free, holding a lost member's ranks), the resize under way
(forming, joining, checkpoint, applying, held) and the last one; then as status renders it."""

from __future__ import annotations

import io
import re

from rich.console import Console

from marduk.controller.telemetry import job_gauges
from marduk.core import views
from marduk.core.policy import Policy
from marduk.wire.protocol import DeviceHealth, JobInfo, QueryReply
from monitor_cli import status_view as sv
from tests.unit.test_grow import checkpointed, config, reg, running, shrunk, warming
from tests.unit.test_status_view import NOW, controller


def one(p: Policy, now: float) -> JobInfo:
    [info] = p.job_infos(now)
    return info


def test_forming_then_a_spare_free_then_holding_the_lost_members_ranks() -> None:
    p = Policy(config())
    p.register(reg("a", lo=2, hi=2), now=0)
    info = one(p, 1)
    assert (info.resize, info.nodes, info.min_nodes, info.max_nodes) == ("forming", 0, 2, 2)
    assert info.resize_detail == "1 of 2:2 worker(s) registered"
    p.register(reg("b", lo=2, hi=2), now=2)
    p.register(reg("s", lo=2, hi=2, spare=True), now=2)
    info = one(p, 3)
    assert (info.nodes, info.world_size, info.spares, info.holding) == (2, 4, ["s/0"], [])
    assert info.resize == "applying" and info.last_resize == "membership_formed"
    running(p, 4, "a", "b")
    assert one(p, 5).resize == ""

    p.on_health(DeviceHealth(device="a-d0", state="failed", event_id="x"), now=6)
    info = one(p, 7)
    assert (info.nodes, info.spares, info.holding) == (2, [], ["s/0"])
    assert (info.last_resize, info.last_resize_at) == ("member_replaced", 6)
    assert info.resize == "applying" and info.resize_detail.endswith("0 of 2 member(s) run it")
    [w] = [w for w in p.worker_infos() if w.replica == "s"]
    assert (w.part, w.spare, w.node_rank) == ("member", True, 0)


def test_a_shrunk_job_shows_the_grow_joining_then_waiting_for_its_checkpoint() -> None:
    p = Policy(config())
    shrunk(p)
    running(p, 4, "b")
    info = one(p, 4)
    assert (info.nodes, info.world_size, info.last_resize, info.last_resize_at) == (
        1,
        2,
        "job_shrunk",
        3,
    )
    p.register(reg("c"), now=5)
    info = one(p, 6)
    assert info.joining == ["c/0"] and info.resize == "joining"
    assert info.resize_detail == "c/0 joining: ready 1s of --grow-settle 5s"
    info = one(p, 12)
    assert info.resize_detail.startswith("c/0 joining: the last resize was 9s ago")
    p.tick(now=23)
    info = one(p, 24)
    assert info.resize == "checkpoint" and info.resize_since == 23
    assert info.resize_detail == (
        "grow 1 -> 2 node(s) (c/0 joining): checkpoint saved by 0 of 1 member(s), "
        "restarts within 29s"
    )
    checkpointed(p, "b", now=25)
    info = one(p, 26)
    assert (info.nodes, info.world_size, info.joining) == (2, 4, [])
    assert (info.resize, info.last_resize) == ("applying", "member_added")


def test_held_below_min() -> None:
    p = Policy(config())
    for w in "ab":
        p.register(reg(w, lo=2, hi=2), now=0)
    running(p, 1, "a", "b")
    p.on_health(DeviceHealth(device="a-d0", state="failed", event_id="x"), now=3)
    info = one(p, 4)
    assert (info.nodes, info.resize, info.last_resize) == (0, "held", "job_held")
    assert info.resize_detail == "below MIN: 1 of 2 usable worker(s) registered"


def test_held_with_min_back_says_it_waits_out_the_join_timeout_not_below_min() -> None:
    p = Policy(config())  # --join-timeout 5
    for w in "ab":
        p.register(reg(w, lo=2, hi=3), now=0)
    p.tick(now=6)
    running(p, 7, "a", "b")
    p.on_health(DeviceHealth(device="a-d0", state="failed", event_id="x"), now=8)
    assert one(p, 9).resize_detail == "below MIN: 1 of 2 usable worker(s) registered"
    p.register(reg("c", lo=2, hi=3), now=10)
    info = one(p, 11)
    assert info.resize == "held"
    assert info.resize_detail == "2 of 2:3 usable worker(s) registered (MIN again), forms within 4s"


def test_the_metrics_of_a_job() -> None:
    p = Policy(config())
    shrunk(p, hi=3)
    running(p, 4, "b", "c")
    samples = {
        (m.name, tuple(s.labels.values())): s.value
        for m in job_gauges(p.job_infos(5))
        for s in m.samples
    }
    assert samples[("marduk_job_nodes", ("j",))] == 2
    assert samples[("marduk_job_nodes_min", ("j",))] == 1
    assert samples[("marduk_job_nodes_max", ("j",))] == 3
    assert samples[("marduk_job_world_size", ("j",))] == 4
    assert samples[("marduk_spares_holding", ("j",))] == 0
    assert samples[("marduk_job_last_resize_timestamp_seconds", ("j",))] == 3
    assert ("marduk_job_resize", ("j", "applying")) not in samples
    p.register(reg("d", hi=3), now=6)
    resizing = [m for m in job_gauges(p.job_infos(7)) if m.name == "marduk_job_resize"]
    assert [(s.labels, s.value) for s in resizing[0].samples] == [
        ({"job": "j", "phase": "joining"}, 1.0)
    ]


def test_status_and_top_show_the_membership() -> None:
    reply = QueryReply(
        controller=controller(),
        jobs=[
            JobInfo(
                job="llama",
                min_nodes=2,
                max_nodes=4,
                nodes=3,
                world_size=24,
                epoch=9,
                spares=["r9/0"],
                holding=["r8/0"],
                resize="checkpoint",
                resize_detail="grow 3 -> 4 node(s) (r4/0 joining): checkpoint saved by 2 of 3 "
                "member(s), restarts within 80s",
                resize_since=NOW - 40,
                last_resize="member_replaced",
                last_resize_epoch=7,
                last_resize_at=NOW - 600,
                last_resize_detail="node rank 1 (ranks 8-15) to spare r8/0: device out of service",
            ),
            JobInfo(job="small", min_nodes=2, max_nodes=2, resize="held", resize_detail="x"),
        ],
    )
    lines = sv.plain_lines(sv.status_blocks(reply, sv.Filters(), NOW))
    start = lines.index("membership:")
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[start + 1 :]]
    assert rows == [
        ["job", "nodes", "min:max", "world", "spares", "resize", "last resize"],
        [
            "llama",
            "3",
            "2:4",
            "24",
            "r9/0 free, r8/0 holding",
            "checkpoint 40 s ago: grow 3 -> 4 node(s) (r4/0 joining): checkpoint saved by 2 of "
            "3 member(s), restarts within 80s",
            "swap at epoch 7, 10 min ago: node rank 1 (ranks 8-15) to spare r8/0: device out "
            "of service",
        ],
        ["small", "0", "2:2", "0", "-", "held: x", "-"],
    ]
    top = sv.plain_lines(sv.top_blocks(reply, [], NOW))
    assert "membership:" in top
    many = JobInfo(job="j", min_nodes=1, max_nodes=2, spares=["a/0", "b/0", "c/0"])
    assert sv.spares_cell(many) == "3 free (a/0 +2)"


def test_status_shows_a_pool_its_free_and_claimed_spares_and_the_job_drawing_from_it() -> None:
    reply = QueryReply(
        controller=controller(),
        jobs=[
            JobInfo(
                job="ja",
                min_nodes=1,
                max_nodes=2,
                nodes=2,
                world_size=4,
                pool="gpu8",
                holding=["s0/0"],
                claimed=["s0/0"],
            ),
            JobInfo(
                job="gpu8",
                min_nodes=0,
                max_nodes=0,
                pool="gpu8",
                is_pool=True,
                spares=["s1/0"],
                claimed=["s0/0 by ja"],
            ),
        ],
    )
    lines = sv.plain_lines(sv.status_blocks(reply, sv.Filters(), NOW))
    start = lines.index("membership:")
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[start + 1 :]]
    assert rows[1][:5] == ["ja (pool gpu8)", "2", "1:2", "4", "s0/0 holding"]
    assert rows[2] == ["gpu8 (pool)", "-", "-", "-", "s1/0 free, s0/0 by ja claimed", "-", "-"]


def test_a_joiner_warming_up_shows_so() -> None:
    p = Policy(config())
    shrunk(p)
    running(p, 4, "b")
    p.register(warming("c"), now=5)
    info = one(p, 30)
    assert info.joining == ["c/0"] and info.resize == "joining"
    assert info.resize_detail == "c/0 joining: c/0 warming (fork server importing)"
    p.register(warming("c", ready=True), now=31)
    assert one(p, 33).resize_detail == "c/0 joining: ready 2s of --grow-settle 5s"


def test_each_worker_row_says_member_joining_or_spare_as_the_membership_does() -> None:
    """A worker that will grow the job (warming or ready) is joining, not a spare: in its row,
    in the summary's count, in the metrics' spares and in the job's ``joining``."""
    p = Policy(config())
    shrunk(p)  # a retired, b the member at node 0
    running(p, 4, "b")
    p.register(reg("c"), now=5)  # will grow the job
    p.register(warming("d"), now=5)  # will too, once its fork server is ready
    p.register(reg("s", spare=True), now=5)  # a declared spare stays one
    parts = {w.replica: w.part for w in views.worker_infos(p.fleet, None, 6)}
    assert parts == {"a": "retired", "b": "member", "c": "joining", "d": "joining", "s": "spare"}
    info = one(p, 6)
    assert (info.joining, info.spares) == (["c/0", "d/0"], ["s/0"])
    assert views.spares_by_job(p.fleet, 6) == {"j": 1}

    reply = QueryReply(
        controller=controller(), workers=views.worker_infos(p.fleet, None, 6), jobs=[info]
    )
    lines = sv.plain_lines(sv.status_blocks(reply, sv.Filters(), 6))
    rows = {r[1]: r for r in (re.split(r"\s{2,}", line.strip()) for line in lines) if r[0] == "j"}
    assert [rows[w][9] for w in "abcds"] == [
        "retired",
        "running, node 0",
        "joining",
        "joining",
        "spare",
    ]
    [summary] = [r for r in rows.values() if len(r) == 9]  # the jobs grid: one row
    assert summary[2] == "5 (1 spare, 2 joining)"

    # On a terminal too (rich tables): each worker's row ends with its part.
    buf = io.StringIO()
    console = Console(file=buf, width=200, color_system=None, soft_wrap=True)
    for r in sv.rich_renderables(sv.status_blocks(reply, sv.Filters(), 6), console.width):
        console.print(r)
    drawn = {line.split()[1]: line for line in buf.getvalue().splitlines() if line.startswith("j ")}
    assert [drawn[w].split()[-2] for w in "acds"] == ["retired", "joining", "joining", "spare"]


def test_a_joiner_is_a_spare_again_once_the_job_is_at_max() -> None:
    p = Policy(config())
    shrunk(p)
    running(p, 4, "b")
    p.register(reg("c"), now=5)
    assert {w.replica: w.part for w in views.worker_infos(p.fleet, None, 6)}["c"] == "joining"
    p.tick(now=24)  # the grow starts: c still joins until the new membership is out
    checkpointed(p, "b", now=25)
    parts = {w.replica: (w.part, w.node_rank) for w in views.worker_infos(p.fleet, None, 26)}
    assert parts["c"] == ("member", 1)
    p.register(reg("e"), now=27)  # beyond MAX: a spare, not a joiner
    assert {w.replica: w.part for w in views.worker_infos(p.fleet, None, 28)}["e"] == "spare"
    assert one(p, 28).joining == []
