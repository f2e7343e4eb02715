"""The ``marduk`` command: ``controller``, and the mounted ``monitor``, ``agent``, ``auth`` and
``torchft-lighthouse`` commands."""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from marduk.shell import options

HELP_OPTIONS = ["-h", "--help"]
app = typer.Typer(
    name="marduk",
    help="Marduk: restart only the trainers a device failure touches.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": HELP_OPTIONS},
)


def _print_version(value: bool) -> None:
    if value:
        from marduk import __version__

        typer.echo(f"marduk {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            "-V",
            help="Print the version and exit.",
            is_eager=True,
            callback=_print_version,
            metavar="",
        ),
    ] = False,
) -> None:
    pass


@app.command()
@options.connection_options
def controller(
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    embedded: Annotated[
        bool,
        typer.Option(
            "--embedded/--no-embedded",
            envvar="MARDUK_EMBEDDED",
            help="Start a nats-server with JetStream when nothing listens at a local --addr.",
        ),
    ] = True,
    state_dir: options.StateDir = None,
    kv_replicas: Annotated[
        int,
        typer.Option(
            "--kv-replicas",
            envvar="MARDUK_KV_REPLICAS",
            min=1,
            help="Replicas of the JetStream buckets and health stream (3 on a NATS cluster).",
        ),
    ] = 1,
    pending_timeout: Annotated[
        float,
        typer.Option(
            "--pending-timeout",
            envvar="MARDUK_PENDING_TIMEOUT",
            min=0.0,
            help="Seconds a restart stays in flight (coalescing further events) "
            "unless every worker confirms it sooner.",
        ),
    ] = 60.0,
    join_timeout: Annotated[
        float,
        typer.Option(
            "--join-timeout",
            envvar="MARDUK_JOIN_TIMEOUT",
            min=0.0,
            help="A job whose ranks the controller assigns (--nnodes MIN:MAX) starts with MIN "
            "workers once this many seconds passed without MAX registering.",
        ),
    ] = 30.0,
    resize_interval: Annotated[
        float,
        typer.Option(
            "--resize-interval",
            envvar="MARDUK_RESIZE_INTERVAL",
            min=0.0,
            help="Seconds a job below MAX waits after its last resize (grow, shrink, forming) "
            "before it grows again; a lost member is taken out at once.",
        ),
    ] = 60.0,
    grow_checkpoint_timeout: Annotated[
        float,
        typer.Option(
            "--grow-checkpoint-timeout",
            envvar="MARDUK_GROW_CHECKPOINT_TIMEOUT",
            min=0.0,
            help="Seconds a grow waits for every member to confirm the checkpoint it asked "
            "for before it restarts with the new workers anyway.",
        ),
    ] = 120.0,
    grow_settle: Annotated[
        float,
        typer.Option(
            "--grow-settle",
            envvar="MARDUK_GROW_SETTLE",
            min=0.0,
            help="Seconds a new worker must stay live (never stale) before it joins a job "
            "below MAX; keep it above --worker-ttl (below it, a warning at start).",
        ),
    ] = 30.0,
    restart_on_degraded: Annotated[
        bool,
        typer.Option(
            "--restart-on-degraded",
            envvar="MARDUK_RESTART_ON_DEGRADED",
            help="Restart replicas on 'degraded' events too (default: report only).",
        ),
    ] = False,
    device_max_failures: Annotated[
        int,
        typer.Option(
            "--device-max-failures",
            envvar="MARDUK_DEVICE_MAX_FAILURES",
            min=0,
            help="Restarts one device may cause per window before replicas get 'fail'.",
        ),
    ] = 3,
    device_failure_window: Annotated[
        float,
        typer.Option(
            "--device-failure-window",
            envvar="MARDUK_DEVICE_FAILURE_WINDOW",
            min=1.0,
            help="Seconds of the device failure budget's window.",
        ),
    ] = 3600.0,
    flap_limit: Annotated[
        int,
        typer.Option(
            "--flap-limit",
            envvar="MARDUK_FLAP_LIMIT",
            min=1,
            help="A device that fails again more often than this within --flap-window, "
            "healthy in between or not, is quarantined: its replicas get 'fail'.",
        ),
    ] = 3,
    flap_window: Annotated[
        float,
        typer.Option(
            "--flap-window",
            envvar="MARDUK_FLAP_WINDOW",
            min=1.0,
            help="Seconds of the flap-damping window.",
        ),
    ] = 3600.0,
    straggler_factor: Annotated[
        float,
        typer.Option(
            "--straggler-factor",
            envvar="MARDUK_STRAGGLER_FACTOR",
            min=1.01,
            help="A rank this many times slower than the median of its job's other ranks "
            "(p50 of a section, per window) is slow; back to normal halfway to 1.",
        ),
    ] = 1.3,
    straggler_windows: Annotated[
        int,
        typer.Option(
            "--straggler-windows",
            envvar="MARDUK_STRAGGLER_WINDOWS",
            min=1,
            help="Windows in a row a rank must be slow to be a straggler (and normal to clear).",
        ),
    ] = 3,
    straggler_warmup: Annotated[
        int,
        typer.Option(
            "--straggler-warmup",
            envvar="MARDUK_STRAGGLER_WARMUP",
            min=0,
            help="Windows ignored after each trainer incarnation starts (compile, restore).",
        ),
    ] = 2,
    straggler_action: Annotated[
        Literal["report", "drain", "shrink"],
        typer.Option(
            "--straggler-action",
            envvar="MARDUK_STRAGGLER_ACTION",
            help="What is done about a persistent straggler of a --nnodes job: report (events "
            "only), drain (its devices drained, a free spare takes its node's ranks; never "
            "without a spare), shrink (drain; without a spare the job shrinks, never below "
            "MIN). At most one action per job per --resize-interval.",
        ),
    ] = "report",
    straggler_action_job: Annotated[
        list[str] | None,
        typer.Option(
            "--straggler-action-job",
            envvar="MARDUK_STRAGGLER_ACTION_JOBS",
            help="JOB=ACTION: the action for one job, overriding --straggler-action "
            "(repeatable; the variable takes a comma list).",
            show_default=False,
        ),
    ] = None,
    straggler_act_after: Annotated[
        float,
        typer.Option(
            "--straggler-act-after",
            envvar="MARDUK_STRAGGLER_ACT_AFTER",
            min=0.0,
            help="Seconds a rank must stay a straggler after its detection before it is acted "
            "on (with --straggler-action drain or shrink).",
        ),
    ] = 30.0,
    lease_ttl: Annotated[
        float,
        typer.Option(
            "--lease-ttl",
            envvar="MARDUK_LEASE_TTL",
            min=0.5,
            help="Seconds the leader's lease lasts unrenewed: a standby takes over after that, "
            "and a leader that cannot renew stops serving after 3/4 of it.",
        ),
    ] = 2.0,
    worker_ttl: Annotated[
        float,
        typer.Option(
            "--worker-ttl",
            envvar="MARDUK_WORKER_TTL",
            min=1.0,
            help="A worker that has not renewed its registration for this long is shown stale "
            "(agents are told to renew every third of it).",
        ),
    ] = 15.0,
    worker_expiry: Annotated[
        float,
        typer.Option(
            "--worker-expiry",
            envvar="MARDUK_WORKER_EXPIRY",
            min=1.0,
            help="A worker silent this long is removed from the map.",
        ),
    ] = 600.0,
    epoch_retention: Annotated[
        float,
        typer.Option(
            "--epoch-retention",
            envvar="MARDUK_EPOCH_RETENTION",
            min=1.0,
            help="A replica (or job) with no worker for this long has its epoch record "
            "deleted, so the state does not keep every job ever run.",
        ),
    ] = 86_400.0,
    exclusive_devices: Annotated[
        bool | None,
        typer.Option(
            "--exclusive-devices/--shared-devices",
            envvar="MARDUK_EXCLUSIVE_DEVICES",
            help="Refuse a worker claiming a device a live worker of another job holds on "
            "another host (device_claimed). Default: on with auth, off without.",
            show_default=False,
        ),
    ] = None,
    auth_dir: Annotated[
        Path | None,
        typer.Option(
            "--auth",
            envvar="MARDUK_AUTH_DIR",
            help="A `marduk auth init` directory: the embedded server enforces its roles, and "
            "the controller signs in (and signs commands) with its controller.nk.",
            show_default=False,
        ),
    ] = None,
    insecure: Annotated[
        bool,
        typer.Option(
            "--insecure",
            envvar="MARDUK_INSECURE",
            help="Let the embedded server listen on a non-loopback address without auth.",
        ),
    ] = False,
    metrics_addr: options.MetricsAddr = None,
    json_logs: options.JsonLogs = False,
    log_level: options.LogLevel = "info",
) -> None:
    """Run the controller: keep the device<->replica map and send targeted restarts.

    Starts an embedded nats-server (JetStream) when nothing listens at a local --addr.
    Several controllers may run against one NATS: one leads (holds the lease), the others are
    hot standbys that take over when it dies. Stops cleanly on SIGINT/SIGTERM.
    """
    from marduk.controller import ControllerSettings, run_controller
    from marduk.core.policy import PolicyConfig
    from marduk.core.straggler_policy import ActionConfig, parse_job_actions
    from marduk.core.stragglers import StragglerConfig
    from marduk.shell.logs import setup_logging
    from marduk.shell.runtime import run
    from marduk.transport import bus

    setup_logging(json_logs=json_logs, level=log_level)
    if (warning := settle_warning(grow_settle, worker_ttl)) is not None:
        logging.getLogger("marduk.controller").warning("%s", warning)
    settings = ControllerSettings(
        addr=addr,
        prefix=prefix,
        embedded=embedded,
        kv_replicas=kv_replicas,
        lease_ttl=lease_ttl,
        credentials=bus.default_credentials(),
        auth_dir=auth_dir,
        insecure=insecure,
        metrics_addr=metrics_addr,
        policy=PolicyConfig(
            pending_timeout_s=pending_timeout,
            join_timeout_s=join_timeout,
            resize_interval_s=resize_interval,
            grow_checkpoint_timeout_s=grow_checkpoint_timeout,
            grow_settle_s=grow_settle,
            restart_on_degraded=restart_on_degraded,
            device_max_failures=device_max_failures,
            device_failure_window_s=device_failure_window,
            worker_ttl_s=worker_ttl,
            flap_limit=flap_limit,
            flap_window_s=flap_window,
            worker_expiry_s=max(worker_expiry, worker_ttl),
            epoch_retention_s=epoch_retention,
            exclusive_devices=exclusive_devices,
        ),
    )
    if state_dir is not None:
        settings.state_dir = state_dir
    settings.stragglers = StragglerConfig(
        factor=straggler_factor,
        windows=straggler_windows,
        clear_windows=straggler_windows,
        warmup_windows=straggler_warmup,
    )
    try:
        per_job = parse_job_actions(straggler_action_job or [])
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--straggler-action-job") from None
    settings.straggler_actions = ActionConfig(
        mode=straggler_action,
        jobs=per_job,
        act_after_s=straggler_act_after,
        interval_s=resize_interval,
    )

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_controller(settings, stop)

    raise typer.Exit(run(main()))


