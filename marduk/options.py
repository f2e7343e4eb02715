"""CLI options shared by ``marduk`` commands: argument, then MARDUK_* variable, then default."""

from __future__ import annotations

from typing import Annotated

import typer

from marduk.bus import DEFAULT_ADDR

Addr = Annotated[
    str,
    typer.Option(
        "--addr",
        envvar="MARDUK_ADDR",
        help="NATS server URL(s), comma-separated.",
        show_default=True,
    ),
]
Prefix = Annotated[
    str,
    typer.Option("--prefix", envvar="MARDUK_PREFIX", help="Subject prefix of this deployment."),
]
Job = Annotated[
    str | None,
    typer.Option("--job", "-j", envvar="MARDUK_JOB", help="Only this job."),
]
Json = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]
Timeout = Annotated[
    float, typer.Option("--timeout", help="Seconds to wait for the controller's answer.")
]
JsonLogs = Annotated[
    bool,
    typer.Option("--json-logs", envvar="MARDUK_JSON_LOGS", help="Log JSON lines instead of text."),
]
LogLevel = Annotated[
    str,
    typer.Option("--log-level", envvar="MARDUK_LOG_LEVEL", help="debug, info, warning or error."),
]

DEFAULTS = {"addr": DEFAULT_ADDR, "prefix": "marduk"}
