"""``marduk monitor`` commands. Errors are one line on stderr and a non-zero exit, never a trace."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import enum
import itertools
import json
import logging
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, TypeVar

import msgspec
import typer
from nats.aio.msg import Msg
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape

from marduk.errors import MardukError, PermissionDeniedError
from marduk.shell import options
from marduk.shell.runtime import run
from marduk.transport import bus
from marduk.wire.protocol import ControllerEvent, HealthReply, QueryReply, decode
from marduk.wire.subjects import Subjects
from monitor_cli import client, status_view
from monitor_cli.status_view import plural

app = typer.Typer(
    help="Publish device health events, inspect the device<->replica map, watch the controller.",
    no_args_is_help=True,
)
out = Console(highlight=False, soft_wrap=True)
# soft_wrap: an error stays one line in a pipe or a narrow terminal (grep-able, no wrapping).
err = Console(stderr=True, highlight=False, soft_wrap=True)
# Warnings the bus logs (e.g. a permission violation) reach the user as the command's error
# line; without this, Python's last-resort handler would print them a second time.
logging.getLogger("marduk").addHandler(logging.NullHandler())
T = TypeVar("T")

EXIT_ERROR = 1
# The event is stored durably but no controller decided in time (it will be handled later).
EXIT_UNDECIDED = 2
# inject-failure: no registered worker uses the device (a typo, or a device never registered).
EXIT_UNKNOWN_DEVICE = 3


class FailureState(enum.StrEnum):
    failed = "failed"
    degraded = "degraded"
    preempting = "preempting"


def _run(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    try:
        return run(factory())
    except client.UndecidedError as e:
        err.print(f"[yellow]warning:[/yellow] {escape(str(e))}")
        raise typer.Exit(EXIT_UNDECIDED) from None
    except MardukError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(msgspec.to_builtins(obj)) + "\n")
    sys.stdout.flush()


def _report(reply: HealthReply, as_json: bool) -> None:
    if as_json:
        _print_json(reply)
        return
    if reply.duplicate:
        out.print(f"event {reply.event_id} was already handled; nothing new was sent")
    if not reply.known:
        out.print(
            f"device [bold]{escape(reply.device)}[/bold] is unknown to the controller: "
            "no replica uses it, nobody was told"
        )
        return
    if not reply.actions:
        out.print(
            f"device [bold]{escape(reply.device)}[/bold] marked {reply.state}; no replica restarted"
        )
        return
    out.print(
        f"device [bold]{escape(reply.device)}[/bold] {reply.state}: "
        f"{plural(len(reply.actions), 'restart scope')} acted on"
    )
    rows: list[tuple[status_view.Cell, ...]] = [
        (
            a.job,
            a.replica or "(whole job)",
            a.kind,
            str(a.epoch),
            "already in flight" if a.coalesced else "sent",
        )
        for a in reply.actions
    ]
    columns = ("job", "replica", "command", "epoch", "note")
    _show([status_view.Grid("", columns, rows, right=frozenset({3}))])


@app.command("inject-failure")
@options.connection_options
def inject_failure(
    device: Annotated[str, typer.Argument(help="UUID of the device, as agents registered it.")],
    reason: Annotated[str, typer.Option(help="Why (free text, shown to the replicas).")] = "",
    state: Annotated[
        FailureState,
        typer.Option(
            help="failed: restart the replicas using it; degraded: report only (by default); "
            "preempting: ask them to checkpoint now (the host is going away).",
        ),
    ] = FailureState.failed,
    source: Annotated[str, typer.Option(help="Who reports it.")] = "marduk-monitor",
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Publish a device health event as a monitor would; print which replicas were acted on.

    Exit codes: 0 acted on (or recorded); 1 error; 2 stored, but no controller decided in time
    (it will be); 3 the device is unknown: no registered worker uses it (with --json too).
    """
    reply = _run(
        lambda: client.publish_health(
            addr,
            prefix,
            device,
            state.value,
            reason=reason or "injected by marduk monitor",
            source=source,
            timeout=timeout,
        )
    )
    _report(reply, as_json)
    if not reply.known:
        raise typer.Exit(EXIT_UNKNOWN_DEVICE)


