"""What ``connect`` and ``marduk agent run`` resolve: argument, then MARDUK_* variable, then
default. Each default of the library is defined here, once."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final, Literal

from agent.channel import handoff
from agent.channel.handoff import Handoff, HandoffError
from agent.errors import AgentError
from marduk.errors import MardukError
from marduk.transport import bus
from marduk.transport.credentials import Credentials
from marduk.wire.protocol import Rendezvous
from marduk.wire.subjects import DEFAULT_PREFIX, check_job, check_replica

DEFAULT_JOB: Final = "default"
DEFAULT_SCOPE: Final = "replica"
# Seconds ``connect`` waits to be registered before it raises AgentError.
CONNECT_TIMEOUT: Final = 30.0
# Seconds between re-registrations until the controller says how often (RegisterReply).
RESYNC_INTERVAL: Final = 30.0


@dataclass(slots=True)
class Options:
    """Everything ``connect`` resolves from arguments, MARDUK_* variables and defaults."""

    job: str
    replica: str
    worker: int
    devices: list[str]
    addr: str
    prefix: str
    scope: Literal["replica", "job"]
    timeout: float
    incarnation: int
    epoch: int
    role: Literal["library", "supervisor"] = "library"
    resync_interval: float = RESYNC_INTERVAL
    host: str = field(default_factory=socket.gethostname)
    credentials: Credentials = field(default_factory=Credentials)
    # Public keys commands must be signed with; None: signatures are not checked (no auth).
    controller_keys: list[str] | None = None
    # Under ``marduk agent run``: its unix socket (the library talks to it, see
    # agent/channel/messages.py).
    agent_socket: str | None = None
    # Ask for ``peer_failed`` notices (another replica of the job restarts or fails).
    peer_notices: bool = False
    # ``marduk agent run --nnodes MIN:MAX``: the node ranks come from the controller.
    rendezvous: Rendezvous | None = None
    # The node's NVLink domain (NVML's ClusterUUID; agent/library/devices.py), "" if unknown.
    nvlink_domain: str = ""


def resolve_controller_keys(
    given: str | None, credentials: Credentials, env: dict[str, str] | None = None
) -> list[str] | None:
    """Keys to verify command signatures with: the argument, MARDUK_CONTROLLER_KEY, or the
    ``controller.pub`` that ``marduk auth init`` wrote beside the nkey seed file."""
    from marduk.transport.auth import CONTROLLER_PUB, load_public_keys

    env = dict(os.environ) if env is None else env
    value = given or env.get("MARDUK_CONTROLLER_KEY")
    if not value and credentials.nkey is not None:
        beside = credentials.nkey.parent / CONTROLLER_PUB
        value = str(beside) if beside.is_file() else None
    return load_public_keys(value) if value else None


def resolve_options(
    replica_id: str | None,
    devices: list[str] | None,
    job: str | None,
    addr: str | None,
    scope: str | None,
    *,
    worker: int | None = None,
    prefix: str | None = None,
    timeout: float = CONNECT_TIMEOUT,
    role: Literal["library", "supervisor"] = "library",
    credentials: Credentials | None = None,
    controller_key: str | None = None,
    peer_notices: bool = False,
) -> Options:
    try:
        given = Handoff.from_env()
    except HandoffError as e:
        raise AgentError(str(e)) from None
    replica = replica_id or given.replica
    if not replica:
        raise AgentError(f"replica_id is required (or set {handoff.REPLICA})")
    job = job or given.job or DEFAULT_JOB
    scope = scope or given.scope or DEFAULT_SCOPE
    if scope not in ("replica", "job"):
        raise AgentError(f"scope must be 'replica' or 'job', not {scope!r}")
    try:
        check_job(job)
        check_replica(replica)
    except ValueError as e:
        raise AgentError(str(e)) from None
    if devices is None:
        from agent.library import devices as found

        # The supervisor never imports a framework (it forks trainers, and jax would take the
        # accelerators): it asks NVML, then a child process.
        devices = found.local_device_uuids() if role == "library" else found.node_device_uuids()
    creds = credentials if credentials is not None else bus.default_credentials()
    try:
        creds.check()
        keys = resolve_controller_keys(controller_key, creds)
    except MardukError as e:
        raise AgentError(str(e)) from None
    return Options(
        job=job,
        replica=replica,
        worker=worker if worker is not None else (given.worker or 0),
        devices=list(devices),
        addr=addr or bus.default_addr(),
        prefix=prefix or given.prefix or DEFAULT_PREFIX,
        scope=scope,  # type: ignore[arg-type]
        timeout=timeout,
        incarnation=given.restart_count,
        epoch=given.epoch,
        agent_socket=given.agent_socket if role == "library" else None,
        role=role,
        credentials=creds,
        controller_keys=keys,
        peer_notices=peer_notices,
    )


def with_nkey(
    nkey: str | os.PathLike[str] | None, credentials: Credentials | None
) -> Credentials | None:
    """``credentials`` with the nkey seed file ``nkey`` (the ``connect(nkey=...)`` argument)."""
    if nkey is None:
        return credentials
    return replace(credentials or Credentials.from_env(), nkey=Path(nkey))
