"""``marduk monitor inject-failure`` and ``mark-healthy``: publish device health events as a
monitor would, and say what the controller did.
"""

from __future__ import annotations

import enum
from typing import Annotated

import typer
from rich.markup import escape

from marduk.shell import options
from marduk.wire.protocol import DeviceId, HealthReply, ShortText, Text
from monitor_cli import client, status_view
from monitor_cli.console import (
    EXIT_UNKNOWN_DEVICE,
    out,
    print_json,
    run_command,
    show,
    wire_check,
)
from monitor_cli.status_view import plural


class FailureState(enum.StrEnum):
    failed = "failed"
    degraded = "degraded"
    preempting = "preempting"


def _report(reply: HealthReply, as_json: bool) -> None:
    if as_json:
        print_json(reply)
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
    show([status_view.Grid("", columns, rows, right=frozenset({3}))])


@options.connection_options
def inject_failure(
    device: Annotated[
        str,
        typer.Argument(
            help="UUID of the device, as agents registered it.",
            metavar="DEVICE",
            callback=wire_check(DeviceId),
        ),
    ],
    reason: Annotated[
        str, typer.Option(help="Why (free text, shown to the replicas).", callback=wire_check(Text))
    ] = "",
    state: Annotated[
        FailureState,
        typer.Option(
            help="failed: restart the replicas using it; degraded: report only (by default); "
            "preempting: ask them to checkpoint now (the host is going away).",
        ),
    ] = FailureState.failed,
    source: Annotated[
        str, typer.Option(help="Who reports it.", callback=wire_check(ShortText))
    ] = "marduk-monitor",
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Publish a device health event as a monitor would; print which replicas were acted on.

    Exit codes: 0 acted on (or recorded); 1 error; 2 stored, but no controller decided in time
    (it will be); 3 the device is unknown: no registered worker uses it (with --json too).
    """
    reply = run_command(
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


@options.connection_options
def mark_healthy(
    device: Annotated[
        str | None,
        typer.Argument(
            help="UUID of the device (omit with --all).",
            metavar="DEVICE",
            show_default=False,
            callback=wire_check(DeviceId),
        ),
    ] = None,
    all_: Annotated[
        bool,
        typer.Option("--all", help="Every device the controller shows failed or degraded."),
    ] = False,
    reason: Annotated[
        str, typer.Option(help="Why (e.g. 'replaced').", callback=wire_check(Text))
    ] = "",
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Report a device healthy again: clears its failure history (and its escalation).

    Exit codes: 0 done; 1 error; 2 stored, but no controller decided in time (it will be);
    3 the device is unknown: no registered worker uses it (with --json too).
    """
    if (device is None) == (not all_):
        raise typer.BadParameter("give a DEVICE or --all (not both)", param_hint="DEVICE")

    async def devices() -> list[str]:
        if device is not None:
            return [device]
        reply = await client.query(addr, prefix, "devices", None, timeout)
        return [d.device for d in reply.devices if d.state != "healthy"]

    names = run_command(devices)
    unknown = False
    if not names:
        out.print("no device is failed or degraded; nothing to do")
    for name in names:
        reply = run_command(
            lambda name=name: client.publish_health(  # type: ignore[misc]
                addr, prefix, name, "healthy", reason=reason, timeout=timeout
            )
        )
        _report(reply, as_json)
        unknown = unknown or not reply.known
    if unknown:
        raise typer.Exit(EXIT_UNKNOWN_DEVICE)
