"""``marduk monitor status`` as text, pure: a QueryReply in, lines out (no server).

Exact lines for a small case; structure, and nothing cut, at 1,000 replicas x 8 NVML UUIDs.
"""

from __future__ import annotations

import io
import random
import uuid

import pytest

from marduk.wire.protocol import ControllerInfo, DeviceInfo, QueryReply, WorkerInfo
from monitor_cli import status_view as sv

NOW = 1_800_000_000.0


def controller() -> ControllerInfo:
    return ControllerInfo(
        controller_id="ctl-1",
        version="0.1.0",
        pid=42,
        started_at=NOW - 125,
        prefix="marduk",
        host="head",
        term=3,
    )


def worker(job: str, replica: str, devices: list[str], **kw: object) -> WorkerInfo:
    fields: dict[str, object] = dict(
        job=job,
        replica=replica,
        worker=0,
        host="h1",
        devices=devices,
        scope="replica",
        role="library",
        pid=100,
        incarnation=0,
        applied_epoch=0,
        epoch=0,
        registered_at=NOW - 300,
        updated_at=NOW - 300,
        last_seen=NOW - 2,
    )
    fields.update(kw)
    return WorkerInfo(**fields)  # type: ignore[arg-type]


def small_reply() -> QueryReply:
    gpu = "GPU-8e1a4c2b-1f0e-4d2c-9a7b-5c3d2e1f8b31"
    return QueryReply(
        controller=controller(),
        workers=[
            worker("train", "r1", [gpu], epoch=2, applied_epoch=2, host="h1"),
            worker(
                "train",
                "r2",
                ["d2", "d3"],
                epoch=1,
                applied_epoch=0,
                host="h2",
                role="supervisor",
                status="crashed",
                failure_class="device_oom",
                step=120,
                step_at=NOW - 30,
                updated_at=NOW - 40,
            ),
            worker("eval", "e1", ["d9"], state="stale", last_seen=NOW - 700, host="h3"),
        ],
        devices=[
            DeviceInfo(device=gpu, state="healthy", replicas=["train/r1"]),
            DeviceInfo(
                device="d2",
                state="failed",
                reason="xid 79",
                since=NOW - 12,
                failures=1,
                replicas=["train/r2"],
            ),
            DeviceInfo(device="d3", state="healthy", replicas=["train/r2"]),
            DeviceInfo(device="d9", state="healthy", replicas=["eval/e1"]),
        ],
    )


def lines(
    reply: QueryReply, f: sv.Filters | None = None, limit: int = sv.DETAIL_LIMIT
) -> list[str]:
    return sv.plain_lines(sv.status_blocks(reply, f or sv.Filters(), NOW, limit=limit))


def test_small_status_exact_lines() -> None:
    assert lines(small_reply()) == [
        "controller ctl-1 (leader, term 3, pid 42 on head), v0.1.0, started 2 min ago",
        "standbys: none",
        "3 replicas, 3 workers, 4 devices",
        "jobs:",
        "  job    replicas  live  stale  devices  unusable  epoch  restarts  last failure",
        "  eval          1     0      1        1         0      0         0  -",
        "  train         2     2      0        3         1      2         3  device d2 failed: xid 79, 12 s ago",
        "workers:",
        "  job    replica  worker  host  state  seen        devices            scope    epoch  status                step",
        "  train  r1            0  h1    live   2 s ago     GPU-8e1a4c2b…8b31  replica      2  registered            -",
        "  train  r2            0  h2    live   2 s ago     d2,d3              replica   0->1  crashed (device_oom)  120 (30 s ago)",
        "  eval   e1            0  h3    stale  11 min ago  d9                 replica      0  registered            -",
        "devices:",
        "  device                                    state    since     failures  replicas  reason",
        "  GPU-8e1a4c2b-1f0e-4d2c-9a7b-5c3d2e1f8b31  healthy  -                0  train/r1  -",
        "  d2                                        failed   12 s ago         1  train/r2  xid 79",
        "  d3                                        healthy  -                0  train/r2  -",
        "  d9                                        healthy  -                0  eval/e1   -",
    ]


