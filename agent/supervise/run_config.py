"""What ``marduk agent run``'s options mean: ``build_config`` turns the parsed option values
(``RunArgs``) into the supervisor's configuration, checking them on the way.

The CLI (agent/supervise/cli.py) only declares the options and reports a ``ConfigError`` as one
line, exit 2. The few look-ups the building needs (the host name, the controller's options, whether
a port can be bound, the script's imports) come in through ``Lookups``, so the rules are tested
without touching the machine.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from agent.channel.handoff import REPLICA as REPLICA_ENV
from agent.errors import AgentError
from agent.library import options as library
from agent.supervise import ports
from agent.supervise.launch import (
    LaunchError,
    LaunchSpec,
    LogSpec,
    default_prefix_template,
    parse_endpoint,
    parse_nnodes,
    parse_std,
)
from agent.supervise.learned_timeouts import HANG_BOUNDS, STARTUP_BOUNDS, Bounds, Learning
from agent.supervise.supervisor_config import CONNECT_TIMEOUT_S, SupervisorConfig
from marduk.shell import options
from marduk.wire.protocol import Rendezvous
from marduk.wire.subjects import DEFAULT_PREFIX, check_job

if TYPE_CHECKING:
    from agent.library.options import Options
    from agent.supervise.numa import Binding, Topology
    from agent.supervise.start_checks import CheckSpec

Config = SupervisorConfig
LAUNCH = LaunchSpec()
CHECK_TIMEOUT_S = 30.0  # each node check's (agent/supervise/start_checks.py)
CHECK_INTERVAL_S = 60.0  # between the checks of a node kept out


class ConfigError(ValueError):
    """An option that cannot work: one line naming it, for the user (exit 2)."""


@dataclass(frozen=True, slots=True)
class RunArgs:
    """The values of ``marduk agent run``'s options, as parsed (one field per option; the
    defaults are the CLI's)."""

    cmd: list[str]
    job: str = library.DEFAULT_JOB
    replica: str = ""
    worker: int | None = None
    devices: str = ""
    scope: Literal["replica", "job"] = library.DEFAULT_SCOPE
    max_restarts: int = Config.max_restarts
    restart_window: float = Config.restart_window_s
    hang_timeout: str = f"{Config.hang_timeout_s:g}"
    startup_timeout: str = f"{Config.startup_timeout_s:g}"
    timeout_factor: float = Config.learning.factor
    step_regex: str = Config.step_regex
    grace: float = Config.grace_s
    restart_grace: float = Config.restart_grace_s
    cleanup_cmd: str = Config.cleanup_cmd
    prespawn: bool = Config.prespawn
    fork_server: bool = Config.fork_server
    preload: str = ""
    reclaim_timeout: float = Config.reclaim_timeout_s
    reclaim_tolerance: float = Config.reclaim_tolerance_mib
    local_ckpt_dir: str = Config.local_ckpt_dir
    local_ckpt_max: str = "0"
    local_ckpt_flush: float = Config.local_ckpt_flush_s
    persist_dir: str | None = Config.persist_dir
    persist_interval: float = Config.persist_interval_s
    ckpt_lineage: str | None = Config.ckpt_lineage
    addr: str = options.DEFAULTS["addr"]
    prefix: str = DEFAULT_PREFIX
    connect_timeout: float = CONNECT_TIMEOUT_S
    controller_key: str | None = None
    preflight: bool = Config.preflight
    preflight_expect: int | None = Config.preflight_expect
    preflight_timeout: float = Config.preflight_timeout_s
    node_check_endpoint: str | None = None
    storage_check: list[str] | None = None
    check_mounts: bool = False
    check_timeout: float = CHECK_TIMEOUT_S
    check_interval: float = CHECK_INTERVAL_S
    numa_bind: str | None = None
    nproc_per_node: str | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    spare: bool = False
    spare_pool: str | None = None
    segment: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    rdzv_endpoint: str = ""
    rdzv_backend: str = "static"
    rdzv_id: str = LAUNCH.run_id
    role: str = LAUNCH.role
    rank_devices: Literal["all", "split"] = LAUNCH.rank_devices
    module: bool = False
    no_python: bool = False
    monitor_interval: float | None = None
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str = ""
    standalone: bool = Config.standalone
    require_controller: bool = Config.require_controller
    metrics_addr: str | None = None
    json_logs: bool = False
    log_level: str = "info"

    @property
    def torchrun_style(self) -> bool:
        """Any of torchrun's placement options given: the ranks get torchrun's variables."""
        placed = (self.nproc_per_node, self.nnodes, self.node_rank, self.master_addr)
        return any(x is not None for x in (*placed, self.master_port)) or bool(self.rdzv_endpoint)

    @property
    def ranks_from_controller(self) -> bool:
        """``--nnodes MIN:MAX`` (MIN below MAX), or ``MIN:MAX`` or ``N`` above 1 without
        ``--node-rank``: the controller assigns the node ranks (marduk/core/membership.py).
        Only ``--nnodes 1`` (the default) is one node on its own, rank 0 of 1."""
        value = self.nnodes or "1"
        lo, colon, hi = value.partition(":")
        return lo != (hi or lo) or (self.node_rank is None and (bool(colon) or lo != "1"))


