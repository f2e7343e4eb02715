"""``marduk monitor forget``, ``drain`` and ``undrain``: an operator changes the map or takes
devices out of service (admin only with auth).
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from marduk.shell import options
from marduk.wire.protocol import DeviceId, DrainReply, JobName, ShortText, Text, Token, WorkerRef
from monitor_cli import client
from monitor_cli.console import (
    EXIT_UNKNOWN_DEVICE,
    err,
    out,
    print_json,
    run_command,
    wire_check,
)
from monitor_cli.status_view import plural


def _target(target: str) -> str:
    """``forget``'s JOB[/REPLICA[/WORKER]], each part as the wire takes it (a usage error)."""
    parts = target.split("/")
    if not 1 <= len(parts) <= 3 or not all(parts):
        raise typer.BadParameter(f"{target!r} is not JOB, JOB/REPLICA or JOB/REPLICA/WORKER")
    wire_check(JobName)(parts[0])
    wire_check(Token)(parts[1:2])
    if len(parts) > 2 and not parts[2].isdigit():
        raise typer.BadParameter(f"{target!r}: WORKER is a number (0, 1, ...)")
    return target


@options.connection_options
def forget(
    target: Annotated[
        str,
        typer.Argument(
            help="JOB, JOB/REPLICA or JOB/REPLICA/WORKER to remove from the map.",
            metavar="JOB[/REPLICA[/WORKER]]",
            callback=_target,
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
    parts = target.split("/")  # checked by _target
    job, replica = parts[0], parts[1] if len(parts) > 1 else None
    worker = int(parts[2]) if len(parts) > 2 else None
    reply = run_command(lambda: client.forget(addr, prefix, job, replica, worker, timeout))
    if as_json:
        print_json(reply)
        return
    if not reply.removed:
        out.print(f"nothing registered matches {target}")
        return
    out.print(f"removed {plural(len(reply.removed), 'worker')}: " + ", ".join(reply.removed))


def _drain(devices: list[str], host: str, undrain: bool, reason: str, addr: str, prefix: str,
           timeout: float, as_json: bool) -> None:  # fmt: skip
    if not devices and not host:
        raise typer.BadParameter("none given: name DEVICE(s) or --host HOST", param_hint="DEVICE")
    reply = run_command(
        lambda: client.drain(
            addr, prefix, devices, host, undrain=undrain, reason=reason, timeout=timeout
        )
    )
    # A named device that did not change: out of service already (or in service, for undrain),
    # or unknown to the controller (a typo?), which exits 3 as inject-failure does.
    unknown: list[str] = []
    if any(d not in reply.devices for d in devices):
        known = run_command(lambda: client.query(addr, prefix, "devices", None, timeout))
        names = {d.device for d in known.devices}
        unknown = [d for d in devices if d not in names]
    if as_json:
        print_json(reply)
    else:
        _say_drained(reply, undrain, unknown)
    if unknown:
        raise typer.Exit(EXIT_UNKNOWN_DEVICE)


def _say_drained(reply: DrainReply, undrain: bool, unknown: list[str]) -> None:
    for conflict in reply.conflicts:
        err.print(f"[yellow]warning:[/yellow] conflicting claim: {escape(conflict)}")
    for name in unknown:
        out.print(
            f"device [bold]{escape(name)}[/bold] is unknown to the controller: no registered "
            "worker uses it, nothing changed"
        )
    verb = "back in service" if undrain else "drained"
    if not reply.devices:
        if not unknown:
            where = "out of service" if undrain else "in service"
            out.print(f"nothing changed: no matching device is {where}")
        return
    out.print(f"{plural(len(reply.devices), 'device')} {verb}: " + ", ".join(reply.devices))
    for line in drain_lines(reply):
        out.print(escape(line))


def drain_lines(reply: DrainReply) -> list[str]:
    """What a drain did to each restart scope: ``fail`` sent; in a job whose ranks the
    controller assigns, which member it retired and who took its ranks, and the job's size from
    its new epoch (``members_out``; an older controller's reply names only the restart)."""
    lines = []
    for a in reply.actions:
        gone = [m for m in reply.members_out if m.job == a.job and m.epoch == a.epoch]
        if a.replica is not None or not gone:
            lines.append(
                f"  {a.kind} sent to {a.job}/{a.replica or '(whole job)'} (epoch {a.epoch})"
            )
            continue
        for m in gone:
            what = (
                f"spare {_ref(m.spare)} takes node rank {m.spare_node_rank}"
                if m.spare is not None
                else "no spare fits"
            )
            lines.append(f"  {_ref(m.member)} (node rank {m.node_rank}) retired (exits 71); {what}")
        last = gone[-1]
        nodes = f"{plural(last.nodes, 'node')} (world size {last.world_size})"
        if not last.nodes:
            lines.append(
                f"  job {a.job} is held below its MIN at epoch {a.epoch}: it forms again once "
                "enough workers are registered"
            )
        elif any(m.spare is None for m in gone):
            lines.append(f"  job {a.job} shrinks to {nodes} at epoch {a.epoch}")
        else:
            lines.append(f"  job {a.job} restarts at epoch {a.epoch} with {nodes}")
    return lines


def _ref(w: WorkerRef) -> str:
    return f"{w.replica}/{w.worker}"


Devices = Annotated[
    list[str] | None,
    typer.Argument(
        help="Device ids, as agents registered them.",
        metavar="[DEVICE]...",
        show_default=False,
        callback=wire_check(DeviceId),
    ),
]
Host = Annotated[
    str,
    typer.Option(
        "--host",
        help="Every device registered from this host.",
        show_default=False,
        callback=wire_check(ShortText),
    ),
]


@options.connection_options
def drain(
    devices: Devices = None,
    host: Host = "",
    reason: Annotated[
        str,
        typer.Option(help="Why (shown to the replicas and in status).", callback=wire_check(Text)),
    ] = "",
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Take devices out of service: every replica using them gets 'fail' (its pod goes back
    to the scheduler), and a worker registering with one is refused. Admin only with auth.

    In a job whose ranks the controller assigns (--nnodes MIN:MAX) only the member on the device
    retires (exits 71): a spare takes its ranks, or the job shrinks (or is held below MIN); the
    lines say which, and the job's size at its new epoch.

    Exit codes: 0 done (or nothing to change); 1 error; 3 a named device is unknown to the
    controller: no registered worker uses it (with --json too).
    """
    _drain(devices or [], host, False, reason, addr, prefix, timeout, as_json)


@options.connection_options
def undrain(
    devices: Devices = None,
    host: Host = "",
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Put drained or quarantined (flapping) devices back in service; clears their history.

    Exit codes: 0 done (or nothing to change); 1 error; 3 a named device is unknown to the
    controller (with --json too).
    """
    _drain(devices or [], host, True, "", addr, prefix, timeout, as_json)
