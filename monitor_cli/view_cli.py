"""``marduk monitor status``, ``top`` and ``watch``: the controller's map as tables, live, and
its events as they happen. The tables themselves are the pure ``status_view``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import sys
import time
from typing import Annotated

import msgspec
import typer
from nats.aio.msg import Msg
from rich.console import Group
from rich.live import Live
from rich.markup import escape

from marduk.errors import MardukError, PermissionDeniedError
from marduk.shell import options
from marduk.transport import bus
from marduk.wire.perf import PerfReply
from marduk.wire.protocol import ControllerEvent, QueryReply, decode
from marduk.wire.subjects import Subjects
from monitor_cli import client, perf_view, status_view
from monitor_cli.console import err, job_source, out, print_json, run_command, show, ts


def _filtered(reply: QueryReply, f: status_view.Filters) -> QueryReply:
    if not f.narrowing:
        return reply
    workers, devices = status_view.select(reply, f)
    return msgspec.structs.replace(reply, workers=workers, devices=devices)


State = Annotated[
    status_view.StateFilter | None,
    typer.Option(
        "--state",
        help="Only workers in this state (live, stale) or devices in this one, and what they "
        "touch: their health (failed, degraded, preempting; healthy: and in service) or out of "
        "service (drained by an operator, quarantined for flapping).",
        show_default=False,
    ),
]


@options.connection_options
def status(
    ctx: typer.Context,
    job: options.Job = None,
    replica: Annotated[
        str | None, typer.Option("--replica", "-r", help="Only this replica (id).")
    ] = None,
    state: State = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            "-d",
            help="Only this device: its id, a prefix, or the abbreviation status shows.",
        ),
    ] = None,
    host: Annotated[str | None, typer.Option("--host", help="Only workers on this host.")] = None,
    all_: Annotated[
        bool, typer.Option("--all", "-a", help="List every worker, however many.")
    ] = False,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Show the jobs (summary first), then the workers and devices a filter selects.

    With more than 50 workers and no filter but --job, only the summary is shown, with how to
    see details. In a pipe the tables are plain aligned lines (never cut to the width).
    --json prints the controller's QueryReply (with filters: only the matching workers and
    devices).
    """
    f = status_view.Filters(
        replica=replica,
        state=state,
        device=device,
        host=host,
        everything=all_,
        job=job,
        job_source=job_source(ctx, job),
    )
    reply = run_command(lambda: client.query(addr, prefix, "map", job, timeout))
    if as_json:
        print_json(_filtered(reply, f))
        return
    elsewhere = None
    if job is not None and not reply.workers and not reply.devices:  # a typo, or a stale variable?
        whole = run_command(lambda: client.query(addr, prefix, "map", None, timeout))
        elsewhere = (len(whole.workers), len({w.job for w in whole.workers}))
    blocks = status_view.status_blocks(reply, f, time.time(), elsewhere=elsewhere)
    if reply.workers:
        wait = min(timeout, 2.0)
        perf = run_command(lambda: client.perf(addr, prefix, job, wait))
        blocks += perf_view.perf_blocks(perf, job)
    show(blocks)


