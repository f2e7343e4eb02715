"""The ``MARDUK_*`` hand-off: what a trainer learns from its environment, as one typed object.

``marduk agent run`` writes it (``Handoff.to_env()``) into every trainer it starts; the fork
server and a prestarted trainer pass it on; the library reads it back (``Handoff.from_env()``).
A trainer started without a supervisor may still be given some of these variables by hand (a
Kubernetes manifest setting ``MARDUK_REPLICA_ID``): every field is optional, and a variable
that is set but unreadable is an error that names it.

The variable names are defined here and nowhere else in the code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Final, Literal

JOB: Final = "MARDUK_JOB"
REPLICA: Final = "MARDUK_REPLICA_ID"
WORKER: Final = "MARDUK_WORKER"
DEVICES: Final = "MARDUK_DEVICES"
SCOPE: Final = "MARDUK_SCOPE"
ADDR: Final = "MARDUK_ADDR"
PREFIX: Final = "MARDUK_PREFIX"
EPOCH: Final = "MARDUK_EPOCH"
RESTART_COUNT: Final = "MARDUK_RESTART_COUNT"
SUPERVISOR_PID: Final = "MARDUK_SUPERVISOR_PID"
AGENT_SOCKET: Final = "MARDUK_AGENT_SOCKET"
WARM_START: Final = "MARDUK_WARM_START"
# The node-local snapshot store the agent keeps (agent/supervise/local_ckpt.py), its size bound,
# how long a notice gives the pending snapshot, where the agent writes persistent copies, and the
# lineage snapshots must carry to be restored (agent/library/snapshots.py).
LOCAL_CKPT_DIR: Final = "MARDUK_LOCAL_CKPT_DIR"
LOCAL_CKPT_MAX_BYTES: Final = "MARDUK_LOCAL_CKPT_MAX_BYTES"
LOCAL_CKPT_FLUSH_MS: Final = "MARDUK_LOCAL_CKPT_FLUSH_MS"
PERSIST_CKPT_DIR: Final = "MARDUK_PERSIST_CKPT_DIR"
CKPT_LINEAGE: Final = "MARDUK_CKPT_LINEAGE"

# How a warm trainer was started: forked from the fork server ("zygote") or from a prestarted
# trainer ("standby": the value trainers have read since before the name; no controller here).
WarmStart = Literal["zygote", "standby"]


class HandoffError(ValueError):
    """A ``MARDUK_*`` variable is set to something that cannot be read."""


@dataclass(frozen=True, slots=True)
class Handoff:
    """The ``MARDUK_*`` variables of a trainer's environment. None: not set."""

    job: str | None = None
    replica: str | None = None
    worker: int | None = None
    devices: tuple[str, ...] | None = None
    scope: str | None = None
    addr: str | None = None
    prefix: str | None = None
    # The epoch the trainer was started for and how many trainers the supervisor started before
    # it; 0 for a process started by hand.
    epoch: int = 0
    restart_count: int = 0
    supervisor_pid: int | None = None
    # The supervisor's unix socket (agent/channel/messages.py): set means "talk to it, don't
    # register".
    agent_socket: str | None = None
    # How a warm trainer was started (WarmStart); None: a cold start.
    warm_start: WarmStart | None = None
    # The local snapshot store (None: the agent keeps none) and what goes with it.
    local_ckpt_dir: str | None = None
    local_ckpt_max_bytes: int | None = None
    local_ckpt_flush_ms: int | None = None
    persist_ckpt_dir: str | None = None
    ckpt_lineage: str | None = None

    @property
    def supervised(self) -> bool:
        """Started by ``marduk agent run``: the library talks to it over ``agent_socket``."""
        return bool(self.agent_socket)

    def to_env(self) -> dict[str, str]:
        """The variables of the fields that are set (epoch and restart count always)."""
        env: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            env[_VAR[f.name]] = ",".join(value) if f.name == "devices" else str(value)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Handoff:
        """Read the variables of ``env`` (default ``os.environ``); raise HandoffError naming
        the variable that is set but unreadable. An empty variable counts as not set."""
        env = os.environ if env is None else env

        def text(var: str) -> str | None:
            value = env.get(var, "").strip()
            return value or None

        warm = text(WARM_START)
        if warm is not None and warm not in ("zygote", "standby"):
            raise HandoffError(f"{WARM_START} must be 'zygote' or 'standby', not {warm!r}")
        scope = text(SCOPE)
        if scope is not None and scope not in ("replica", "job"):
            raise HandoffError(f"{SCOPE} must be 'replica' or 'job', not {scope!r}")
        return cls(
            job=text(JOB),
            replica=text(REPLICA),
            worker=_count(env, WORKER),
            devices=parse_devices(env.get(DEVICES)),
            scope=scope,
            addr=text(ADDR),
            prefix=text(PREFIX),
            epoch=_count(env, EPOCH) or 0,
            restart_count=_count(env, RESTART_COUNT) or 0,
            supervisor_pid=_count(env, SUPERVISOR_PID),
            agent_socket=text(AGENT_SOCKET),
            warm_start=warm,  # type: ignore[arg-type]  # checked above
            local_ckpt_dir=text(LOCAL_CKPT_DIR),
            local_ckpt_max_bytes=_count(env, LOCAL_CKPT_MAX_BYTES),
            local_ckpt_flush_ms=_count(env, LOCAL_CKPT_FLUSH_MS),
            persist_ckpt_dir=text(PERSIST_CKPT_DIR),
            ckpt_lineage=text(CKPT_LINEAGE),
        )


_VAR: Final = {
    "job": JOB,
    "replica": REPLICA,
    "worker": WORKER,
    "devices": DEVICES,
    "scope": SCOPE,
    "addr": ADDR,
    "prefix": PREFIX,
    "epoch": EPOCH,
    "restart_count": RESTART_COUNT,
    "supervisor_pid": SUPERVISOR_PID,
    "agent_socket": AGENT_SOCKET,
    "warm_start": WARM_START,
    "local_ckpt_dir": LOCAL_CKPT_DIR,
    "local_ckpt_max_bytes": LOCAL_CKPT_MAX_BYTES,
    "local_ckpt_flush_ms": LOCAL_CKPT_FLUSH_MS,
    "persist_ckpt_dir": PERSIST_CKPT_DIR,
    "ckpt_lineage": CKPT_LINEAGE,
}


def parse_devices(raw: str | None) -> tuple[str, ...] | None:
    """``MARDUK_DEVICES``: comma-separated ids; None when unset or empty."""
    if raw is None or not raw.strip():
        return None
    return tuple(d.strip() for d in raw.split(",") if d.strip())


def _count(env: Mapping[str, str], var: str) -> int | None:
    raw = env.get(var, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise HandoffError(f"{var} must be a whole number, not {raw!r}") from None
    if value < 0:
        raise HandoffError(f"{var} must not be negative, not {value}")
    return value
