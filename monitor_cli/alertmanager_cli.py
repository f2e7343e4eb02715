"""``marduk monitor alertmanager``: the webhook receiver as a command (mount this app's command
into the monitor group with ``monitor_app.add_typer(app)``, no name)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from marduk.errors import MardukError
from marduk.shell import options

app = typer.Typer(add_completion=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_ERROR = 1


@app.command("alertmanager")
@options.connection_options
def alertmanager(
    listen: Annotated[
        str,
        typer.Option(
            "--listen",
            envvar="MARDUK_ALERTMANAGER_LISTEN",
            help="HOST:PORT to serve webhooks on (0.0.0.0:9095 for a remote Alertmanager).",
        ),
    ] = "127.0.0.1:9095",
    device_label: Annotated[
        str,
        typer.Option(
            "--device-label",
            envvar="MARDUK_ALERTMANAGER_DEVICE_LABEL",
            help="Alert label naming the device (dcgm-exporter's UUID); alerts without it are "
            "ignored.",
        ),
    ] = "UUID",
    state_label: Annotated[
        str,
        typer.Option(
            "--state-label",
            envvar="MARDUK_ALERTMANAGER_STATE_LABEL",
            help="Alert label whose value picks the state of a firing alert.",
        ),
    ] = "severity",
    state_map: Annotated[
        str,
        typer.Option(
            "--state-map",
            envvar="MARDUK_ALERTMANAGER_STATE_MAP",
            help="VALUE=STATE pairs for --state-label (STATE: failed, degraded, preempting); "
            "a value that is a state name is that state; any other value is failed.",
        ),
    ] = "warning=degraded,info=degraded",
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            envvar="MARDUK_ALERTMANAGER_TOKEN_FILE",
            help="File holding a bearer token POSTs must carry (Alertmanager's "
            "http_config.authorization.credentials_file).",
            show_default=False,
        ),
    ] = None,
    publish_timeout: Annotated[
        float,
        typer.Option(
            "--publish-timeout",
            min=0.1,
            help="Seconds a notification waits for NATS before the answer is 503 "
            "(Alertmanager retries).",
        ),
    ] = 30.0,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    json_logs: options.JsonLogs = False,
    log_level: options.LogLevel = "info",
) -> None:
    """Receive Alertmanager webhooks: an alert with the device label becomes a health event.

    Firing: failed (or degraded, by --state-map); resolved: healthy. Events are stored durably
    for the controller; a repeated notification is recognised and changes nothing. Serves
    POST / for Alertmanager, and GET /healthz, /readyz, /metrics. Stops on SIGINT/SIGTERM.
    """
    from marduk.shell.logs import setup_logging
    from marduk.shell.runtime import run
    from monitor_cli.alertmanager import (
        AlertMapping,
        ReceiverSettings,
        parse_listen,
        parse_state_map,
        run_receiver,
    )

    try:
        parse_listen(listen)
        settings = ReceiverSettings(
            listen=listen,
            addr=addr,
            prefix=prefix,
            mapping=AlertMapping(
                device_label=device_label,
                state_label=state_label,
                state_map=parse_state_map(state_map),
            ),
            token=_read_token(token_file),
            publish_timeout_s=publish_timeout,
        )
    except MardukError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(EXIT_ERROR) from None
    setup_logging(json_logs=json_logs, level=log_level)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_receiver(settings, stop)

    try:
        code = run(main())
    except MardukError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    raise typer.Exit(code)


def _read_token(path: Path | None) -> str:
    if path is None:
        return ""
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise MardukError(f"--token-file {path}: {e.strerror or e}") from None
    if not token:
        raise MardukError(f"--token-file {path} is empty")
    return token


def main() -> None:  # pragma: no cover - for running it before it is mounted
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
