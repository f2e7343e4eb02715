"""A trainer's requests (``client.request``), answered by ``marduk agent run``.

The trainer's library sends ``request`` on the trainer channel (agent/channel/messages.py); this
checks it again (agent/channel/requests.py: any process of the trainer's may write to the
channel), acts on it and answers:

* ``stop_restarting``: the supervision core restarts the trainers no more
  (``Supervision.stop_restarting``); the controller, when one is joined, is told (an event);
* ``exclude_node`` and ``device_bad``: relayed to the controller under this agent's
  registration (``marduk.<job>.request``: the trainer cannot speak for another worker), whose
  answer is the trainer's. Standalone, refused: only a controller takes devices out of service.

Every request is counted (``requests.<kind>``), every refusal by its code
(``requests_refused.<code>``) and logged; none is fatal.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from agent.channel.messages import Answer, Request
from agent.channel.requests import Refusal, check
from agent.library.client import AsyncClient
from agent.supervise.supervision import Supervision
from marduk.errors import MardukError, RequestRejected
from marduk.wire import protocol as wire

log = logging.getLogger("agent.supervisor")

RELAY_TIMEOUT_S = 5.0  # for the controller's answer


class TrainerRequests:
    """Answers each local rank's requests: the core for ``stop_restarting``, the controller
    (the ``client()`` joined, if any) for the others."""

    def __init__(
        self,
        core: Supervision,
        client: Callable[[], AsyncClient | None],
        stats: Counter[str],
        spawn: Callable[[Coroutine[Any, Any, None], str], object],
    ) -> None:
        self._core = core
        self._client = client
        self._stats = stats
        self._spawn = spawn

    async def answer(self, rank: int, req: Request) -> Answer:
        refusal = check(req.kind, req.device, req.reason)
        if refusal is not None:
            return self._refuse(req, refusal)
        self._stats[f"requests.{req.kind}"] += 1
        said = f"local rank {rank} asks {req.kind}" + (f": {req.reason}" if req.reason else "")
        client = self._client()
        if req.kind == "stop_restarting":
            self._core.stop_restarting(f"the trainer asked ({req.reason or 'stop_restarting'})")
            log.warning("%s; the agent ends with the trainer, restarting it no more", said)
            if client is not None:  # an event for the watchers; the answer does not wait
                self._spawn(self._relay_quietly(client, rank, req), "request")
            return Answer(
                id=req.id,
                accepted=True,
                detail="not restarted again: the agent ends with the trainer's exit code",
            )
        if client is None:
            why = "standalone (no controller joined): only a controller takes devices out"
            return self._refuse(req, Refusal("standalone", why))
        log.warning("%s; asking the controller", said)
        try:
            reply = await client.workload_request(self._wire(client, rank, req), RELAY_TIMEOUT_S)
        except RequestRejected as e:
            return self._refuse(req, Refusal(e.code, e.detail))
        except MardukError as e:
            return self._refuse(req, Refusal("no_answer", str(e)))
        log.warning("the controller answers %s: %s", req.kind, reply.detail)
        return Answer(id=req.id, accepted=True, detail=reply.detail)

    def _wire(self, client: AsyncClient, rank: int, req: Request) -> wire.WorkloadRequest:
        o = client.opts
        return wire.WorkloadRequest(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            kind=req.kind,  # type: ignore[arg-type]  # checked: one of KINDS
            rank=rank,
            device=req.device,
            reason=req.reason,
            request_id=secrets.token_hex(8),
        )

    async def _relay_quietly(self, client: AsyncClient, rank: int, req: Request) -> None:
        try:
            await client.workload_request(self._wire(client, rank, req), RELAY_TIMEOUT_S)
        except MardukError as e:
            log.warning("the controller was not told of %s: %s", req.kind, e)

    def _refuse(self, req: Request, refusal: Refusal) -> Answer:
        self._stats[f"requests_refused.{refusal.code[:64]}"] += 1
        log.warning("request %.64r from the trainer refused: %s", req.kind, refusal.why)
        return Answer(id=req.id, accepted=False, detail=refusal.why)
