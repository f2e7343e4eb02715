"""The library a trainer imports: ``connect`` (a synchronous ``Client``) and ``connect_async``.

Both register this worker with the controller (``AsyncClient``, agent/library/nats_client.py), or,
under ``marduk agent run``, talk to that supervisor instead (``LocalAsyncClient``,
agent/channel/messages.py); ``Client`` runs either on a background thread (named ``marduk-agent``)
for synchronous training loops. Nothing raises into the training loop after ``connect`` has
returned: a lost connection is retried in the background (visible as ``state``), bad messages are
counted and recorded in ``errors``, and every wait has a timeout.

Commands are fenced by epochs (agent/channel/fencing.py): a command whose epoch is below the last
one received is stale, and one at that epoch that says nothing new is a duplicate (the controller
resends commands until they are confirmed); both are dropped (``stats["dropped_stale"]``). A command
at the same epoch with more devices is an update (another device failed and joined the restart in
flight) and is delivered again (``stats["updates"]``): act on each epoch once, read its devices.

The modules, by role: ``options`` (settings and their defaults), ``command``, ``inbox``
(fencing and delivery, shared), ``nats_client``, ``local``, ``transport`` (the interface and
the choice), ``sync_client`` (the facade), ``perf`` (step and section times, a summary per
window), and this one, the entry points. The names below are
re-exported so that ``from agent.library.client import ...`` keeps working.
"""

from __future__ import annotations

import os
from typing import cast

from agent.errors import AgentError
from agent.library.command import Command, OnCommand
from agent.library.inbox import CommandInbox, State
from agent.library.nats_client import AsyncClient
from agent.library.options import (
    CONNECT_TIMEOUT,
    Options,
    resolve_controller_keys,
    resolve_options,
    with_nkey,
)
from agent.library.params import OnParams, ParamsView
from agent.library.sync_client import Client
from agent.library.transport import AgentClient, open_client
from marduk.transport.credentials import Credentials

__all__ = [
    "AgentClient",
    "AgentError",
    "AsyncClient",
    "Client",
    "Command",
    "CommandInbox",
    "OnCommand",
    "OnParams",
    "Options",
    "ParamsView",
    "State",
    "connect",
    "connect_async",
    "resolve_controller_keys",
    "resolve_options",
]


async def connect_async(
    replica_id: str | None = None,
    devices: list[str] | None = None,
    job: str | None = None,
    addr: str | None = None,
    scope: str | None = None,
    on_command: OnCommand | None = None,
    *,
    worker: int | None = None,
    prefix: str | None = None,
    timeout: float = CONNECT_TIMEOUT,
    nkey: str | os.PathLike[str] | None = None,
    credentials: Credentials | None = None,
    controller_key: str | None = None,
    peer_notices: bool = False,
    on_params: OnParams | None = None,
) -> AsyncClient:
    """Register this worker and return once registered; raise AgentError after ``timeout``.

    Arguments left out come from MARDUK_REPLICA_ID, MARDUK_JOB (default ``default``),
    MARDUK_ADDR, MARDUK_SCOPE (default ``replica``), MARDUK_WORKER, MARDUK_PREFIX; ``devices``
    from MARDUK_DEVICES or ``local_device_uuids()``. Credentials: ``nkey`` (a seed file) or
    ``credentials``, else MARDUK_NKEY / MARDUK_CREDS / MARDUK_USER, MARDUK_PASSWORD /
    MARDUK_TOKEN / MARDUK_TLS_*. ``controller_key`` (or MARDUK_CONTROLLER_KEY, or the
    ``controller.pub`` beside the nkey file): commands not signed with it are dropped.
    ``peer_notices``: also receive ``peer_failed`` notices (``Command.is_notice``) when another
    replica of the job restarts or fails; they need no ack and set no ``failed``.
    ``on_params``: called with ``client.params`` when the job's live parameters change (and
    with the current ones at registration, if any were set); see agent/library/params.py.
    """
    opts = resolve_options(
        replica_id,
        devices,
        job,
        addr,
        scope,
        worker=worker,
        prefix=prefix,
        timeout=timeout,
        credentials=with_nkey(nkey, credentials),
        controller_key=controller_key,
        peer_notices=peer_notices,
    )
    client = open_client(opts, on_command, None)
    client.live.on_params = on_params
    await client.start()
    # Under a supervisor this is a LocalAsyncClient: the same interface (AgentClient).
    return cast(AsyncClient, client)


def connect(
    replica_id: str | None = None,
    devices: list[str] | None = None,
    job: str | None = None,
    addr: str | None = None,
    scope: str | None = None,
    on_command: OnCommand | None = None,
    *,
    worker: int | None = None,
    prefix: str | None = None,
    timeout: float = CONNECT_TIMEOUT,
    nkey: str | os.PathLike[str] | None = None,
    credentials: Credentials | None = None,
    controller_key: str | None = None,
    peer_notices: bool = False,
    on_params: OnParams | None = None,
) -> Client:
    """Register this worker with the controller and return a ``Client``.

    Returns once registered, or raises AgentError with one clear line after ``timeout``
    seconds. See ``connect_async`` for where arguments left out come from.
    """
    opts = resolve_options(
        replica_id,
        devices,
        job,
        addr,
        scope,
        worker=worker,
        prefix=prefix,
        timeout=timeout,
        credentials=with_nkey(nkey, credentials),
        controller_key=controller_key,
        peer_notices=peer_notices,
    )
    return Client(opts, on_command, on_params)