@app.command("mark-healthy")
@options.connection_options
def mark_healthy(
    device: Annotated[
        str | None, typer.Argument(help="UUID of the device (omit with --all).", show_default=False)
    ] = None,
    all_: Annotated[
        bool,
        typer.Option("--all", help="Every device the controller shows failed or degraded."),
    ] = False,
    reason: Annotated[str, typer.Option(help="Why (e.g. 'replaced').")] = "",
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Report a device healthy again: clears its failure history (and its escalation)."""
    if (device is None) == (not all_):
        err.print("[red]error:[/red] give a DEVICE or --all (not both)")
        raise typer.Exit(EXIT_ERROR)

    async def devices() -> list[str]:
        if device is not None:
            return [device]
        reply = await client.query(addr, prefix, "devices", None, timeout)
        return [d.device for d in reply.devices if d.state != "healthy"]

    names = _run(devices)
    if not names:
        out.print("no device is failed or degraded; nothing to do")
    for name in names:
        reply = _run(
            lambda name=name: client.publish_health(  # type: ignore[misc]
                addr, prefix, name, "healthy", reason=reason, timeout=timeout
            )
        )
        _report(reply, as_json)


@app.command()
@options.connection_options
def forget(
    target: Annotated[
        str,
        typer.Argument(
            help="JOB, JOB/REPLICA or JOB/REPLICA/WORKER to remove from the map.",
            metavar="JOB[/REPLICA[/WORKER]]",
        ),
    ],
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Remove workers that will not come back (their devices, if nobody else uses them, too).

    A worker that is still alive registers again at its next renewal.
    """
    parts = target.split("/")
    try:
        if not 1 <= len(parts) <= 3 or not all(parts):
            raise ValueError
        job, replica = parts[0], parts[1] if len(parts) > 1 else None
        worker = int(parts[2]) if len(parts) > 2 else None
    except ValueError:
        err.print(f"[red]error:[/red] {target!r} is not JOB, JOB/REPLICA or JOB/REPLICA/WORKER")
        raise typer.Exit(EXIT_ERROR) from None
    reply = _run(lambda: client.forget(addr, prefix, job, replica, worker, timeout))
    if as_json:
        _print_json(reply)
        return
    if not reply.removed:
        out.print(f"nothing registered matches {target}")
        return
    out.print(f"removed {plural(len(reply.removed), 'worker')}: " + ", ".join(reply.removed))


def _drain(devices: list[str], host: str, undrain: bool, reason: str, addr: str, prefix: str,
           timeout: float, as_json: bool) -> None:  # fmt: skip
    if not devices and not host:
        err.print("[red]error:[/red] name DEVICE(s) or --host HOST")
        raise typer.Exit(EXIT_ERROR)
    reply = _run(
        lambda: client.drain(
            addr, prefix, devices, host, undrain=undrain, reason=reason, timeout=timeout
        )
    )
    if as_json:
        _print_json(reply)
        return
    for conflict in reply.conflicts:
        err.print(f"[yellow]warning:[/yellow] conflicting claim: {escape(conflict)}")
    verb = "back in service" if undrain else "drained"
    if not reply.devices:
        where = "out of service" if undrain else "in service"
        out.print(f"nothing changed: no matching device is {where}")
        return
    out.print(f"{plural(len(reply.devices), 'device')} {verb}: " + ", ".join(reply.devices))
    for a in reply.actions:
        out.print(f"  fail sent to {a.job}/{a.replica or '(whole job)'} (epoch {a.epoch})")


Devices = Annotated[
    list[str] | None,
    typer.Argument(
        help="Device ids, as agents registered them.", metavar="[DEVICE]...", show_default=False
    ),
]
Host = Annotated[
    str, typer.Option("--host", help="Every device registered from this host.", show_default=False)
]


@app.command()
@options.connection_options
def drain(
    devices: Devices = None,
    host: Host = "",
    reason: Annotated[str, typer.Option(help="Why (shown to the replicas and in status).")] = "",
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Take devices out of service: every replica using them gets 'fail' (its pod goes back
    to the scheduler), and a worker registering with one is refused. Admin only with auth."""
    _drain(devices or [], host, False, reason, addr, prefix, timeout, as_json)


@app.command()
@options.connection_options
def undrain(
    devices: Devices = None,
    host: Host = "",
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Put drained or quarantined (flapping) devices back in service; clears their history."""
    _drain(devices or [], host, True, "", addr, prefix, timeout, as_json)


def _ts(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S") if t else "-"


def _show(blocks: list[status_view.Block]) -> None:
    """Rich tables on a terminal; plain aligned lines in a pipe (rich would cut cells)."""
    if out.is_terminal:
        for r in status_view.rich_renderables(blocks, out.width):
            out.print(r)
    else:
        sys.stdout.write("".join(line + "\n" for line in status_view.plain_lines(blocks)))
        sys.stdout.flush()


def _filtered(reply: QueryReply, f: status_view.Filters) -> QueryReply:
    if not f.narrowing:
        return reply
    workers, devices = status_view.select(reply, f)
    return msgspec.structs.replace(reply, workers=workers, devices=devices)


State = Annotated[
    status_view.StateFilter | None,
    typer.Option(
        "--state",
        help="Only workers in this state (live, stale) or devices in this one (failed, "
        "degraded, preempting, healthy), and what they touch.",
        show_default=False,
    ),
]


@app.command()
@options.connection_options
def status(
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
    f = status_view.Filters(replica=replica, state=state, device=device, host=host, everything=all_)
    reply = _run(lambda: client.query(addr, prefix, "map", job, timeout))
    if as_json:
        _print_json(_filtered(reply, f))
        return
    _show(status_view.status_blocks(reply, f, time.time()))


@app.command()
@options.connection_options
def top(
    job: options.Job = None,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    count: Annotated[
        int, typer.Option(help="Stop after this many refreshes (0: until Ctrl-C).", min=0)
    ] = 0,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.", min=0.1)] = 1.0,
) -> None:
    """A live view of the jobs, their restarts and recent failures, until Ctrl-C.

    On a terminal the view redraws in place; in a pipe each refresh is a block of plain lines.
    """

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

        live = Live(console=out, auto_refresh=False) if out.is_terminal else None
        try:
            await client.subscribe(nc, s.all_events if job is None else s.events(job), cb=on_event)
            reply: QueryReply | None = None
            with live if live is not None else contextlib.nullcontext():
                for n in itertools.count(1):
                    problem = ""
                    try:
                        first = reply is None
                        reply = await client.query_on(nc, prefix, "map", job, timeout, addr=addr)
                        if first:
                            recent.extend(status_view.current_failures(reply))
                    except PermissionDeniedError:
                        raise  # asking again will not help: one line, and stop
                    except MardukError as e:
                        problem = f"{_ts(time.time())} {e}"
                    blocks = status_view.top_blocks(
                        reply, list(recent), time.time(), problem=problem
                    )
                    if live is not None:
                        live.update(
                            Group(*status_view.rich_renderables(blocks, out.width)), refresh=True
                        )
                    else:
                        lines = [f"--- {_ts(time.time())}", *status_view.plain_lines(blocks)]
                        sys.stdout.write("".join(line + "\n" for line in lines))
                        sys.stdout.flush()
                    if count and n >= count:
                        return
                    await asyncio.sleep(interval)
        finally:
            await bus.close(nc, drain=False)

    _run(loop)


def _event_line(e: ControllerEvent) -> str:
    where = "/".join(str(p) for p in (e.job, e.replica, e.worker) if p is not None)
    parts = [_ts(e.ts), e.kind, where, f"device {e.device}" if e.device else ""]
    if e.epoch is not None and e.kind.endswith("_issued"):
        parts.append(f"epoch {e.epoch}")
    line = " ".join(p for p in parts if p)
    return line + (f" - {e.detail}" if e.detail else "")


@app.command()
@options.connection_options
def watch(
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

    async def loop() -> None:
        seen = 0

        def ready() -> None:  # on stderr, so --json output stays pure
            err.print("watching controller events (Ctrl-C to stop)")

        async for e in client.events(addr, prefix, job, timeout, on_ready=ready):
            if isinstance(e, client.Notice):  # on stderr too: NATS or the controller came or went
                colour = "green" if e.kind in ("nats_back", "controller_serving") else "yellow"
                err.print(f"[{colour}]{escape(_ts(time.time()))} {escape(e.text)}[/]")
                continue
            if isinstance(e, bytes):
                err.print(f"[yellow]undecodable event:[/yellow] {e[:200]!r}")
                continue
            if as_json:
                _print_json(e)
            else:
                colour = _EVENT_STYLE.get(e.kind, "")
                line = escape(_event_line(e))
                out.print(f"[{colour}]{line}[/]" if colour else line)
            seen += 1
            if count and seen >= count:
                return

    _run(loop)


_EVENT_STYLE: dict[str, str] = {
    "restart_issued": "bold yellow",
    "fail_issued": "bold red",
    "unknown_device": "magenta",
    "device_failed": "red",
}


def _mount() -> None:
    """The host daemon and the Alertmanager receiver live in their own modules."""
    from monitor_cli import run_cli
    from monitor_cli.alertmanager_cli import app as alertmanager_app

    app.command("run", help=run_cli.HELP)(run_cli.run)
    app.add_typer(alertmanager_app)


_mount()