def settle_warning(grow_settle: float, worker_ttl: float) -> str | None:
    """What to say about a ``--grow-settle`` below ``--worker-ttl`` (None: nothing).

    A warning, not a usage error: a worker is stale only once it was silent for the TTL, so
    one that dies within it still counts as live and, with a shorter settle, may join a job,
    which then restarts at once without it. A test bench or a single machine where workers do
    not flap may want grows that fast (the suite's end-to-end grows settle in 1 s)."""
    if grow_settle >= worker_ttl:
        return None
    return (
        f"--grow-settle {grow_settle:g}s is below --worker-ttl {worker_ttl:g}s: a new worker "
        "that dies within the TTL still counts as live and may join a job, which then "
        "restarts without it; keep it above the TTL unless workers never flap"
    )


def _mount() -> None:
    from agent.supervise.cli import app as agent_app
    from agent.torchft_front.cli import torchft_lighthouse
    from marduk.cli.auth import app as auth_app
    from monitor_cli.cli import app as monitor_app

    app.add_typer(monitor_app, name="monitor")
    app.add_typer(agent_app, name="agent")
    app.add_typer(auth_app, name="auth")
    app.command("torchft-lighthouse")(torchft_lighthouse)


_mount()


def _click_exceptions() -> Any:
    try:  # typer >= 0.2x vendors click
        from typer._click import exceptions
    except ImportError:  # pragma: no cover - older typer uses click itself
        from click import exceptions  # type: ignore[no-redef]
    return exceptions