def _default_preload(cmd: list[str]) -> list[str]:
    from agent.supervise.supervisor_config import default_preload, script_source

    return default_preload(script_source(cmd))


def _topology() -> Topology:
    from agent.supervise.numa import read_topology

    return read_topology()


def _numactl() -> str | None:
    return shutil.which("numactl")


def _nvlink_domain(devices: list[str]) -> str:
    from agent.library.devices import nvlink_domain

    return nvlink_domain(devices)


def _resolve(**kw: Any) -> Options:
    from agent.library.options import resolve_options

    return resolve_options(**kw)


@dataclass(frozen=True, slots=True)
class Lookups:
    """What building the configuration asks of the machine; tests pass their own."""

    node_name: Callable[[], str] = field(default_factory=lambda: node_name)
    resolve: Callable[..., Options] = field(default_factory=lambda: _resolve)
    check_master: Callable[[LaunchSpec], None] = field(default_factory=lambda: ports.check_master)
    default_preload: Callable[[list[str]], list[str]] = field(
        default_factory=lambda: _default_preload
    )
    environ: Mapping[str, str] = field(default_factory=lambda: os.environ)
    free_ports: Callable[[], list[int]] = field(default_factory=lambda: ports.coordinator_ports)
    topology: Callable[[], Topology] = field(default_factory=lambda: _topology)
    numactl: Callable[[], str | None] = field(default_factory=lambda: _numactl)
    nvlink_domain: Callable[[list[str]], str] = field(default_factory=lambda: _nvlink_domain)


def build_config(args: RunArgs, lookups: Lookups | None = None) -> SupervisorConfig:
    """The supervisor's configuration (with its options, launch and log specs) from ``args``;
    ConfigError, one line naming the option, for anything that cannot work."""
    look = lookups or Lookups()
    job = _job(args)
    try:
        # The options' own mistakes first (cheap), before what the environment lacks.
        _check_regex(args.step_regex)
        if args.nnodes is not None:
            parse_nnodes(args.nnodes)
        _check_spare(args)
        replica = _replica(args, look)
        if not replica and not look.environ.get(REPLICA_ENV):
            raise ConfigError(f"no replica id: give --replica ID (or set {REPLICA_ENV})")
        opts = look.resolve(
            replica_id=replica or None,
            devices=[d.strip() for d in args.devices.split(",") if d.strip()]
            if args.devices
            else None,
            job=job,
            addr=args.addr,
            scope=args.scope,
            worker=args.worker if args.worker is not None else (args.node_rank or 0),
            prefix=args.prefix,
            timeout=args.connect_timeout,
            role="supervisor",
            controller_key=args.controller_key,
        )
        launch = _launch(args, opts.devices, look) if args.torchrun_style else None
        opts.rendezvous = _rendezvous(args, launch, opts.host, look)
        opts.nvlink_domain = look.nvlink_domain(opts.devices)
        logs = _logs(args, launch, look)
        checks = _checks(args)
        numa = _numa(args, launch, opts.devices, look)
    except ConfigError:
        raise
    except (AgentError, LaunchError) as e:
        raise ConfigError(str(e)) from None
    if not args.cmd:
        raise ConfigError("no trainer command given")
    hang_s, startup_s, learning = _timeouts(args)
    command = trainer_command(args.cmd, module=args.module, no_python=args.no_python)
    return Config(
        cmd=command,
        opts=opts,
        metrics_addr=args.metrics_addr,
        preflight=args.preflight,
        preflight_expect=args.preflight_expect,
        preflight_timeout_s=args.preflight_timeout,
        checks=checks,
        numa=numa,
        numactl=look.numactl() if numa is not None else None,
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window,
        hang_timeout_s=hang_s,
        startup_timeout_s=startup_s,
        learning=learning,
        step_regex=args.step_regex,
        grace_s=args.grace,
        restart_grace_s=args.restart_grace,
        cleanup_cmd=args.cleanup_cmd,
        prespawn=args.prespawn,
        fork_server=args.fork_server,
        reclaim_timeout_s=args.reclaim_timeout,
        reclaim_tolerance_mib=args.reclaim_tolerance,
        **_local_ckpt(args),
        launch=launch,
        logs=logs,
        monitor_interval_s=args.monitor_interval,
        standalone=args.standalone,
        # Ranks from the controller: nothing can start without it.
        require_controller=args.require_controller or opts.rendezvous is not None,
        preload=(
            look.default_preload(command)
            if not args.preload
            else [m.strip() for m in args.preload.split(",") if m.strip() and m.strip() != "none"]
        ),
    )


