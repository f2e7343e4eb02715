"""The controller's settings (the CLI maps options and ``MARDUK_*`` variables onto them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from marduk.core.policy import PolicyConfig
from marduk.core.straggler_policy import ActionConfig
from marduk.core.stragglers import StragglerConfig
from marduk.errors import MardukError
from marduk.transport import bus
from marduk.transport.credentials import Credentials
from marduk.transport.embedded import default_state_dir
from marduk.wire.protocol import (
    MAX_MESSAGE_BYTES,
)


@dataclass(slots=True)
class ControllerSettings:
    """Controller settings; the CLI maps options and MARDUK_* variables onto these."""

    addr: str = bus.DEFAULT_ADDR
    """NATS URL(s). Local and not listening: an embedded server is started (unless disabled)."""
    prefix: str = "marduk"
    """Subject prefix shared by every Marduk process of a deployment."""
    embedded: bool = True
    """Start an embedded nats-server when nothing listens at a local ``addr``."""
    state_dir: Path = field(default_factory=default_state_dir)
    """Where the embedded server keeps its JetStream store, log and pid file."""
    kv_replicas: int = 1
    """Replicas of the buckets and the health stream (3 on a production NATS cluster)."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    """Inbound messages larger than this are rejected."""
    connect_timeout: float = 10.0
    """How long to wait for NATS at startup."""
    lease_ttl: float = 2.0
    """Seconds a leader's lease lasts without renewal; a standby takes over after that."""
    dedup_window_s: float = 3600.0
    """How long handled health event ids are remembered (across restarts and failovers)."""
    ack_wait_s: float = 2.0
    """A health event delivered but not acknowledged is redelivered after this long (also the
    worst delay of an event delivered just before a new leader's subscription reached the
    consumer's node, on a cluster)."""
    tick_interval_s: float = 0.25
    """How often the leader lets time pass in the policy (stale workers, resends)."""
    credentials: Credentials = field(default_factory=Credentials)
    """How the controller authenticates to NATS (``--nkey``, ``--creds``, TLS, ...)."""
    auth_dir: Path | None = None
    """``marduk auth init`` directory: the embedded server enforces its configuration, and the
    controller uses its ``controller.nk`` unless other credentials are given."""
    insecure: bool = False
    """Allow an embedded server without auth on a non-loopback address."""
    stop_grace_s: float = 2.0
    """How long a stop waits for the work in flight (requests, events' commits) to finish
    before it cancels what is left and names it in the log."""
    metrics_addr: str | None = None
    """Serve /metrics, /healthz and /readyz on HOST:PORT (off when None)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    """When a rank is a straggler (marduk/core/stragglers.py; operations.md, *Stragglers*)."""
    straggler_actions: ActionConfig = field(default_factory=ActionConfig)
    """What is done about one (marduk/core/straggler_policy.py): report only by default."""


class StartupError(MardukError):
    pass
