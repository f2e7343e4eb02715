"""``marduk monitor`` commands. Errors are one line on stderr and a non-zero exit, never a trace."""

from __future__ import annotations

import datetime as dt
import enum
import json
import logging
import sys
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, TypeVar

import msgspec
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from marduk import options
from marduk.errors import MardukError
from marduk.protocol import ControllerEvent, HealthReply, QueryReply
from marduk.runtime import run
from monitor_cli import client

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


class FailureState(enum.StrEnum):
    failed = "failed"
    degraded = "degraded"


def _run(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    try:
        return run(factory())
    except client.UndecidedError as e:
        err.print(f"[yellow]warning:[/yellow] {e}")
        raise typer.Exit(EXIT_UNDECIDED) from None
    except MardukError as e:
        err.print(f"[red]error:[/red] {e}")
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
            f"device [bold]{reply.device}[/bold] is unknown to the controller: "
            "no replica uses it, nobody was told"
        )
        return
    if not reply.actions:
        out.print(f"device [bold]{reply.device}[/bold] marked {reply.state}; no replica restarted")
        return
    out.print(
        f"device [bold]{reply.device}[/bold] {reply.state}: "
        f"{len(reply.actions)} restart scope(s) acted on"
    )
    table = Table("job", "replica", "command", "epoch", "note")
    for a in reply.actions:
        table.add_row(
            a.job,
            a.replica or "(whole job)",
            a.kind,
            str(a.epoch),
            "already in flight" if a.coalesced else "sent",
        )
    out.print(table)


@app.command("inject-failure")
@options.connection_options
def inject_failure(
    device: Annotated[str, typer.Argument(help="UUID of the device, as agents registered it.")],
    reason: Annotated[str, typer.Option(help="Why (free text, shown to the replicas).")] = "",
    state: Annotated[
        FailureState,
        typer.Option(
            help="failed: restart the replicas using it; degraded: report only (by default).",
        ),
    ] = FailureState.failed,
    source: Annotated[str, typer.Option(help="Who reports it.")] = "marduk-monitor",
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Publish a device health event as a monitor would; print which replicas were acted on."""
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
    out.print(f"removed {len(reply.removed)} worker(s): " + ", ".join(reply.removed))


def _ts(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S") if t else "-"


def _status_tables(reply: QueryReply) -> list[Table]:
    workers = Table(title="replicas", title_justify="left")
    for col in (
        "job",
        "replica",
        "worker",
        "host",
        "devices",
        "scope",
        "epoch",
        "role",
        "pid",
        "state",
        "status",
        "step",
    ):
        workers.add_column(col)
    for w in reply.workers:
        epoch = str(w.epoch) if w.applied_epoch >= w.epoch else f"{w.applied_epoch}->{w.epoch}"
        workers.add_row(
            w.job,
            w.replica,
            str(w.worker),
            w.host,
            ",".join(w.devices) or "-",
            w.scope,
            epoch,
            w.role,
            str(w.pid),
            "[yellow]stale[/]" if w.state == "stale" else "live",
            w.status + (f" ({w.failure_class})" if w.failure_class else ""),
            "-" if w.step is None else f"{w.step} at {_ts(w.step_at)}",
        )
    devices = Table(title="devices", title_justify="left")
    for col in ("device", "state", "since", "failures", "replicas", "reason"):
        devices.add_column(col)
    style = {"failed": "red", "degraded": "yellow", "healthy": "green"}
    for d in reply.devices:
        devices.add_row(
            d.device,
            f"[{style.get(d.state, 'magenta')}]{d.state}[/]",
            _ts(d.since),
            str(d.failures),
            ",".join(d.replicas) or "-",
            d.reason,
        )
    return [workers, devices]


@app.command()
@options.connection_options
def status(
    job: options.Job = None,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Show the device<->replica map, device states and the controller's counters."""
    reply = _run(lambda: client.query(addr, prefix, "map", job, timeout))
    if as_json:
        _print_json(reply)
        return
    c = reply.controller
    out.print(
        f"controller {c.controller_id} (leader, term {c.term}, pid {c.pid} on {c.host or '?'}, "
        f"v{c.version}, up since {_ts(c.started_at)}), "
        f"{len(reply.workers)} worker(s), {len(reply.devices)} device(s)"
    )
    if reply.standbys:
        out.print(
            "standbys: "
            + ", ".join(
                f"{s.controller_id} (pid {s.pid} on {s.host or '?'})" for s in reply.standbys
            )
        )
    else:
        out.print("standbys: none")
    for table in _status_tables(reply):
        out.print(table)
    rejected = {k: v for k, v in reply.stats.items() if k.startswith("rejected.")}
    if rejected:
        out.print("rejected messages: " + ", ".join(f"{k[9:]}={v}" for k, v in rejected.items()))


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
    """Stream controller events live (registrations, failures, restarts) until Ctrl-C."""

    async def loop() -> None:
        seen = 0

        def ready() -> None:  # on stderr, so --json output stays pure
            err.print("watching controller events (Ctrl-C to stop)")

        async for e in client.events(addr, prefix, job, timeout, on_ready=ready):
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