def _checks(args: RunArgs) -> CheckSpec | None:
    """The node's checks before a start (agent/supervise/start_checks.py); None: none asked."""
    if args.node_check_endpoint is None and not args.storage_check and not args.check_mounts:
        return None
    from agent.supervise.node_check import EndpointError, parse_endpoint
    from agent.supervise.start_checks import CheckSpec
    from agent.supervise.storage_probe import StorageSpecError, parse_storage

    try:
        endpoint = parse_endpoint(args.node_check_endpoint) if args.node_check_endpoint else None
        storage = tuple(parse_storage(x) for x in args.storage_check or ())
    except (EndpointError, StorageSpecError) as e:
        raise ConfigError(str(e)) from None
    return CheckSpec(
        endpoint=endpoint,
        storage=storage,
        check_mounts=args.check_mounts,
        timeout_s=args.check_timeout,
        interval_s=args.check_interval,
    )


def _numa(
    args: RunArgs, launch: LaunchSpec | None, devices: list[str], look: Lookups
) -> list[Binding] | None:
    """``--numa-bind auto|N``: each local rank's NUMA node and CPUs (agent/supervise/numa.py)."""
    if args.numa_bind is None:
        return None
    from agent.supervise import numa

    nproc = launch.nproc_per_node if launch is not None else 1
    split = launch is not None and launch.rank_devices == "split"
    per_rank = len(devices) // nproc if split else 1  # the first GPU of local rank i: i * this
    try:
        return numa.plan(args.numa_bind, nproc, per_rank, look.topology(), devices)
    except numa.NumaError as e:
        raise ConfigError(str(e)) from None


def _timeouts(args: RunArgs) -> tuple[float, float, Learning]:
    """The hang and startup timeouts (fixed, or the upper bound until learned), and what is
    learned."""
    hang_s, hang = timeout_option(args.hang_timeout, "--hang-timeout", HANG_BOUNDS)
    startup_s, startup = timeout_option(args.startup_timeout, "--startup-timeout", STARTUP_BOUNDS)
    return hang_s, startup_s, Learning(hang=hang, startup=startup, factor=args.timeout_factor)


