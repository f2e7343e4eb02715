"""``marduk monitor set`` and ``params``: change a running job's live parameters, and see who
runs which version (decisions.md #20; admin only with auth).

Input is checked here, before anything is sent: a bad name, a value that is not a JSON scalar
or a short list, or one too large is a usage error (exit 2) naming it.
"""

from __future__ import annotations

import getpass
import json
import socket
from typing import Annotated

import msgspec
import typer
from rich.markup import escape

from marduk.shell import options
from marduk.transport import bus
from marduk.wire.params import (
    MAX_DOC_BYTES,
    JobParams,
    ParamsQuery,
    ParamsQueryReply,
    ParamsSet,
    ParamsSetReply,
    ParamValue,
    ParamValueError,
    parse_assignment,
)
from marduk.wire.protocol import JobName, Token
from marduk.wire.subjects import Subjects
from monitor_cli.console import out, print_json, run_command, wire_check
from monitor_cli.health import connect


def _assignments(values: list[str]) -> list[str]:
    for text in values:
        try:
            parse_assignment(text)
        except ParamValueError as e:
            raise typer.BadParameter(str(e)) from None
    return values


def who() -> str:
    """``user@host``, said in the ``params_set`` event (only admins may send a set)."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in a bare container
        user = "unknown"
    return f"{user}@{socket.gethostname()}"[:256]


async def set_params(
    addr: str,
    prefix: str,
    job: str,
    values: dict[str, ParamValue | None],
    *,
    replica: str | None = None,
    if_version: int | None = None,
    timeout: float = 5.0,
) -> ParamsSetReply:
    nc = await connect(addr, timeout=timeout)
    try:
        request = ParamsSet(
            job=job, replica=replica, values=values, by=who(), if_version=if_version
        )
        subject = Subjects(prefix).params_set
        return await bus.request(nc, subject, request, ParamsSetReply, timeout=timeout, addr=addr)
    finally:
        await bus.close(nc, drain=False)


async def get_params(addr: str, prefix: str, job: str, timeout: float = 5.0) -> ParamsQueryReply:
    nc = await connect(addr, timeout=timeout)
    try:
        subject = Subjects(prefix).params_get
        return await bus.request(
            nc, subject, ParamsQuery(job=job), ParamsQueryReply, timeout=timeout, addr=addr
        )
    finally:
        await bus.close(nc, drain=False)


@options.connection_options
def set_(
    job: Annotated[str, typer.Argument(help="The job.", callback=wire_check(JobName))],
    values: Annotated[
        list[str],
        typer.Argument(
            help="KEY=VALUE: VALUE is JSON if it reads as JSON (3e-4, true, [1, 2]), else "
            "text; KEY=null removes the key.",
            metavar="KEY=VALUE...",
            callback=_assignments,
        ),
    ],
    replica: Annotated[
        str | None,
        typer.Option(
            "--replica",
            help="Set these values for this replica only (they override the job's).",
            callback=wire_check(Token),
        ),
    ] = None,
    if_version: Annotated[
        int | None,
        typer.Option(
            "--if-version",
            min=0,
            help="Refuse unless the job's parameters are still at this version.",
        ),
    ] = None,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """Change a running job's live parameters: stored first, then sent to every trainer.

    Trainers read them as ``client.params`` and apply them at a step boundary; a trainer that
    starts later starts with them. ``marduk monitor params JOB`` shows who runs which version.
    """
    changes = dict(parse_assignment(text) for text in values)  # checked by _assignments
    size = len(msgspec.json.encode(changes))
    if size > MAX_DOC_BYTES:
        raise typer.BadParameter(f"the values take {size} bytes (at most {MAX_DOC_BYTES})")
    reply = run_command(
        lambda: set_params(
            addr, prefix, job, changes, replica=replica, if_version=if_version, timeout=timeout
        )
    )
    if as_json:
        print_json(reply)
        return
    p = reply.params
    if not reply.changed:
        out.print(f"job {escape(job)}: nothing changed (version {p.version})")
        return
    now = p.effective(replica) if replica else p.values
    shown = ", ".join(f"{k}={_show(now.get(k))}" for k in reply.changed)
    where = f" replica {escape(replica)}" if replica else ""
    out.print(f"job {escape(job)}{where}: version {p.version}: {escape(shown)}")


@options.connection_options
def params(
    job: Annotated[str, typer.Argument(help="The job.", callback=wire_check(JobName))],
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: options.Timeout = 5.0,
    as_json: options.Json = False,
) -> None:
    """A job's live parameters (desired, with their version) and which version each worker
    applied (or refused, and why)."""
    reply = run_command(lambda: get_params(addr, prefix, job, timeout))
    if as_json:
        print_json(reply)
        return
    for line in params_lines(reply):
        out.print(escape(line))


def params_lines(reply: ParamsQueryReply) -> list[str]:
    p: JobParams = reply.params
    if p.version == 0:
        head = [f"job {p.job}: no parameters set"]
    else:
        head = [f"job {p.job}: version {p.version}, set by {p.set_by or 'unknown'}"]
        head += [f"  {k} = {_show(v)}" for k, v in sorted(p.values.items())]
        for replica, own in sorted(p.overrides.items()):
            head += [f"  {k} = {_show(v)}   (replica {replica})" for k, v in sorted(own.items())]
    rows = []
    for w in reply.workers:
        rows.append(
            f"  {w.replica}/{w.worker}: version {w.version} {w.state}{_refused(w.rejected)}"
        )
        rows += [
            f"    rank {r.rank}: version {r.version} {r.state}{_refused(r.rejected)}"
            for r in w.ranks
        ]
    counts: dict[str, int] = {}
    for w in reply.workers:
        counts[w.state] = counts.get(w.state, 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none"
    return [*head, f"workers: {summary}", *rows]


def _refused(rejected: dict[str, str]) -> str:
    return "".join(f"; {k} refused: {why}" for k, why in sorted(rejected.items()))


def _show(value: ParamValue | None) -> str:
    return "unset" if value is None else json.dumps(value)
