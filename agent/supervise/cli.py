"""``marduk agent run -- CMD``: supervise the trainers as the pod's main process.

torchrun's options (``--nproc-per-node``, ``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``, ``--rdzv-endpoint``, ``--max-restarts``, ``--monitor-interval``, ``--log-dir``,
``--redirects``, ``--tee``, ``--local-ranks-filter``, ``--role``, ``-m``, ``--no-python``) mean what
they mean to torchrun (agent/supervise/launch.py); the script may be given as torchrun takes it
(``train.py ARGS``: run with this interpreter).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import typer

from agent.library import options as library
from agent.supervise.launch import DEFAULT_MASTER_PORT, PORT_SPAN
from agent.supervise.run_config import (
    CHECK_INTERVAL_S,
    CHECK_TIMEOUT_S,
    LAUNCH,
    Config,
    ConfigError,
    RunArgs,
    build_config,
)
from agent.supervise.run_config import node_name as node_name
from agent.supervise.run_config import trainer_command as trainer_command
from agent.supervise.supervisor_config import CONNECT_TIMEOUT_S
from marduk.shell import options
from marduk.wire.subjects import DEFAULT_PREFIX

# Every default below is a settings object's (each defined once): the supervisor's
# (SupervisorConfig's class attributes), the launch contract's, the library's. What the options
# mean is agent/supervise/run_config.py's.
app = typer.Typer(
    help="The in-pod agent: spawn, watch and restart the trainer.", no_args_is_help=True
)


def _opt(envvar: str, help: str, **kw: object) -> typer.models.OptionInfo:
    # typer.Option's overloads cannot take **kw (typed per option): call it untyped.
    info: typer.models.OptionInfo = cast(Any, typer.Option)(envvar=envvar, help=help, **kw)
    return info


@app.command(context_settings={"allow_interspersed_args": False})
@options.connection_options
def run(
    cmd: Annotated[
        list[str],
        typer.Argument(
            help="The trainer command, after --; or SCRIPT.py ARGS, as torchrun takes it."
        ),
    ],
    job: Annotated[str, _opt("MARDUK_JOB", "Job name.")] = library.DEFAULT_JOB,
    replica: Annotated[
        str,
        _opt(
            "MARDUK_REPLICA_ID",
            "Replica id of this worker.",
            show_default="with torchrun's options or --standalone: --rdzv-id if given, else "
            "the host name (each node its own replica where the controller assigns the node "
            "ranks), 'main' across nodes with --node-rank; otherwise required",
        ),
    ] = "",
    worker: Annotated[
        int | None,
        _opt(
            "MARDUK_WORKER",
            "Index of this worker in its replica.",
            min=0,
            show_default="--node-rank, else 0",
        ),
    ] = None,
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
    ] = library.DEFAULT_SCOPE,
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts",
            "--max_restarts",
            envvar="MARDUK_MAX_RESTARTS",
            min=0,
            help="Restarts after local crashes "
            "or hangs within --restart-window before giving up "
            "(exit 70). torchrun's --max-restarts (whose default is 0).",
        ),
    ] = Config.max_restarts,
    restart_window: Annotated[
        float, _opt("MARDUK_RESTART_WINDOW", "Seconds the restart budget counts over.", min=1.0)
    ] = Config.restart_window_s,
    hang_timeout: Annotated[
        str,
        _opt(
            "MARDUK_HANG_TIMEOUT",
            "Seconds without a new step before the trainer counts as hung; or auto[:MIN:MAX]: "
            "learned from the job, --timeout-factor x the 99th percentile of the step "
            "intervals seen (kept across restarts), within MIN:MAX (default 3:600; MAX "
            "until learned).",
        ),
    ] = f"{Config.hang_timeout_s:g}",
    startup_timeout: Annotated[
        str,
        _opt(
            "MARDUK_STARTUP_TIMEOUT",
            "Seconds until the first step (imports, compilation); or auto[:MIN:MAX]: learned "
            "from the earlier incarnations' starts, within MIN:MAX (default 60:1800).",
        ),
    ] = f"{Config.startup_timeout_s:g}",
    timeout_factor: Annotated[
        float,
        _opt(
            "MARDUK_TIMEOUT_FACTOR",
            "With --hang-timeout or --startup-timeout auto: the multiple of the observed "
            "times that makes a timeout.",
            min=1.0,
        ),
    ] = Config.learning.factor,
    step_regex: Annotated[
        str,
        _opt(
            "MARDUK_STEP_REGEX",
            "Regex whose first group is the step number in the trainer's output.",
        ),
    ] = Config.step_regex,
    grace: Annotated[
        float,
        _opt(
            "MARDUK_GRACE",
            "Seconds between SIGTERM and SIGKILL: for a preemption (SIGTERM to the agent), "
            "fail, stop, and a local rank's failure no controller answered. The trainer's "
            "checkpoint on SIGTERM must fit.",
            min=0.0,
        ),
    ] = Config.grace_s,
    restart_grace: Annotated[
        float,
        _opt(
            "MARDUK_RESTART_GRACE",
            "Seconds between SIGTERM and SIGKILL when the controller restarts the trainer's "
            "scope at a new epoch (a peer or local rank crashed, a device failed): the other "
            "processes stop at the same moment, so a checkpoint that needs them (JAX's "
            "preemption sync point) cannot complete; the next incarnation restores the last "
            "one. At most --grace.",
            min=0.0,
        ),
    ] = Config.restart_grace_s,
    cleanup_cmd: Annotated[
        str, _opt("MARDUK_CLEANUP_CMD", "Shell command run between incarnations.")
    ] = Config.cleanup_cmd,
    prespawn: Annotated[
        bool,
        typer.Option(
            "--prespawn/--no-prespawn",
            envvar="MARDUK_PRESPAWN",
            help="Keep the next trainer process started ahead of time, its framework imported "
            "(python SCRIPT or python -m MODULE commands only).",
        ),
    ] = Config.prespawn,
    fork_server: Annotated[
        bool,
        typer.Option(
            "--fork-server/--no-fork-server",
            envvar="MARDUK_FORK_SERVER",
            help="With --prespawn: fork every trainer from one process that imported the "
            "framework once (a fork server), so every restart is warm, back-to-back faults "
            "included; --no-fork-server keeps one prestarted trainer per rank instead (its own "
            "process, the framework imported, waiting).",
        ),
    ] = Config.fork_server,
    preload: Annotated[
        str,
        _opt(
            "MARDUK_PRELOAD",
            "Modules the pre-spawned trainer imports while it waits, comma-separated "
            "(default: torch for a script that imports torch, else jax, when installed; "
            "'none' for nothing).",
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
    ] = Config.reclaim_timeout_s,
    reclaim_tolerance: Annotated[
        float,
        _opt(
            "MARDUK_RECLAIM_TOLERANCE_MIB",
            "GPU memory (MiB) still in use that counts as released.",
            min=0.0,
        ),
    ] = Config.reclaim_tolerance_mib,
    local_ckpt_dir: Annotated[
        str,
        _opt(
            "MARDUK_LOCAL_CKPT_DIR",
            "The node-local checkpoint store the agent keeps across trainer restarts and hands "
            "to the trainers (MARDUK_LOCAL_CKPT_DIR; client.snapshot writes into it): 'auto' is "
            "/dev/shm/marduk-JOB-REPLICA-WORKER (tmpfs: it counts against the pod's memory "
            "limit), 'none' no store. Removed when the job ends for this member (exit 0, 71, 72).",
        ),
    ] = Config.local_ckpt_dir,
    local_ckpt_max: Annotated[
        str,
        _opt(
            "MARDUK_LOCAL_CKPT_MAX",
            "Size bound of the store (all local ranks' snapshots; each rank keeps two, and "
            "writes a third before the oldest goes): 4GiB, 512M, bytes; 0: the filesystem's. A "
            "snapshot past it is not written (counted); training goes on.",
        ),
    ] = "0",
    local_ckpt_flush: Annotated[
        float,
        _opt(
            "MARDUK_LOCAL_CKPT_FLUSH",
            "Seconds a restart, fail or stop gives the trainers to write their last snapshot "
            "before they are stopped (they say when done; the stop's grace follows).",
            min=0.0,
        ),
    ] = Config.local_ckpt_flush_s,
    persist_dir: Annotated[
        str | None,
        _opt(
            "MARDUK_PERSIST_DIR",
            "Copy each rank's newest snapshot from the store to this directory (persistent "
            "storage) in the background; the trainers restore from it when no newer step is "
            "held locally by every rank.",
            show_default="no persistent copies",
        ),
    ] = Config.persist_dir,
    persist_interval: Annotated[
        float,
        _opt(
            "MARDUK_PERSIST_INTERVAL",
            "Seconds between persistent copies: the copies lag the newest snapshot by at most "
            "this plus one copy's time.",
            min=0.05,
        ),
    ] = Config.persist_interval_s,
    ckpt_lineage: Annotated[
        str | None,
        _opt(
            "MARDUK_CKPT_LINEAGE",
            "The run snapshots belong to: a snapshot of another lineage is never restored "
            "(change it to start a job of the same name afresh).",
            show_default="the job name",
        ),
    ] = Config.ckpt_lineage,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = DEFAULT_PREFIX,
    connect_timeout: Annotated[
        float, _opt("MARDUK_CONNECT_TIMEOUT", "Seconds to register with the controller at start.")
    ] = CONNECT_TIMEOUT_S,
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
    ] = Config.preflight,
    preflight_expect: Annotated[
        int | None,
        _opt("MARDUK_PREFLIGHT_EXPECT", "Devices the check must see.", min=1, show_default=False),
    ] = Config.preflight_expect,
    preflight_timeout: Annotated[
        float, _opt("MARDUK_PREFLIGHT_TIMEOUT", "Seconds the device check may take.", min=1.0)
    ] = Config.preflight_timeout_s,
    node_check_endpoint: Annotated[
        str | None,
        _opt(
            "MARDUK_NODE_CHECK_ENDPOINT",
            "The node health check service to ask before the first start and before a restart "
            "after a device-class failure: a unix socket (/run/nhc.sock) or HOST:PORT, one line "
            "of JSON each way (docs/protocol.md, Node check). Only its explicit "
            '"healthy": false keeps the node out; a service that cannot be reached is logged '
            "and counted, the node counted healthy (as NVRx does).",
            metavar="SOCKET|HOST:PORT",
            show_default=False,
        ),
    ] = None,
    storage_check: Annotated[
        list[str] | None,
        _opt(
            "MARDUK_STORAGE_CHECK",
            "A path that must exist and be readable (PATH), and writable (PATH:rw), on a mount "
            "that answers, when the node checks run (see --node-check-endpoint); repeatable. "
            "Checked in a child process within --check-timeout: a hung NFS or Lustre mount "
            "fails the check instead of hanging the agent.",
            metavar="PATH[:rw]",
            show_default=False,
        ),
    ] = None,
    check_mounts: Annotated[
        bool,
        typer.Option(
            "--check-mounts/--no-check-mounts",
            envvar="MARDUK_CHECK_MOUNTS",
            help="With the node checks: every NFS and Lustre mount of this node must answer, "
            "and Lustre's /sys/fs/lustre/health_check (where present) say healthy.",
        ),
    ] = False,
    check_timeout: Annotated[
        float,
        _opt(
            "MARDUK_CHECK_TIMEOUT",
            "Seconds each node check may take (the service's answer; the storage checks).",
            min=0.1,
        ),
    ] = CHECK_TIMEOUT_S,
    check_interval: Annotated[
        float,
        _opt(
            "MARDUK_CHECK_INTERVAL",
            "Seconds between the checks of a node kept out before its first start (--nnodes "
            "MIN:MAX: it registers as unhealthy, takes no rank, and takes ranks once it passes). "
            "Elsewhere a node that fails its checks exits 71.",
            min=1.0,
        ),
    ] = CHECK_INTERVAL_S,
    numa_bind: Annotated[
        str | None,
        _opt(
            "MARDUK_NUMA_BIND",
            "Bind each local rank to the NUMA node of its GPU: N (GPUs per NUMA node, "
            "NVRX_GPUS_PER_NUMA's meaning: GPU g on node g // N) or auto (each GPU's node from "
            "sysfs). Under numactl --cpunodebind --membind where installed and the trainer "
            "starts cold; else the trainer binds its CPUs (sched_setaffinity) to the node's.",
            metavar="auto|N",
            show_default=False,
        ),
    ] = None,
    nproc_per_node: Annotated[
        str | None,
        typer.Option(
            "--nproc-per-node",
            "--nproc_per_node",
            envvar="MARDUK_NPROC_PER_NODE",
            help="Local ranks (trainer processes) on this node, as torchrun's: each gets RANK, "
            "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...; any one failing restarts all. 'gpu' or "
            "'auto': one per device. Not given: one trainer without torchrun's variables.",
            show_default=False,
        ),
    ] = None,
    nnodes: Annotated[
        str | None,
        typer.Option(
            "--nnodes",
            envvar="MARDUK_NNODES",
            help="Nodes in the job (one agent each): N, or torchrun's MIN:MAX. Without "
            "--node-rank (or with MIN below MAX) the controller assigns the node ranks and "
            "the coordinator at each epoch (needs --scope job); 1:1 too (agents beyond MAX "
            "wait as spares). Only N=1 is one node on its own, rank 0 of 1.",
            show_default=str(LAUNCH.nnodes),
        ),
    ] = None,
    node_rank: Annotated[
        int | None,
        typer.Option(
            "--node-rank",
            "--node_rank",
            envvar="MARDUK_NODE_RANK",
            min=0,
            help="This node's rank (GROUP_RANK); without it, across nodes, the controller "
            "assigns one.",
            show_default=f"assigned by the controller across nodes (--nnodes MIN:MAX or N above "
            f"1); {LAUNCH.node_rank} with --nnodes 1",
        ),
    ] = None,
    spare: Annotated[
        bool,
        typer.Option(
            "--spare",
            envvar="MARDUK_SPARE",
            help="A hot spare of a job whose ranks the controller assigns (--nnodes MIN:MAX): "
            "register and start nothing until a member is lost, then take its ranks.",
        ),
    ] = False,
    spare_pool: Annotated[
        str | None,
        typer.Option(
            "--spare-pool",
            envvar="MARDUK_SPARE_POOL",
            help="A pool of hot spares shared by jobs. With --spare: this agent is a spare of "
            "the pool NAME (it registers under the job NAME, no job of its own) and serves the "
            "first job that claims it, for good. Without: the job may draw a spare from NAME "
            "when a member is lost and none of its own spares fits (--nnodes MIN:MAX).",
            metavar="NAME",
        ),
    ] = None,
    segment: Annotated[
        int,
        typer.Option(
            "--segment",
            envvar="MARDUK_SEGMENT",
            min=0,
            help="NVLink segments of N nodes (with --nnodes MIN:MAX, multiples of N): node "
            "ranks in groups of N contiguous ranks whose nodes share one NVLink domain (NVML's "
            "ClusterUUID, or MARDUK_NVLINK_DOMAIN), only whole groups in the job, spares taken "
            "from the lost member's domain. 0 or 1: none.",
            metavar="N",
        ),
    ] = 0,
    master_addr: Annotated[
        str | None,
        typer.Option(
            "--master-addr",
            "--master_addr",
            envvar="MARDUK_MASTER_ADDR",
            help="MASTER_ADDR for the ranks (the node of rank 0).",
            show_default=LAUNCH.master_addr,
        ),
    ] = None,
    master_port: Annotated[
        int | None,
        typer.Option(
            "--master-port",
            "--master_port",
            envvar="MARDUK_MASTER_PORT",
            help=(
                "MASTER_PORT for the ranks; across nodes the base of a range of "
                f"{PORT_SPAN} ports: MASTER_PORT = base + epoch % {PORT_SPAN}, so a restart "
                "never meets the previous coordinator."
            ),
            show_default=f"a free port per restart on one node; {DEFAULT_MASTER_PORT} across nodes",
        ),
    ] = None,
    local_addr: Annotated[
        str | None,
        typer.Option(
            "--local-addr",
            "--local_addr",
            envvar="MARDUK_LOCAL_ADDR",
            help="With ranks from the controller: the address this node's rank 0 serves the "
            "job's coordinator on, if it is node 0 (torchrun's --local-addr).",
            show_default="the host name",
        ),
    ] = None,
    rdzv_endpoint: Annotated[
        str,
        typer.Option(
            "--rdzv-endpoint",
            "--rdzv_endpoint",
            help="HOST:PORT of the master (torchrun's); the rendezvous is static.",
        ),
    ] = "",
    rdzv_backend: Annotated[
        str,
        typer.Option(
            "--rdzv-backend",
            "--rdzv_backend",
            help="Accepted for torchrun command lines; ranks are --node-rank's or the "
            "controller's.",
        ),
    ] = "static",
    rdzv_id: Annotated[
        str,
        typer.Option("--rdzv-id", "--rdzv_id", help="TORCHELASTIC_RUN_ID for the ranks."),
    ] = LAUNCH.run_id,
    role: Annotated[
        str, typer.Option("--role", help="ROLE_NAME for the ranks (torchrun's).")
    ] = LAUNCH.role,
    rank_devices: Annotated[
        Literal["all", "split"],
        typer.Option(
            "--rank-devices",
            envvar="MARDUK_RANK_DEVICES",
            help="all: every local rank sees every device (torchrun's way, and JAX's one "
            "process per host); split: each rank gets its share of --devices, "
            "CUDA_VISIBLE_DEVICES set to it.",
        ),
    ] = LAUNCH.rank_devices,
    module: Annotated[
        bool,
        typer.Option(
            "-m", "--module", help="Run the command as 'python -m MODULE' (torchrun's -m)."
        ),
    ] = False,
    no_python: Annotated[
        bool,
        typer.Option(
            "--no-python",
            "--no_python",
            help="Run the command as it is, even a .py script (torchrun's --no-python).",
        ),
    ] = False,
    monitor_interval: Annotated[
        float | None,
        typer.Option(
            "--monitor-interval",
            "--monitor_interval",
            envvar="MARDUK_MONITOR_INTERVAL",
            min=0.01,
            help="Seconds between hang and section checks (exits are seen at once).",
            show_default=Config.TICK_DEFAULT,
        ),
    ] = None,
    log_dir: Annotated[
        str | None,
        typer.Option(
            "--log-dir",
            "--log_dir",
            envvar="MARDUK_LOG_DIR",
            help="Where --redirects and --tee write: "
            "LOG_DIR/JOB_REPLICA_WORKER/attempt_N/LOCAL_RANK/{stdout,stderr}.log.",
            show_default="a new temporary directory",
        ),
    ] = None,
    redirects: Annotated[
        str,
        typer.Option(
            "-r",
            "--redirects",
            envvar="MARDUK_REDIRECTS",
            help="Ranks' streams written to log files only: 0 none, 1 stdout, 2 stderr, 3 both, "
            "or per local rank: 0:1,1:2.",
        ),
    ] = "0",
    tee: Annotated[
        str,
        typer.Option(
            "-t",
            "--tee",
            envvar="MARDUK_TEE",
            help="Ranks' streams written to log files and the console (as --redirects).",
        ),
    ] = "0",
    local_ranks_filter: Annotated[
        str,
        typer.Option(
            "--local-ranks-filter",
            "--local_ranks_filter",
            help="Only these local ranks' output on the console (e.g. 0,1); log files keep all.",
        ),
    ] = "",
    standalone: Annotated[
        bool,
        typer.Option(
            "--standalone",
            envvar="MARDUK_STANDALONE",
            help="Start without waiting for a controller: restarts are local (as torchrun's), "
            "and the agent joins the controller at --addr when one answers. No NATS needed.",
        ),
    ] = Config.standalone,
    require_controller: Annotated[
        bool,
        typer.Option(
            "--require-controller",
            envvar="MARDUK_REQUIRE_CONTROLLER",
            help="Exit 1 when no controller answers within --connect-timeout, instead of "
            "running standalone.",
        ),
    ] = Config.require_controller,
    metrics_addr: options.MetricsAddr = None,
    json_logs: options.JsonLogs = False,
    log_level: options.LogLevel = "info",
) -> None:
    """Run CMD as the trainer (or --nproc-per-node of them): restart on crashes, hangs and
    controller commands.

    Exit codes: 0 the trainers finished; 1 setup error; 2 bad options; 70 gave up after
    --max-restarts; 71 the controller sent 'fail' (a bad device); 72 the controller sent 'stop';
    143 SIGTERM (preemption); after the trainer asked client.request("stop_restarting"), the
    trainer's own exit code.
    """
    # First, before any other name is bound: every option's value, by name (RunArgs's fields).
    args = RunArgs(**locals())
    from agent.supervise.supervisor import CANCEL_WAIT_S, Supervisor
    from marduk.shell.logs import setup_logging
    from marduk.shell.runtime import run_to_exit

    setup_logging(json_logs=json_logs, level=log_level)
    try:
        config = build_config(args)
    except ConfigError as e:
        options.fail(str(e), 2)
    raise typer.Exit(run_to_exit(Supervisor(config).run(), linger_s=CANCEL_WAIT_S))