def timeout_option(
    value: str, name: str, default_bounds: tuple[float, float]
) -> tuple[float, Bounds | None]:
    """A timeout option's value: seconds (fixed), or ``auto[:MIN:MAX]`` (learned within the
    bounds; the fixed value is then MAX, what applies until something is learned)."""
    v = value.strip()
    usage = f"{name} {value!r}: seconds (at least 0.1), or auto, or auto:MIN:MAX"
    if v == "auto" or v.startswith("auto:"):
        lo, hi = default_bounds
        if v != "auto":
            low, colon, high = v[5:].partition(":")
            try:
                lo, hi = float(low), float(high)
            except ValueError:
                raise ConfigError(usage) from None
            if not colon or not 0.1 <= lo <= hi or not math.isfinite(hi):
                raise ConfigError(f"{usage} (0.1 <= MIN <= MAX)")
        return hi, Bounds(lo, hi)
    try:
        seconds = float(v)
    except ValueError:
        raise ConfigError(usage) from None
    if seconds < 0.1 or not math.isfinite(seconds):
        raise ConfigError(usage)
    return seconds, None


def _rendezvous(
    args: RunArgs, launch: LaunchSpec | None, host: str, look: Lookups
) -> Rendezvous | None:
    """What this node brings to the controller's rendezvous (``--nnodes MIN:MAX``), or None
    when its ranks are its own; ``--segment`` checked against it."""
    segment = args.segment if args.segment > 1 else 0
    if launch is None or not launch.from_controller:
        if segment:
            raise ConfigError(
                "--segment needs --nnodes MIN:MAX without --node-rank: the controller assigns "
                "the node ranks, segment by segment"
            )
        return None
    if segment and (launch.min_nodes % segment or launch.nnodes % segment):
        raise ConfigError(
            f"--segment {segment}: --nnodes {launch.min_nodes}:{launch.nnodes} must be whole "
            f"segments (MIN and MAX multiples of {segment})"
        )
    return Rendezvous(
        nproc=launch.nproc_per_node,
        min_nodes=launch.min_nodes,
        max_nodes=launch.nnodes,
        node_rank=args.node_rank,
        addr=args.local_addr or host,
        ports=look.free_ports(),
        spare=args.spare,
        pool=args.spare_pool or None,
        segment=segment,
    )


def _local_ckpt(args: RunArgs) -> dict[str, Any]:
    """The local checkpoint store's settings (agent/supervise/local_ckpt.py)."""
    return {
        "local_ckpt_dir": args.local_ckpt_dir,
        "local_ckpt_max_bytes": _size("--local-ckpt-max", args.local_ckpt_max),
        "local_ckpt_flush_s": args.local_ckpt_flush,
        "persist_dir": args.persist_dir or None,
        "persist_interval_s": args.persist_interval,
        "ckpt_lineage": args.ckpt_lineage or None,
    }


def _size(option: str, text: str) -> int:
    from agent.supervise.local_ckpt import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise ConfigError(f"{option}: {e}") from None


def _check_spare(args: RunArgs) -> None:
    """``--spare`` and ``--spare-pool`` need the controller to assign the node ranks."""
    if not (args.spare or args.spare_pool) or args.ranks_from_controller:
        return
    given = (
        f"--node-rank {args.node_rank}"
        if args.node_rank is not None
        else f"--nnodes {args.nnodes}: one node on its own"
        if args.nnodes is not None
        else "no --nnodes"
    )
    raise ConfigError(
        f"--{'spare' if args.spare else 'spare-pool'} needs ranks from the controller: "
        f"--nnodes MIN:MAX without --node-rank, with --scope job (given: {given})"
    )


def _job(args: RunArgs) -> str:
    """The job to register under: a spare of a pool registers under the pool's name until a
    job claims it (marduk/core/pools.py)."""
    if args.spare_pool == "":
        raise ConfigError("--spare-pool '': name the pool (or leave the option out)")
    if args.spare_pool:
        try:
            check_job(args.spare_pool)
        except ValueError as e:
            raise ConfigError(f"--spare-pool: {e}") from None
    if not (args.spare and args.spare_pool):
        return args.job
    if args.job not in (library.DEFAULT_JOB, args.spare_pool):
        raise ConfigError(
            f"--spare --spare-pool {args.spare_pool} is a spare of the pool, of no job: drop "
            f"--job {args.job} (the job that claims it is the one it serves)"
        )
    return args.spare_pool


