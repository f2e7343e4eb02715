"""Leading and standing by: takeover, step-down, the standby's prepared state.

See docs/architecture.md, *Leadership*.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
from nats import micro
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.service import Service as MicroService

from marduk import __version__
from marduk.aio import Pulse, wait_any
from marduk.controller.commit import CommitPipeline
from marduk.controller.context import Context
from marduk.controller.endpoint_stats import ServiceTallies
from marduk.controller.leadership import Leadership
from marduk.core.policy import Policy
from marduk.core.role import Event, Role, RoleMachine
from marduk.errors import MardukError
from marduk.store.health_stream import HealthConsumer
from marduk.store.kv import Fenced
from marduk.store.mirror import StateMirror
from marduk.store.state import Loaded, StateStore
from marduk.transport.credentials import redact
from marduk.wire.protocol import ControllerInfo, Hello, encode

log = logging.getLogger("marduk.controller")

_PREPARE_QUIET_S = 0.2
_PREPARE_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class Opened:
    """What the shell opens at start, each None until it is (and after a failed open)."""

    store: Callable[[], StateStore | None]
    mirror: Callable[[], StateMirror | None]
    health: Callable[[], HealthConsumer | None]
    lease: Callable[[], Leadership | None]
    url: Callable[[], str]
    """The NATS URL we connected to (for the log)."""


@dataclass(frozen=True, slots=True)
class Serving:
    """What a leader serves, from the edge and the standbys: the micro endpoints (on a service,
    counted in its tallies), the health consumer's callback and the standbys' announcements."""

    add_endpoints: Callable[[MicroService, ServiceTallies], Awaitable[None]]
    on_health: Callable[[Msg], Awaitable[None]]
    on_standby: Callable[[Msg], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Taken:
    """A term's state: the policy to lead with, the records it was made of, and from where."""

    policy: Policy
    loaded: Loaded
    source: str