def test_filters_select_workers_and_the_devices_they_touch() -> None:
    reply = small_reply()

    def picked(**kw: object) -> tuple[list[str], list[str]]:
        workers, devices = sv.select(reply, sv.Filters(**kw))  # type: ignore[arg-type]
        return [w.replica for w in workers], [d.device for d in devices]

    gpu = reply.devices[0].device
    assert picked(replica="r2") == (["r2"], ["d2", "d3"])
    assert picked(state="stale") == (["e1"], ["d9"])
    assert picked(state="live") == (["r1", "r2"], [gpu, "d2", "d3"])
    assert picked(state="failed") == (["r2"], ["d2"])
    assert picked(host="h1") == (["r1"], [gpu])
    # The abbreviation status prints, a prefix, or the full id.
    for pattern in ("GPU-8e1a4c2b…8b31", "GPU-8e1a", gpu):
        assert picked(device=pattern) == (["r1"], [gpu])
    assert picked(device="GPU-8e1a4c2b…0000") == ([], [])
    assert lines(reply, sv.Filters(replica="nope"))[-1] == "nothing matches these filters"


def drained_reply() -> QueryReply:
    """small_reply, with d3 drained while healthy, d2 (failed) drained, d9 quarantined."""
    reply = small_reply()
    why = "drained by an operator: bad fan"
    for d in reply.devices:
        if d.device in ("d2", "d3"):
            d.drained, d.out_reason = True, why
        if d.device == "d9":
            d.quarantined, d.out_reason = True, "flapping: failed 4 times in 3600 s"
    return reply


def test_a_device_out_of_service_is_shown_as_such_and_counted() -> None:
    out = lines(drained_reply())
    rows = {line.split()[0]: line for line in out[out.index("devices:") + 2 :]}
    # Its state says it is out (and its health when not healthy); its reason, why it is out.
    assert rows["d3"].split()[1] == "drained" and rows["d3"].endswith(
        "drained by an operator: bad fan"
    )
    assert "failed, drained" in rows["d2"] and "xid 79" not in rows["d2"]
    assert rows["d2"].endswith("drained by an operator: bad fan")
    assert rows["d9"].split()[1] == "quarantined" and rows["d9"].endswith("in 3600 s")
    # The job's not-usable count takes them in; its last failure stays the failure.
    jobs = {line.split()[0]: line.split() for line in out[out.index("jobs:") + 2 :][:2]}
    header = out[out.index("jobs:") + 1].split()
    assert jobs["train"][header.index("unusable")] == "2"
    assert jobs["eval"][header.index("unusable")] == "1"
    assert "device d2 failed: xid 79" in " ".join(jobs["train"])


def test_state_selects_devices_out_of_service() -> None:
    reply = drained_reply()

    def picked(state: sv.StateFilter) -> list[str]:
        return [d.device for d in sv.select(reply, sv.Filters(state=state))[1]]

    assert picked("drained") == ["d2", "d3"]
    assert picked("quarantined") == ["d9"]
    assert picked("healthy") == [reply.devices[0].device]  # in service only
    assert picked("failed") == ["d2"]  # its health, in service or not
    # top shows them among the current failures, with why they are out.
    kinds = {e.device: (e.kind, e.detail) for e in sv.current_failures(reply)}
    assert kinds["d3"] == ("device_drained", "drained by an operator: bad fan")
    assert kinds["d9"][0] == "device_quarantined"
    # At scale, the count of devices not usable has them, and the hints name the states.
    out = lines(reply, limit=1)
    assert any(line.startswith("3 devices not healthy or out of service: --state") for line in out)
    assert any("drained, quarantined), or list" in line for line in out)


def test_library_worker_status_is_filled() -> None:
    text = "\n".join(lines(small_reply()))
    assert "registered" in text
    rows = [line for line in lines(small_reply()) if line.startswith("  train  r1")]
    assert rows and "registered" in rows[0]


@pytest.mark.parametrize(
    ("t", "text"),
    [(0.0, "-"), (NOW - 12.7, "12 s ago"), (NOW - 600, "10 min ago"), (NOW - 7300, "2 h ago")],
)
def test_ages(t: float, text: str) -> None:
    assert sv.age(t, NOW) == text


def test_abbreviation_plural_and_device_list() -> None:
    gpu = "GPU-8e1a4c2b-1f0e-4d2c-9a7b-5c3d2e1f8b31"
    assert sv.abbreviate(gpu) == "GPU-8e1a4c2b…8b31"
    assert sv.abbreviate("tpu-3") == "tpu-3"
    assert sv.device_list([gpu] * 8) == "8: GPU-8e1a4c2b…8b31 +7"
    assert sv.device_list(["d1", "d2"]) == "d1,d2"
    assert sv.device_list([]) == "-"
    assert sv.plural(1, "time") == "1 time" and sv.plural(2, "time") == "2 times"
    assert sv.plural(1000, "replica") == "1,000 replicas"


