"""What every ``marduk monitor`` command shares: its consoles, exit codes, and running a
command's coroutine so that an error is one line on stderr and a non-zero exit, never a trace.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import typing
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgspec
import typer
from rich.console import Console
from rich.markup import escape

from marduk.errors import MardukError
from marduk.shell.runtime import run
from marduk.wire.protocol import PATTERN_TEXT
from monitor_cli import client, status_view

out = Console(highlight=False, soft_wrap=True)
# soft_wrap: an error stays one line in a pipe or a narrow terminal (grep-able, no wrapping).
err = Console(stderr=True, highlight=False, soft_wrap=True)
T = TypeVar("T")

EXIT_ERROR = 1
# The event is stored durably but no controller decided in time (it will be handled later).
EXIT_UNDECIDED = 2
# inject-failure, mark-healthy, drain, undrain: no registered worker uses the device (a typo, or
# a device never registered).
EXIT_UNKNOWN_DEVICE = 3


def run_command(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the command's coroutine: an error is one line on stderr and its exit code."""
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


def expected(type_: Any) -> str:
    """What a wire field type (``marduk.wire.fields``) takes, in words: its pattern as
    ``PATTERN_TEXT`` says it, and its lengths."""
    meta = next((a for a in typing.get_args(type_)[1:] if isinstance(a, msgspec.Meta)), None)
    if meta is None:
        return "a valid value"
    parts = [PATTERN_TEXT.get(meta.pattern, f"matching {meta.pattern}")] if meta.pattern else []
    if meta.max_length is not None:
        parts.append(f"at most {meta.max_length:,} characters")
    return ", ".join(parts)


def wire_check(type_: Any) -> Callable[[T], T]:
    """A typer callback that checks a value (or each of a list) against a wire field type: a
    mistake is a usage error naming the option (exit 2), not the controller's decode error."""

    def check(value: T) -> T:
        for v in value if isinstance(value, list) else [value]:
            if v is None:
                continue
            try:
                msgspec.convert(v, type_)
            except msgspec.ValidationError:
                raise typer.BadParameter(f"{v!r}: expected {expected(type_)}") from None
        return value

    return check


def job_source(ctx: typer.Context, job: str | None) -> str:
    """Where ``--job`` came from: "from MARDUK_JOB" when the environment set it (a filter the
    user may not know is on), else "--job"; "" without one."""
    if job is None:
        return ""
    source = ctx.get_parameter_source("job")  # typer's own click: compare the enum by name
    return "from MARDUK_JOB" if source is not None and source.name == "ENVIRONMENT" else "--job"


def print_json(obj: Any) -> None:
    """One message as one line of JSON (``--json``)."""
    sys.stdout.write(json.dumps(msgspec.to_builtins(obj)) + "\n")
    sys.stdout.flush()


def ts(t: float) -> str:
    """Unix seconds as the local time of day; "-" for none."""
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S") if t else "-"


def show(blocks: list[status_view.Block]) -> None:
    """Rich tables on a terminal; plain aligned lines in a pipe (rich would cut cells)."""
    if out.is_terminal:
        for r in status_view.rich_renderables(blocks, out.width):
            out.print(r)
    else:
        sys.stdout.write("".join(line + "\n" for line in status_view.plain_lines(blocks)))
        sys.stdout.flush()
