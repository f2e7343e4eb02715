"""CLI options shared by ``marduk`` commands: argument, then MARDUK_* variable, then default."""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import typer

from marduk.transport.bus import DEFAULT_ADDR

EXIT_ERROR = 1


def error_line(message: str) -> None:
    """``error: MESSAGE`` on stderr as one line, never wrapped (grep-able, log collectors)."""
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    """End the command (from inside it) with ``error: MESSAGE`` and exit ``code``."""
    error_line(message)
    raise typer.Exit(code)


def _check_addr(value: str) -> str:
    # Every command's --addr / MARDUK_ADDR passes here, before anything connects.
    from marduk.transport.bus import InvalidAddressError, parse_servers

    try:
        parse_servers(value)
    except InvalidAddressError as e:
        fail(str(e))
    return value


def _state_dir_default() -> str:
    # marduk.transport.embedded.default_state_dir() without MARDUK_STATE_DIR (help shows the
    # variable apart), and without importing it (psutil) for every command; a test keeps them equal.
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(xdg) / "marduk")


Addr = Annotated[
    str,
    typer.Option(
        "--addr",
        envvar="MARDUK_ADDR",
        help="NATS server URL(s), comma-separated: nats://HOST:PORT (or tls://, ws://, wss://).",
        show_default=True,
        callback=_check_addr,
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
# metavar="": a flag takes no value, so help shows no "<bool>" after it.
Json = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.", metavar="")]
Timeout = Annotated[
    float, typer.Option("--timeout", help="Seconds to wait for the controller's answer.")
]
JsonLogs = Annotated[
    bool,
    typer.Option(
        "--json-logs",
        envvar="MARDUK_JSON_LOGS",
        help="Log JSON lines instead of text.",
        metavar="",
    ),
]
LogLevelName = Literal["debug", "info", "warning", "error"]
LogLevel = Annotated[
    LogLevelName,
    typer.Option(
        "--log-level", envvar="MARDUK_LOG_LEVEL", help="How much to log.", case_sensitive=False
    ),
]
StateDir = Annotated[
    Path | None,
    typer.Option(
        "--state-dir",
        envvar="MARDUK_STATE_DIR",
        help="Embedded server's store, log and pid file ($XDG_STATE_HOME/marduk).",
        show_default=_state_dir_default(),
    ),
]

MetricsAddr = Annotated[
    str | None,
    typer.Option(
        "--metrics-addr",
        envvar="MARDUK_METRICS_ADDR",
        help="Serve Prometheus /metrics and /healthz, /readyz probes on HOST:PORT (off unless "
        "set), e.g. 0.0.0.0:9090.",
        show_default=False,
    ),
]

DEFAULTS = {"addr": DEFAULT_ADDR, "prefix": "marduk"}


# --- connection options, shared by every command that talks to NATS ----------------------------

_CONNECTION_OPTIONS: dict[str, Any] = {
    "nkey": Annotated[
        Path | None,
        typer.Option(
            "--nkey",
            envvar="MARDUK_NKEY",
            help="nkey seed file to authenticate with (as `marduk auth init` writes).",
            show_default=False,
        ),
    ],
    "creds": Annotated[
        Path | None,
        typer.Option(
            "--creds",
            envvar="MARDUK_CREDS",
            help="NATS credentials file (decentralized auth: user JWT and seed).",
            show_default=False,
        ),
    ],
    "tls_ca": Annotated[
        Path | None,
        typer.Option(
            "--tls-ca",
            envvar="MARDUK_TLS_CA",
            help="CA bundle to verify the server (TLS).",
            show_default=False,
        ),
    ],
    "tls_cert": Annotated[
        Path | None,
        typer.Option(
            "--tls-cert",
            envvar="MARDUK_TLS_CERT",
            help="Client certificate (TLS).",
            show_default=False,
        ),
    ],
    "tls_key": Annotated[
        Path | None,
        typer.Option(
            "--tls-key",
            envvar="MARDUK_TLS_KEY",
            help="Client certificate's key (TLS).",
            show_default=False,
        ),
    ],
}


def connection_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add --nkey, --creds and --tls-* to a command; its NATS connections use them.

    User and password or a token go in the URL or MARDUK_USER / MARDUK_PASSWORD /
    MARDUK_TOKEN (never on a command line other users can read).
    """
    sig = inspect.signature(fn, eval_str=True)  # typer needs the real Annotated objects
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ann)
        for name, ann in _CONNECTION_OPTIONS.items()
    ]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from marduk.transport import bus
        from marduk.transport.credentials import Credentials

        given = {name: kwargs.pop(name, None) for name in _CONNECTION_OPTIONS}
        bus.set_default_credentials(Credentials.from_env(**given))
        return fn(*args, **kwargs)

    params = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    wrapper.__signature__ = sig.replace(parameters=[*params, *extra])  # type: ignore[attr-defined]
    wrapper.__annotations__ = {
        **{p.name: p.annotation for p in params},
        **_CONNECTION_OPTIONS,
    }
    return wrapper