# --- at scale --------------------------------------------------------------------------------------

JOBS = ("llama", "mixtral", "eval")


def big_reply(replicas: int = 1000, per_replica: int = 8) -> QueryReply:
    """1,000 replicas x 8 NVML-length UUIDs across 3 jobs, some stale, some devices failed."""
    rng = random.Random(7)
    workers, devices = [], []
    for i in range(replicas):
        job = JOBS[i % 3]
        gpus = [f"GPU-{uuid.UUID(int=rng.getrandbits(128))}" for _ in range(per_replica)]
        state = "stale" if i % 97 == 0 else "live"
        workers.append(
            worker(
                job,
                f"r{i:04d}",
                gpus,
                host=f"node-{i // 2:04d}.cluster.example.com",
                state=state,
                epoch=i % 5,
                applied_epoch=i % 5,
                failure_class="gpu_xid" if i % 250 == 1 else "",
                status="running" if i % 2 else "",
            )
        )
        for n, gpu in enumerate(gpus):
            failed = i % 100 == 3 and n == 0
            devices.append(
                DeviceInfo(
                    device=gpu,
                    state="failed" if failed else "healthy",
                    reason="Xid 79: GPU has fallen off the bus" if failed else "",
                    since=NOW - i if failed else 0.0,
                    failures=int(failed),
                    replicas=[f"{job}/r{i:04d}"],
                )
            )
    return QueryReply(controller=controller(), workers=workers, devices=devices)


def test_summary_at_scale_is_short_and_adds_up() -> None:
    reply = big_reply()
    out = lines(reply)
    assert len(out) < 40, "\n".join(out)  # a summary, not thousands of rows
    assert out[2] == "1,000 replicas, 1,000 workers, 8,000 devices"
    summaries = sv.summarize(reply)
    assert [s.job for s in summaries] == sorted(JOBS)
    assert sum(s.replicas for s in summaries) == 1000
    assert sum(s.live + s.stale for s in summaries) == 1000
    assert sum(s.stale for s in summaries) == len([i for i in range(1000) if i % 97 == 0])
    assert sum(s.devices for s in summaries) == 8000
    assert sum(s.unhealthy for s in summaries) == 10
    assert sum(s.restarts for s in summaries) == sum(i % 5 for i in range(1000))
    assert max(s.epoch for s in summaries) == 4
    # The hint says how to see the rows instead of printing them.
    assert any("--replica" in line and "--all" in line for line in out)
    assert not any(line.startswith("workers:") for line in out)
    assert "devices not healthy or out of service:" in out
    # Every job's row is there, whole, with its last failure.
    for job in JOBS:
        row = next(line for line in out if line.startswith(f"  {job} "))
        assert "failed" in row or "gpu_xid" in row


def test_piped_details_at_scale_cut_nothing() -> None:
    reply = big_reply()
    out = lines(reply, sv.Filters(everything=True))
    text = "\n".join(out)
    workers_at = out.index("workers:")
    devices_at = out.index("devices:")
    worker_rows = out[workers_at + 2 : devices_at]
    device_rows = out[devices_at + 2 :]
    assert len(worker_rows) == 1000 and len(device_rows) == 8000
    abbreviations = {sv.abbreviate(d.device) for d in reply.devices}
    for w, row in zip(reply.workers, worker_rows, strict=True):
        cells = row.split()
        # job, replica and host whole, the device count there, the first UUID abbreviated.
        assert cells[:4] == [w.job, w.replica, "0", w.host], row
        assert f"8: {sv.abbreviate(w.devices[0])} +7" in row
    for d, row in zip(reply.devices, device_rows, strict=True):
        assert row.split()[0] == d.device  # the full UUID, never cut
    # The only ellipses are the deliberate UUID abbreviations.
    for line in out:
        for word in line.split():
            if sv.ELLIPSIS in word:
                assert word in abbreviations, line
    assert "..." not in text
    # Aligned: each left-aligned column starts where its name does, in every row.
    header = out[workers_at + 1]
    for name in ("replica", "host", "state", "seen", "devices", "scope", "status", "step"):
        at = header.index(f" {name}") + 1
        assert all(r[at - 1] == " " and r[at] != " " for r in worker_rows), name