@options.connection_options
def top(
    ctx: typer.Context,
    job: options.Job = None,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    count: Annotated[
        int, typer.Option(help="Stop after this many refreshes (0: until Ctrl-C).", min=0)
    ] = 0,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.", min=0.1)] = 1.0,
    once: Annotated[
        bool, typer.Option("--once", help="One refresh, as plain lines, then exit (scripts).")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="With --once: the jobs' performance (the controller's PerfReply) as one line "
            "of JSON.",
        ),
    ] = False,
) -> None:
    """A live view of the jobs until Ctrl-C: their size, per job its step rate, p50 step
    time, slowest ranks (scores, devices) and stragglers, and recent failures and restarts.

    On a terminal the view redraws in place; in a pipe each refresh is a block of plain lines.
    """

    source = job_source(ctx, job)
    if as_json and not once:
        raise typer.BadParameter("only with --once", param_hint="--json")
    if once:
        count = 1

    async def loop() -> None:
        recent: collections.deque[ControllerEvent] = collections.deque(maxlen=10)
        s = Subjects(prefix)
        nc = await client.connect(addr, "marduk-monitor-top", timeout, reconnect=True)

        async def on_event(msg: Msg) -> None:
            try:
                event = decode(msg.data, ControllerEvent)
            except ValueError:
                return
            if event.kind in status_view.RECENT_KINDS:
                recent.appendleft(event)

        live = Live(console=out, auto_refresh=False) if out.is_terminal and not once else None
        try:
            await client.subscribe(nc, s.all_events if job is None else s.events(job), cb=on_event)
            reply: QueryReply | None = None
            with live if live is not None else contextlib.nullcontext():
                for n in itertools.count(1):
                    problem = ""
                    perf: PerfReply | None = None
                    try:
                        if as_json:
                            perf = await client.perf_on(nc, prefix, job, timeout)
                            if perf is None:
                                raise MardukError("no controller answered the performance query")
                            print_json(perf)
                            return
                        first = reply is None
                        reply = await client.query_on(nc, prefix, "map", job, timeout, addr=addr)
                        if first:
                            recent.extend(status_view.current_failures(reply))
                        if reply.workers:
                            perf = await client.perf_on(nc, prefix, job, min(timeout, 2.0))
                    except PermissionDeniedError:
                        raise  # asking again will not help: one line, and stop
                    except MardukError as e:
                        if as_json:
                            raise
                        problem = f"{ts(time.time())} {e}"
                    blocks = status_view.top_blocks(
                        reply,
                        list(recent),
                        time.time(),
                        problem=problem,
                        job=job,
                        job_source=source,
                        perf=perf_view.perf_blocks(perf, job),
                    )
                    if live is not None:
                        live.update(
                            Group(*status_view.rich_renderables(blocks, out.width)), refresh=True
                        )
                    else:
                        lines = [f"--- {ts(time.time())}", *status_view.plain_lines(blocks)]
                        sys.stdout.write("".join(line + "\n" for line in lines))
                        sys.stdout.flush()
                    if count and n >= count:
                        return
                    await asyncio.sleep(interval)
        finally:
            await bus.close(nc, drain=False)

    run_command(loop)


def _event_line(e: ControllerEvent) -> str:
    where = "/".join(str(p) for p in (e.job, e.replica, e.worker) if p is not None)
    parts = [ts(e.ts), e.kind, where, f"device {e.device}" if e.device else ""]
    if e.epoch is not None and e.kind.endswith("_issued"):
        parts.append(f"epoch {e.epoch}")
    line = " ".join(p for p in parts if p)
    return line + (f" - {e.detail}" if e.detail else "")


@options.connection_options
def watch(
    ctx: typer.Context,
    job: options.Job = None,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
    count: Annotated[
        int, typer.Option(help="Stop after this many events (0: until Ctrl-C).", min=0)
    ] = 0,
) -> None:
    """Stream controller events live (registrations, failures, restarts) until Ctrl-C.

    Also says (on stderr) when NATS goes away and comes back, when the controller stops
    answering, and when one serves again.
    """

    source = job_source(ctx, job)

    async def loop() -> None:
        seen = 0

        def ready() -> None:  # on stderr, so --json output stays pure
            of = f" of job {escape(job)} ({source})" if job is not None else ""
            err.print(f"watching controller events{of} (Ctrl-C to stop)")

        async for e in client.events(addr, prefix, job, timeout, on_ready=ready):
            if isinstance(e, client.Notice):  # on stderr too: NATS or the controller came or went
                colour = "green" if e.kind in ("nats_back", "controller_serving") else "yellow"
                err.print(f"[{colour}]{escape(ts(time.time()))} {escape(e.text)}[/]")
                continue
            if isinstance(e, bytes):
                err.print(f"[yellow]undecodable event:[/yellow] {e[:200]!r}")
                continue
            if as_json:
                print_json(e)
            else:
                colour = _EVENT_STYLE.get(e.kind, "")
                line = escape(_event_line(e))
                out.print(f"[{colour}]{line}[/]" if colour else line)
            seen += 1
            if count and seen >= count:
                return

    run_command(loop)


_EVENT_STYLE: dict[str, str] = {
    "restart_issued": "bold yellow",
    "fail_issued": "bold red",
    "unknown_device": "magenta",
    "device_failed": "red",
    "straggler_detected": "bold magenta",
    "straggler_cleared": "green",
    "straggler_acted": "bold yellow",
}
