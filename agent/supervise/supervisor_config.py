"""What ``marduk agent run`` is configured with: ``SupervisorConfig``, each default defined here
once (the supervision core's numbers in ``Limits``, agent/supervise/supervision.py).

No slots: the dataclass's class attributes are its defaults, and ``marduk agent run``'s options
take theirs from them (agent/supervise/cli.py), so the CLI, ``--help`` and code that builds a config
directly cannot disagree. Light to import: the CLI reads it on every ``marduk`` command.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Final

from agent.library.snapshot_format import FLUSH_S
from agent.supervise.launch import LaunchSpec, LogSpec
from agent.supervise.learned_timeouts import Learning
from agent.supervise.supervision import Limits

if TYPE_CHECKING:
    from agent.library.options import Options
    from agent.supervise.numa import Binding
    from agent.supervise.start_checks import CheckSpec

DEFAULT_STEP_REGEX: Final = r"\bstep[\s:=#]+(\d+)"
# Seconds the supervisor waits to register at start: longer than the library's
# (agent/options.CONNECT_TIMEOUT), since a job's pods and its controller start together.
CONNECT_TIMEOUT_S: Final = 60.0


@dataclass
class SupervisorConfig:
    cmd: list[str]
    opts: Options
    max_restarts: int = Limits.max_restarts
    restart_window_s: float = Limits.restart_window_s
    hang_timeout_s: float = Limits.hang_timeout_s
    startup_timeout_s: float = Limits.startup_timeout_s
    # ``auto``: learned from the job within bounds (agent/supervise/learned_timeouts.py).
    learning: Learning = Limits.learning
    step_regex: str = DEFAULT_STEP_REGEX
    grace_s: float = 30.0
    # SIGTERM to SIGKILL when the scope restarts at a new epoch (rules.Grace): its other
    # processes stop at the same moment, so nothing that needs them can complete.
    restart_grace_s: float = 0.5
    tail_lines: int = 200
    cleanup_cmd: str = ""
    stale_files: list[str] = field(default_factory=lambda: ["/tmp/libtpu_lockfile"])
    # Start trainers warm, with these modules imported ahead of time: forked from a fork
    # server (agent/supervise/zygote.py) or, with fork_server off, from one prestarted trainer
    # each (agent/supervise/prestarted.py).
    prespawn: bool = True
    preload: list[str] = field(default_factory=list)
    fork_server: bool = True
    # How long a trainer start waits for a fork server still importing before it starts cold.
    fork_server_timeout_s: float = 600.0
    # How often a running trainer's progress (last step and when) is reported.
    status_interval_s: float = 15.0
    # Serve /metrics, /healthz and /readyz (ready: every rank is stepping) on HOST:PORT.
    metrics_addr: str | None = None
    # Before a restart after a device-class failure (a check_device diagnosis, or a restart command
    # naming devices), check the devices in a separate process (agent/supervise/preflight.py).
    preflight: bool = False
    preflight_timeout_s: float = 120.0
    preflight_expect: int | None = None  # devices the check must see (default: any)
    # The node's checks before the first start and before such a restart (the node check
    # service, storage, mounts: agent/supervise/start_checks.py); None: none.
    checks: CheckSpec | None = None
    # Each local rank's NUMA node and its CPUs (agent/supervise/numa.py), and numactl where it
    # is installed (else each trainer binds its own CPUs); None: no binding.
    numa: list[Binding] | None = None
    numactl: str | None = None
    # Between incarnations, wait for the GPUs' memory to drop below this (0 s: don't wait).
    reclaim_timeout_s: float = 50.0
    reclaim_tolerance_mib: float = 512.0
    # torchrun's contract (ranks, master, devices per rank); None: one trainer, none of
    # torchrun's variables set (as before --nproc-per-node existed).
    launch: LaunchSpec | None = None
    logs: LogSpec = field(default_factory=LogSpec)
    # How often hangs, startup and sections are checked (exits are seen at once); None:
    # ``tick_interval_s``.
    monitor_interval_s: float | None = None
    # Start without waiting for a controller (it is joined in the background when it appears).
    standalone: bool = False
    # No controller at start: exit 1 (SETUP) instead of running standalone.
    require_controller: bool = False
    # Standalone: seconds between attempts to reach the controller.
    join_interval_s: float = 2.0
    # The node-local checkpoint store (agent/supervise/local_ckpt.py): where ("auto": on
    # tmpfs, per job and member; "none": no store), its size bound (bytes; 0: the
    # filesystem's), the seconds a notice gives the trainers' last snapshot, the persistent
    # copies (a directory; None: none) and how often, and the lineage snapshots must carry.
    local_ckpt_dir: str = "auto"
    local_ckpt_max_bytes: int = 0
    local_ckpt_flush_s: float = FLUSH_S
    persist_dir: str | None = None
    persist_interval_s: float = 60.0
    ckpt_lineage: str | None = None

    # ``--monitor-interval``'s default, as its help says it.
    TICK_DEFAULT: ClassVar[str] = "hang timeout / 4, at most 1"

    @property
    def tick_interval_s(self) -> float:
        """Seconds between hang and section checks: ``monitor_interval_s``, else a quarter of
        the hang timeout, at most 1 s."""
        shortest = self.learning.hang.low if self.learning.hang else self.hang_timeout_s
        return self.monitor_interval_s or min(1.0, shortest / 4)


def default_preload(script: str = "") -> list[str]:
    """The framework whose import dominates the trainer's start, when this interpreter has it:
    torch for a script that imports torch and not jax (a torchrun drop-in), else jax."""
    if _imports(script, "torch") and not _imports(script, "jax") and _installed("torch"):
        return ["torch"]
    return ["jax"] if _installed("jax") else []


def _imports(source: str, module: str) -> bool:
    return re.search(rf"^\s*(import|from)\s+{module}\b", source, re.MULTILINE) is not None


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def script_source(cmd: list[str], limit: int = 1 << 16) -> str:
    """The start of ``python SCRIPT``'s script ("" for anything else, or unreadable)."""
    if len(cmd) < 2 or not cmd[1].endswith(".py"):
        return ""
    try:
        with open(cmd[1], encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return ""