@pytest.mark.parametrize("width", [80, 200])
def test_terminal_rendering_cuts_nothing(width: int) -> None:
    """A table that fits is drawn (its free-text column folded); one that cannot is printed as
    plain lines, each row whole on one line (the terminal soft-wraps it), as the CLI does."""
    from rich.console import Console

    reply = big_reply(replicas=30)
    buf = io.StringIO()
    # As monitor_cli.cli's console: soft_wrap, so a long plain line is never cut by rich.
    console = Console(file=buf, width=width, color_system=None, soft_wrap=True)
    for r in sv.rich_renderables(sv.status_blocks(reply, sv.Filters(), NOW), console.width):
        console.print(r)
    text = buf.getvalue()
    printed = text.splitlines()
    for d in reply.devices:
        assert any(d.device in line and d.replicas[0] in line for line in printed), d.device
    for w in reply.workers:
        assert any(f" {w.replica} " in line and w.host in line for line in printed), w.replica
    abbreviations = {sv.abbreviate(d.device) for d in reply.devices}
    for word in text.split():
        if sv.ELLIPSIS in word:
            assert word in abbreviations, word
    if width == 200:
        assert "───" in text  # drawn as rich tables, not the plain fallback
        assert all(len(line) <= width for line in printed)


def test_top_view_lists_recent_failures() -> None:
    reply = small_reply()
    recent = sv.current_failures(reply)
    out = sv.plain_lines(sv.top_blocks(reply, recent, NOW))
    assert out[-2:] == [
        "  when      event          what",
        "  12 s ago  device_failed  device d2 xid 79",
    ]
    out = sv.plain_lines(sv.top_blocks(None, [], NOW, problem="no controller answered"))
    assert out == ["no controller answered", "recent failures and restarts: none"]


def test_a_job_filter_heads_the_output_and_an_empty_match_says_what_else_there_is() -> None:
    reply = small_reply()
    f = sv.Filters(job="train", job_source="from MARDUK_JOB")
    assert lines(reply, f)[2] == "job: train (from MARDUK_JOB)"
    assert sv.Filters(job="train").narrowing is False  # the controller applied it
    empty = QueryReply(controller=controller())
    nosuch = sv.Filters(job="nosuch", job_source="from MARDUK_JOB")
    out = sv.plain_lines(sv.status_blocks(empty, nosuch, NOW, elsewhere=(15, 3)))
    assert out[2:] == [
        "job: nosuch (from MARDUK_JOB)",
        "no worker of job nosuch has registered (15 workers in 3 other jobs)",
    ]
    one = sv.status_blocks(empty, sv.Filters(job="x", job_source="--job"), NOW, elsewhere=(1, 1))
    assert one[-1] == "no worker of job x has registered (1 worker in 1 other job)"
    assert sv.status_blocks(empty, sv.Filters(), NOW)[-1] == "no worker has registered"
    top = sv.plain_lines(sv.top_blocks(reply, [], NOW, job="nosuch", job_source="--job"))
    assert top[1] == "job: nosuch (--job)"


def test_top_shows_each_jobs_performance_before_the_recent_events() -> None:
    from marduk.wire.perf import JobPerf, PerfReply, SlowRank
    from monitor_cli.perf_view import perf_blocks

    slow = SlowRank(
        replica="r1", worker=0, rank=2, section="compute", relative=0.66, individual=0.67,
        ratio=1.5, devices=["gpu-2"], since=NOW - 5,
    )  # fmt: skip
    job = JobPerf(
        job="train", ranks=4, steps_per_s=9.5, step_p50=0.105, step_p90=0.12,
        slowest=[slow], stragglers=[slow],
    )  # fmt: skip
    perf = PerfReply(jobs=[job])
    out = sv.plain_lines(sv.top_blocks(small_reply(), [], NOW, perf=perf_blocks(perf)))
    text = "\n".join(out)
    assert text.index("performance:") < text.index("recent failures and restarts")
    row = next(line for line in out if line.strip().startswith("train ") and "9.50" in line)
    assert "105.0 ms" in row and row.rstrip().endswith("1")
    rank = next(line for line in out if "train/r1/0" in line)
    assert "compute" in rank and "0.66" in rank and "gpu-2" in rank and "straggler" in rank