def _replica(args: RunArgs, look: Lookups) -> str:
    """``--replica``, or with torchrun's options or --standalone: --rdzv-id if given, else the
    host name (on one node, or each node where the controller assigns the ranks), 'main'
    across nodes with --node-rank."""
    if args.replica or not (args.torchrun_style or args.standalone):
        return args.replica
    if args.rdzv_id != LAUNCH.run_id:
        return args.rdzv_id
    across = args.nnodes is not None and args.nnodes.partition(":")[0] not in ("", "1")
    # Ranks from the controller: each agent is its own worker of the job, named by its host.
    return "main" if across and not args.ranks_from_controller else look.node_name()


def _check_regex(step_regex: str) -> None:
    try:
        re.compile(step_regex)
    except re.error as e:
        raise LaunchError(f"--step-regex {step_regex!r}: {e}") from None


def _launch(args: RunArgs, devices: list[str], look: Lookups) -> LaunchSpec:
    nproc = args.nproc_per_node or str(LAUNCH.nproc_per_node)
    n = (len(devices) or 1) if nproc in ("gpu", "auto") else _count(nproc)
    host, port = parse_endpoint(args.rdzv_endpoint) if args.rdzv_endpoint else (None, None)
    lo, hi = parse_nnodes(args.nnodes or str(LAUNCH.nnodes))
    elastic = args.ranks_from_controller
    if elastic and args.scope != "job":
        raise LaunchError(
            f"--nnodes {args.nnodes} without --node-rank: the controller assigns the node "
            "ranks, which needs --scope job (the whole job restarts together); or give "
            "--node-rank"
        )
    if elastic and args.standalone:
        raise LaunchError(
            f"--nnodes {args.nnodes} without --node-rank: the controller assigns the node "
            "ranks; --standalone cannot"
        )
    launch = LaunchSpec(
        nproc_per_node=n,
        nnodes=hi,
        min_nodes=lo if elastic else 0,
        node_rank=args.node_rank or LAUNCH.node_rank,
        master_addr=args.master_addr or host or LAUNCH.master_addr,
        master_port=args.master_port if args.master_port is not None else port,
        rank_devices=args.rank_devices,
        role=args.role,
        run_id=args.rdzv_id,
        max_restarts=args.max_restarts,
    )
    launch.check_devices(devices)
    if not launch.from_controller:
        look.check_master(launch)
    return launch


def _logs(args: RunArgs, launch: LaunchSpec | None, look: Lookups) -> LogSpec:
    nlocal = launch.nproc_per_node if launch is not None else 1
    return LogSpec(
        log_dir=args.log_dir,
        redirects=parse_std(args.redirects, nlocal, "--redirects"),
        tee=parse_std(args.tee, nlocal, "--tee"),
        local_ranks_filter=_ranks_filter(args.local_ranks_filter),
        prefix_template=(
            default_prefix_template(nlocal, look.environ) if launch is not None else None
        ),
    )


def _ranks_filter(ranks: str) -> frozenset[int] | None:
    """``--local-ranks-filter 0,1``: those local ranks (none given: every one)."""
    if not ranks:
        return None
    parts = [x.strip() for x in ranks.split(",") if x.strip()]
    if not all(x.isdigit() for x in parts):
        raise LaunchError(f"--local-ranks-filter {ranks!r}: local ranks, comma-separated (0,1)")
    return frozenset(int(x) for x in parts)


def _count(nproc: str) -> int:
    """``--nproc-per-node N`` (N >= 1; ``gpu``/``auto`` are read by the caller)."""
    if not nproc.isdigit() or int(nproc) < 1:
        raise LaunchError(
            f"--nproc-per-node {nproc!r}: a number of ranks (1 or more), 'gpu' or 'auto'"
        )
    return int(nproc)


def trainer_command(cmd: list[str], *, module: bool, no_python: bool) -> list[str]:
    """The command to run: as given, or as torchrun runs ``SCRIPT.py ARGS`` and ``-m MODULE``
    (with this interpreter)."""
    if module:
        return [sys.executable, "-m", *cmd]
    if not no_python and cmd and cmd[0].endswith(".py"):
        return [sys.executable, *cmd]
    return cmd


def node_name() -> str:
    """The host name as a replica id (letters, digits, '_' and '-')."""
    name = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:128]
    return name if name[:1].isalnum() else f"node-{name}"[:128]
