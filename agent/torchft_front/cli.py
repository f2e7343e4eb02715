"""``marduk torchft-lighthouse``: torchft's lighthouse behind Marduk's front, one command."""

from __future__ import annotations

import importlib.util
import shutil
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from agent.torchft_front.config import MANAGER_BEAT_S, FrontConfig
from marduk.shell import options
from marduk.shell.logs import setup_logging

_D = FrontConfig(job="-")


def _lighthouse(given: str | None) -> list[str]:
    """torchft's lighthouse: ``--lighthouse-bin``, else torchft's own started without torch
    (agent/torchft_front/lighthouse.py), else ``torchft_lighthouse`` on PATH; [] if none."""
    if given:
        return [given]
    if importlib.util.find_spec("torchft") is not None:
        return [sys.executable, str(Path(__file__).with_name("lighthouse.py"))]
    found = shutil.which("torchft_lighthouse")
    return [found] if found else []


@options.connection_options
def torchft_lighthouse(
    job: Annotated[
        str,
        typer.Option(
            "--job", "-j", envvar="MARDUK_JOB", help="The torchft job (Marduk's job name)."
        ),
    ],
    min_replicas: Annotated[
        int, typer.Option("--min-replicas", min=1, help="torchft's --min_replicas.")
    ],
    bind: Annotated[
        str, typer.Option("--bind", help="Where the Managers connect (their TORCHFT_LIGHTHOUSE).")
    ] = _D.bind,
    heartbeat_timeout_ms: Annotated[
        int,
        typer.Option(
            "--heartbeat-timeout-ms",
            min=1,
            help="A Manager silent this long leaves the healthy set (torchft's "
            "--heartbeat_timeout_ms). A group Marduk restarts or fails leaves at once.",
        ),
    ] = round(_D.heartbeat_timeout_s * 1000),
    inner_timeout_ms: Annotated[
        int,
        typer.Option(
            "--inner-timeout-ms",
            min=1,
            help="torchft's lighthouse's own --heartbeat_timeout_ms, behind the front on "
            "loopback: how long a dropped group still counts there.",
        ),
    ] = round(_D.inner_timeout_s * 1000),
    beat_every_ms: Annotated[
        int,
        typer.Option("--beat-every-ms", min=1, help="The front's heartbeats to the lighthouse."),
    ] = round(_D.beat_every_s * 1000),
    rebuild_ms: Annotated[
        int,
        typer.Option(
            "--rebuild-ms",
            min=0,
            help="After the front (re)starts, quorum calls wait this long, so that every live "
            "Manager is heard first.",
        ),
    ] = round(_D.rebuild_s * 1000),
    lighthouse_bin: Annotated[
        str | None,
        typer.Option(
            "--lighthouse-bin", help="torchft_lighthouse (default: beside python, or on PATH)."
        ),
    ] = None,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    extra: Annotated[
        list[str] | None,
        typer.Argument(
            help="More torchft_lighthouse flags, after --, e.g. -- --join_timeout_ms 60000"
        ),
    ] = None,
) -> None:
    """torchft's lighthouse, with a front that drops a group's heartbeats as soon as Marduk
    restarts or fails it (the healthy groups' next quorum does not wait for it to time out).

    Use instead of torchft_lighthouse: point the Managers (TORCHFT_LIGHTHOUSE) at --bind, run
    the groups under Marduk (agent.torchft), and give the trainers TORCHFT_QUORUM_RETRIES so
    that a quorum call cut by a restarting front is retried (docs/operations.md).
    """
    from agent.torchft_front.supervisor import Supervisor, lighthouse_args, loopback_port

    if importlib.util.find_spec("grpc") is None:  # imported by the front's process only
        options.fail("grpcio is not installed: pip install 'marduk[torchft]'")
    binary = _lighthouse(lighthouse_bin)
    if not binary:
        options.fail(
            "torchft_lighthouse not found: pip install 'marduk[torchft]' or --lighthouse-bin"
        )
    if inner_timeout_ms <= beat_every_ms or inner_timeout_ms >= heartbeat_timeout_ms:
        options.fail(
            "--inner-timeout-ms must be above --beat-every-ms and below --heartbeat-timeout-ms",
            2,
        )
    if heartbeat_timeout_ms <= MANAGER_BEAT_S * 1000:
        beat_ms = MANAGER_BEAT_S * 1000
        options.fail(f"--heartbeat-timeout-ms must be above the Managers' {beat_ms:g} ms beats", 2)
    cfg = FrontConfig(
        job=job,
        bind=bind,
        lighthouse=loopback_port(),
        addr=addr,
        prefix=prefix,
        heartbeat_timeout_s=heartbeat_timeout_ms / 1000,
        inner_timeout_s=inner_timeout_ms / 1000,
        beat_every_s=beat_every_ms / 1000,
        rebuild_s=rebuild_ms / 1000,
    )
    setup_logging()
    sup = Supervisor(cfg, lighthouse_args(binary, cfg, min_replicas, list(extra or [])))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sup.stopping.set())
    raise typer.Exit(sup.run())