class Takeover:
    """Standby and leader: prepare a takeover, take the state over and subscribe when elected,
    stop serving when deposed or stepping down.

    Handed the role (``roles``, ``role_pulse`` and the ``serving`` event waiters see), the
    commit pipeline it opens and drains, what the shell opened (``opened``), what a leader
    serves (``serving_with``), and, as callables: ``adopt`` (lead with the policy a takeover
    made), ``info`` (the controller's, for ``Hello``) and ``die`` (a bug: end the process)."""

    def __init__(
        self,
        ctx: Context,
        *,
        roles: RoleMachine,
        role_pulse: Pulse,
        serving: asyncio.Event,
        pipeline: CommitPipeline,
        opened: Opened,
        serving_with: Serving,
        adopt: Callable[[Policy], None],
        info: Callable[[], ControllerInfo],
        die: Callable[[str], None],
    ) -> None:
        self._ctx = ctx
        self._roles = roles
        self._role_pulse = role_pulse
        self._serving = serving
        self._pipeline = pipeline
        self._opened = opened
        self._serves = serving_with
        self._adopt = adopt
        self._info = info
        self._die = die
        self._term_task: asyncio.Task[None] | None = None
        self._subs: list[Subscription] = []
        self._service: MicroService | None = None
        # A standby's policy built from its mirror ahead of a takeover: (mirror version, policy).
        self._prepared: tuple[int, Policy] | None = None

    def cancel_term(self) -> asyncio.Task[None] | None:
        """Cancel the takeover in progress, if any; the task, to await."""
        task, self._term_task = self._term_task, None
        if task is not None:
            task.cancel()
        return task

    async def on_elected(self, term: int) -> None:
        # Not awaited by the lease loop: renewals go on while the state is brought in.
        if self._roles.handle(Event.ELECTED, f"term {term}") is not Role.TAKING_OVER:
            return  # failed or stopping: the lease lapses unserved
        if self._term_task is not None:
            self._term_task.cancel()
        self._term_task = asyncio.create_task(self.lead(term), name=f"lead-term-{term}")

    async def lead(self, term: int) -> None:
        try:
            await self.start_serving(term)
        except asyncio.CancelledError:
            raise
        except Fenced as e:
            # The store has a later term than our lease (a successor claimed it, or the lease
            # bucket was recreated and its terms started again): campaign above it next time.
            lease = self._opened.lease()
            if lease is not None:
                lease.campaign_above(e.term)
            self._ctx.stats["store.fenced"] += 1
            await self.step_down(f"could not claim term {term} in the store: {e}", term)
        except (MardukError, OSError, TimeoutError, nats.errors.Error) as e:
            # NATS or JetStream not answering right now: let a standby (or us, later) try.
            self._ctx.stats["errors.takeover"] += 1
            await self.step_down(f"could not start serving (term {term}): {e}", term)
        except Exception as e:
            # A bug: campaigning again would fail the same way. End the process (exit 1) so
            # its supervisor restarts it and a standby leads meanwhile.
            log.exception("could not start serving (term %d)", term)
            self._die(f"could not start serving: {type(e).__name__}: {e}")

    async def start_serving(self, term: int) -> None:
        t0 = time.monotonic()
        taken = await self.load_state(term)
        self._adopt(taken.policy)
        t_state = time.monotonic()
        # Handlers act from here on: a stored event the consumer delivers the moment it is
        # subscribed must be handled, not left for redelivery after ack_wait.
        self._pipeline.reopen()
        self._roles.handle(Event.TOOK_OVER, f"term {term}, state from {taken.source}")
        await self.subscribe(term)
        if self._roles.is_(Role.SERVING):
            self._serving.set()
        # Agents re-register when they hear this: a level-triggered resync after a takeover.
        await self.publish_hello()
        self._ctx.stats["leader.terms"] += 1
        loaded = taken.loaded
        log.info(
            "controller %s serving prefix %r at %s (leader, term %d; state from %s: "
            "%d worker(s), %d device(s), %d epoch(s) in %.0f ms: state %.0f ms, subscribing "
            "%.0f ms)",
            self._ctx.controller_id,
            self._ctx.subjects.prefix,
            redact(self._opened.url()),
            term,
            taken.source,
            len(loaded.workers),
            sum(1 for _ in taken.policy.drmap.devices()),  # not device_to_replicas: 0.15 s
            len(loaded.epochs),
            (time.monotonic() - t0) * 1000,
            (t_state - t0) * 1000,
            (time.monotonic() - t_state) * 1000,
        )

    async def load_state(self, term: int) -> Taken:
        """Claim the term in the store and make the policy to lead with: from the standby's
        mirror (prepared ahead if nothing changed since) or, if it lags, from the bucket."""
        nc, store, mirror = self._ctx.connection(), self._opened.store(), self._opened.mirror()
        assert store is not None and mirror is not None
        # Our first write: from now on no write of an earlier term (a lapsed leader's delayed
        # or reconnect-buffered one) can land, so the state read below is final (the store
        # refuses it; docs/decisions.md #13). Raises Fenced if a later term claimed it.
        await store.claim_term(term, self._ctx.controller_id)
        js = nc.jetstream(timeout=5.0)
        up_to_date = await mirror.caught_up(js)
        if up_to_date:
            # The handled events are read once the mirror has caught up, not while it does: a
            # deposed leader's last dedup records land before the state they go with, and
            # reading them first could miss one (the event would be handled twice). The events
            # bucket is not mirrored: its keys expire without a delete a watch would see.
            replies = await store.load_handled()
            prepared, self._prepared = self._prepared, None
            loaded, source = mirror.snapshot(), "mirror"
            if prepared is not None and prepared[0] == mirror.version:
                # Built while we stood by from exactly what the mirror holds now (no await
                # since the check).
                policy, source = prepared[1], "mirror, prepared"
                self._ctx.stats["state.from_prepared"] += 1
            else:
                policy = self.build_policy(loaded)
        else:
            self._prepared = None
            loaded, source = await store.load(), "bucket"
            replies = loaded.handled
            policy = self.build_policy(loaded)
        policy.resume(replies, time.time())
        self._ctx.stats["state.skipped_records"] += loaded.skipped
        return Taken(policy, loaded, source)

    async def subscribe(self, term: int) -> None:
        """The micro service's endpoints, the standby announcements, the health consumer."""
        nc, health = self._ctx.connection(), self._opened.health()
        assert health is not None
        s, me = self._ctx.subjects, self._ctx.controller_id
        # A NATS micro service: `nats micro ls|info|stats` and $SRV.PING find the leader, its
        # endpoints and version (standbys serve nothing, so they are not listed). Each
        # endpoint's stats ``data`` is what its requests really came to (endpoint_stats).
        tallies = ServiceTallies()
        self._service = await micro.add_service(
            nc,
            name="marduk",
            version=__version__,
            description="Marduk controller: device<->replica map, targeted restarts",
            metadata={
                "prefix": s.prefix,
                "controller_id": me,
                "term": str(term),
            },
            # Its own queue group, not a shared one: a leader whose lease lapsed and has not
            # unsubscribed yet must not take a share of the requests (it drops them); each
            # controller sees every request and only the one that leads answers.
            queue_group=f"marduk-{me}",
            stats_handler=tallies.stats_handler,
        )
        await self._serves.add_endpoints(self._service, tallies)
        self._subs = [await nc.subscribe(s.standby, cb=self._serves.on_standby)]
        lease = self._opened.lease()
        gone = lease is not None and lease.holder_gone
        await health.start(self._serves.on_health, previous_gone=gone)
        await nc.flush()

    async def step_down(self, why: str, term: int) -> None:
        """Stop serving and give the lease up: whoever leads next rebuilds from the store.

        Tied to ``term``: a step-down decided in one term never stops or resigns a later one
        (we may have been deposed and re-elected while it waited, or while it drained)."""
        lead = self._opened.lease()
        if lead is None or lead.term != term or not self._roles.is_(Role.TAKING_OVER, Role.SERVING):
            log.info("not stepping down (%s): term %d is over", why, term)
            return
        log.error("stepping down (term %d): %s", term, why)
        self._roles.handle(Event.STEP_DOWN, why)
        await self.stop_serving()
        if self._roles.is_(Role.STEPPING_DOWN):  # not deposed (and maybe re-elected) meanwhile
            self._roles.handle(Event.STEPPED_DOWN, f"term {term}")
        await lead.resign(term)

    def spawn_step_down(self, why: str) -> None:
        # Not from inside the commit: _stop_serving waits for the commits in flight.
        lease = self._opened.lease()
        term = lease.term if lease is not None else 0
        self._ctx.spawn(self.step_down(why, term), "step-down")

    async def on_deposed(self, why: str) -> None:
        before = self._roles.role
        if self._roles.handle(Event.DEPOSED, why) is before:
            return  # stepped down already, or failed or stopping: stop() stops serving
        if self._term_task is not None:
            self._term_task.cancel()
            self._term_task = None
        self._ctx.stats["leader.depositions"] += 1
        await self.stop_serving()
        log.warning("standby now (%s)", why)

    async def stop_serving(self) -> None:
        """Unsubscribe and drain the commits in flight (the role has left SERVING already)."""
        service, self._service = self._service, None
        if service is not None:
            with contextlib.suppress(Exception):
                await service.stop()
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        health = self._opened.health()
        if health is not None:
            await health.stop()
        # Nothing queued goes out any more; let what is going out or being written finish.
        self._pipeline.close()
        await self._pipeline.drain()

    def build_policy(self, loaded: Loaded) -> Policy:
        # 100k objects made at once would set off full collections over them again and again
        # (2/3 of the time at 25k workers): collect none while building, then freeze them all.
        gc.disable()
        try:
            return Policy.from_records(
                self._ctx.settings.policy, loaded.workers, loaded.epochs, loaded.devices
            )
        finally:
            gc.enable()
            gc.freeze()

    async def prepare_loop(self) -> None:
        """A standby builds the policy it would lead with once the leader looks gone (the
        lease unrenewed for half a TTL) and the mirror has been quiet a moment: the build
        (~0.2-0.4 s at 100k devices) is then done while the lease runs out, and a takeover only
        checks that the mirror has not changed since. Woken by what it waits for (the role, a
        lease sighting, a mirror change) or at the deadline it computed, never polling."""
        built_at = -_PREPARE_EVERY_S
        while True:
            lead, mirror = self._opened.lease(), self._opened.mirror()
            if lead is None or mirror is None:
                await wait_any([self._role_pulse], None)
                continue
            wait, pulses = self.prepare_wait(time.monotonic(), built_at)
            if wait is not None and wait <= 0:
                version = mirror.version
                policy = self.build_policy(mirror.snapshot())  # no await: the mirror holds still
                self._prepared = (version, policy)
                built_at = time.monotonic()
                self._ctx.stats["state.prepared"] += 1
                continue
            await wait_any(pulses, wait)

    def prepare_wait(self, now: float, built_at: float) -> tuple[float | None, list[Pulse]]:
        """How long until a build is due (<= 0: now; None: not until something changes), and
        the changes that may make it due sooner."""
        lead, mirror = self._opened.lease(), self._opened.mirror()
        assert lead is not None and mirror is not None
        roles, lease, records = self._role_pulse, lead.observed, mirror.changed
        if not self._roles.is_(Role.STANDBY):
            if self._roles.is_(Role.SERVING):
                self._prepared = None  # leading with the live policy
            return None, [roles]
        silent = lead.silent_for()
        if silent < lead.ttl / 2:
            self._prepared = None  # the leader renews after all: no takeover coming
            return lead.ttl / 2 - silent, [roles, lease]
        if not mirror.healthy or (
            self._prepared is not None and self._prepared[0] == mirror.version
        ):
            return None, [roles, lease, records]
        due = max(mirror.changed_at + _PREPARE_QUIET_S, built_at + _PREPARE_EVERY_S)
        return due - now, [roles, lease]

    async def publish_hello(self) -> None:
        me = self._info()
        await self._ctx.connection().publish(
            self._ctx.subjects.hello,
            encode(Hello(controller_id=me.controller_id, started_at=me.started_at)),
        )
