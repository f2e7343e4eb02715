"""What ``marduk monitor status`` shows of performance (decisions.md 19): per job its step rate,
p50 step time and stragglers, the slowest ranks with their scores and devices, and the devices
slow in more than one job or incarnation. Pure: the controller's ``PerfReply`` in, blocks out.
"""

from __future__ import annotations

from marduk.wire.perf import PerfReply, SlowRank
from monitor_cli.status_format import Block, Grid, abbreviate, plural


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _rank(r: SlowRank) -> tuple[str, ...]:
    devices = ", ".join(abbreviate(d) for d in r.devices) or "-"
    return (
        f"{r.replica}/{r.worker}",
        str(r.rank),
        r.section,
        f"{r.relative:.2f}",
        f"{r.individual:.2f}",
        f"{r.ratio:.2f}x",
        devices,
        "straggler" if r.since else "",
    )


def perf_blocks(reply: PerfReply | None, job: str | None = None) -> list[Block]:
    """The jobs' performance, their slowest ranks, the repeatedly slow devices. None (an older
    controller, or none answered): nothing."""
    if reply is None:
        return []
    jobs = [j for j in reply.jobs if job is None or j.job == job]
    blocks: list[Block] = []
    if jobs:
        grid = Grid(
            "performance",
            ("job", "ranks", "steps/s", "p50 step", "p90 step", "stragglers"),
            right=frozenset({1, 2, 3, 4, 5}),
        )
        for j in jobs:
            grid.rows.append(
                (
                    j.job,
                    str(j.ranks),
                    f"{j.steps_per_s:.2f}",
                    _ms(j.step_p50),
                    _ms(j.step_p90),
                    (str(len(j.stragglers)), "bold red") if j.stragglers else "0",
                )
            )
        blocks.append(grid)
        slow = Grid(
            "slowest ranks (relative: the job's best / this rank; individual: its best / now)",
            ("worker", "rank", "section", "relative", "individual", "vs median", "devices", ""),
            right=frozenset({1, 3, 4, 5}),
        )
        for j in jobs:
            for r in j.slowest:
                slow.rows.append((f"{j.job}/{_rank(r)[0]}", *_rank(r)[1:]))
        if slow.rows:
            blocks.append(slow)
    if reply.devices:
        grid = Grid(
            f"{plural(len(reply.devices), 'device')} slow in more than one job or incarnation",
            ("device", "detections", "worst relative", "runs"),
            right=frozenset({1, 2}),
            wrap=3,
        )
        for d in reply.devices:
            grid.rows.append(
                (d.device, str(d.detections), f"{d.worst_relative:.2f}", ", ".join(d.jobs))
            )
        blocks.append(grid)
    return blocks
