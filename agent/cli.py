"""``marduk agent run -- CMD``: supervise the trainer as the pod's main process."""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from marduk import options

app = typer.Typer(
    help="The in-pod agent: spawn, watch and restart the trainer.", no_args_is_help=True
)


def _opt(envvar: str, help: str, **kw: object) -> typer.models.OptionInfo:
    info: typer.models.OptionInfo = typer.Option(envvar=envvar, help=help, **kw)  # type: ignore[arg-type]
    return info


@app.command(context_settings={"allow_interspersed_args": False})
@options.connection_options
def run(
    cmd: Annotated[list[str], typer.Argument(help="The trainer command, after --.")],
    job: Annotated[str, _opt("MARDUK_JOB", "Job name.")] = "default",
    replica: Annotated[str, _opt("MARDUK_REPLICA_ID", "Replica id of this worker.")] = "",
    worker: Annotated[
        int, _opt("MARDUK_WORKER", "Index of this worker in its replica.", min=0)
    ] = 0,
    devices: Annotated[
        str,
        _opt("MARDUK_DEVICES", "Comma-separated device UUIDs (default: discovered through jax)."),
    ] = "",
    scope: Annotated[
        Literal["replica", "job"],
        _opt(
            "MARDUK_SCOPE",
            "replica: restart this replica only; job: "
            "restart every replica together (one jax mesh).",
        ),
    ] = "replica",
    max_restarts: Annotated[
        int,
        _opt(
            "MARDUK_MAX_RESTARTS",
            "Restarts after local crashes "
            "or hangs within --restart-window before giving up "
            "(exit 70).",
            min=0,
        ),
    ] = 3,
    restart_window: Annotated[
        float, _opt("MARDUK_RESTART_WINDOW", "Seconds the restart budget counts over.", min=1.0)
    ] = 3600.0,
    hang_timeout: Annotated[
        float,
        _opt(
            "MARDUK_HANG_TIMEOUT",
            "Seconds without a new step before the trainer counts as hung.",
            min=0.1,
        ),
    ] = 600.0,
    startup_timeout: Annotated[
        float,
        _opt(
            "MARDUK_STARTUP_TIMEOUT",
            "Seconds until the first step (imports, compilation).",
            min=0.1,
        ),
    ] = 1800.0,
    step_regex: Annotated[
        str,
        _opt(
            "MARDUK_STEP_REGEX",
            "Regex whose first group is the step number in the trainer's output.",
        ),
    ] = r"\bstep[\s:=#]+(\d+)",
    grace: Annotated[
        float, _opt("MARDUK_GRACE", "Seconds between SIGTERM and SIGKILL.", min=0.0)
    ] = 30.0,
    cleanup_cmd: Annotated[
        str, _opt("MARDUK_CLEANUP_CMD", "Shell command run between incarnations.")
    ] = "",
    prespawn: Annotated[
        bool,
        typer.Option(
            "--prespawn/--no-prespawn",
            envvar="MARDUK_PRESPAWN",
            help="Keep the next trainer process started ahead of time, its framework imported "
            "(python SCRIPT or python -m MODULE commands only).",
        ),
    ] = True,
    fork_server: Annotated[
        bool,
        typer.Option(
            "--fork-server/--no-fork-server",
            envvar="MARDUK_FORK_SERVER",
            help="With --prespawn: fork every trainer from one process that imported the "
            "framework once (a fork server), so every restart is warm, back-to-back faults "
            "included; --no-fork-server keeps one standby process per incarnation instead.",
        ),
    ] = True,
    preload: Annotated[
        str,
        _opt(
            "MARDUK_PRELOAD",
            "Modules the pre-spawned trainer imports while it waits, comma-separated "
            "(default: jax when installed; 'none' for nothing; e.g. torch).",
        ),
    ] = "",
    reclaim_timeout: Annotated[
        float,
        _opt(
            "MARDUK_RECLAIM_TIMEOUT",
            "Seconds to wait between incarnations for this worker's NVIDIA GPUs to release "
            "their memory (0: do not wait).",
            min=0.0,
        ),
    ] = 50.0,
    reclaim_tolerance: Annotated[
        float,
        _opt(
            "MARDUK_RECLAIM_TOLERANCE_MIB",
            "GPU memory (MiB) still in use that counts as released.",
            min=0.0,
        ),
    ] = 512.0,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    connect_timeout: Annotated[
        float, _opt("MARDUK_CONNECT_TIMEOUT", "Seconds to register with the controller at start.")
    ] = 60.0,
    controller_key: Annotated[
        str | None,
        _opt(
            "MARDUK_CONTROLLER_KEY",
            "The controller's public key (U...) or a file of them: commands not signed with it "
            "are dropped.",
            show_default="controller.pub beside --nkey, if there",
        ),
    ] = None,
    preflight: Annotated[
        bool,
        typer.Option(
            "--preflight/--no-preflight",
            envvar="MARDUK_PREFLIGHT",
            help="Before restarting after a device-class failure, check the devices in a "
            "separate process (jax: list them, compute on each); a failing check exits 71 "
            "instead of restarting into a broken device. Costs a jax start (~1 s on CPU).",
        ),
    ] = False,
    preflight_expect: Annotated[
        int | None,
        _opt("MARDUK_PREFLIGHT_EXPECT", "Devices the check must see.", min=1, show_default=False),
    ] = None,
    preflight_timeout: Annotated[
        float, _opt("MARDUK_PREFLIGHT_TIMEOUT", "Seconds the device check may take.", min=1.0)
    ] = 120.0,
    metrics_addr: options.MetricsAddr = None,
    json_logs: options.JsonLogs = False,
    log_level: options.LogLevel = "info",
) -> None:
    """Run CMD as the trainer: restart it on crashes, hangs and controller commands.

    Exit codes: 0 the trainer finished; 1 setup error; 2 bad options; 70 gave up after
    --max-restarts; 71 the controller sent 'fail' (a bad device); 72 the controller sent 'stop';
    143 SIGTERM (preemption).
    """
    import re

    from agent.client import AgentError, resolve_options
    from agent.supervisor import Supervisor, SupervisorConfig, default_preload
    from marduk.logs import setup_logging
    from marduk.runtime import run as run_loop

    setup_logging(json_logs=json_logs, level=log_level)
    try:
        re.compile(step_regex)
        opts = resolve_options(
            replica or None,
            [d.strip() for d in devices.split(",") if d.strip()] if devices else None,
            job,
            addr,
            scope,
            worker=worker,
            prefix=prefix,
            timeout=connect_timeout,
            role="supervisor",
            controller_key=controller_key,
        )
    except (AgentError, re.error) as e:
        options.fail(str(e), 2)
    config = SupervisorConfig(
        cmd=cmd,
        opts=opts,
        metrics_addr=metrics_addr,
        preflight=preflight,
        preflight_expect=preflight_expect,
        preflight_timeout_s=preflight_timeout,
        max_restarts=max_restarts,
        restart_window_s=restart_window,
        hang_timeout_s=hang_timeout,
        startup_timeout_s=startup_timeout,
        step_regex=step_regex,
        grace_s=grace,
        cleanup_cmd=cleanup_cmd,
        prespawn=prespawn,
        fork_server=fork_server,
        reclaim_timeout_s=reclaim_timeout,
        reclaim_tolerance_mib=reclaim_tolerance,
        preload=(
            default_preload()
            if not preload
            else [m.strip() for m in preload.split(",") if m.strip() and m.strip() != "none"]
        ),
    )
    raise typer.Exit(run_loop(Supervisor(config).run()))