def _without_bool_metavars(command: Any) -> None:
    """Flags take no value: help shows ``--json``, not ``--json <bool>`` (typer's rich help)."""
    params = list(command.params)
    help_option = command.get_help_option(typer.Context(command, help_option_names=HELP_OPTIONS))
    for param in [*params, help_option]:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _without_bool_metavars(sub)


def usage_message(text: str) -> str:
    """A usage error's text without what typer's pydantic coercion prefixes to it
    ("Invalid value for '--state': Value error, 'bogus' is not one of ..."), and no full stop."""
    return re.sub(r": (?:Value error|Assertion failed), ", ": ", text).rstrip(".")


def main() -> None:
    """The ``marduk`` entry point. A usage error is one line (and exit 2), as other errors are."""
    exceptions = _click_exceptions()
    command = typer.main.get_command(app)
    _without_bool_metavars(command)
    try:
        code = command.main(standalone_mode=False)
    except exceptions.NoArgsIsHelpError as e:
        sys.stderr.write(e.format_message())  # rich help printed itself: this is then empty
        sys.exit(e.exit_code)
    except exceptions.ClickException as e:
        # typer draws a box wrapped at the terminal width; grep and log collectors want a line.
        message = usage_message(e.format_message())
        if getattr(e, "ctx", None) is not None:
            message += f"; see '{e.ctx.command_path} -h'"
        options.error_line(message)
        sys.exit(e.exit_code)
    except typer.Abort:  # EOF at a prompt
        options.error_line("aborted")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
