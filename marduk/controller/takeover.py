"""Leading and standing by: takeover, step-down, the standby's prepared state.

See docs/architecture.md, *Leadership*.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from typing import TYPE_CHECKING

import nats.errors
from nats import micro
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.service import Service as MicroService

from marduk import __version__
from marduk.aio import Pulse, wait_any
from marduk.controller.endpoint_stats import ServiceTallies
from marduk.core.policy import Policy
from marduk.core.role import Event, Role
from marduk.errors import MardukError, ProtocolError
from marduk.store.kv import Fenced
from marduk.store.state import Loaded
from marduk.transport.credentials import redact
from marduk.wire.protocol import (
    ControllerInfo,
    Hello,
    Standby,
    decode,
    encode,
)

if TYPE_CHECKING:
    from marduk.controller.shell import Controller

log = logging.getLogger("marduk.controller")

_PREPARE_QUIET_S = 0.2
_PREPARE_EVERY_S = 1.0


class Takeover:
    """Standby and leader: prepare a takeover, take the state over and subscribe when elected,
    stop serving when deposed or stepping down, announce standbys."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self._term_task: asyncio.Task[None] | None = None
        self._subs: list[Subscription] = []
        self._service: MicroService | None = None
        self._standbys: dict[str, tuple[ControllerInfo, float]] = {}
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
        if self.ctl.roles.handle(Event.ELECTED, f"term {term}") is not Role.TAKING_OVER:
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
            if self.ctl.leadership is not None:
                self.ctl.leadership.term_floor = max(self.ctl.leadership.term_floor, e.term)
            self.ctl.stats["store.fenced"] += 1
            await self.step_down(f"could not claim term {term} in the store: {e}", term)
        except (MardukError, OSError, TimeoutError, nats.errors.Error) as e:
            # NATS or JetStream not answering right now: let a standby (or us, later) try.
            self.ctl.stats["errors.takeover"] += 1
            await self.step_down(f"could not start serving (term {term}): {e}", term)
        except Exception as e:
            # A bug: campaigning again would fail the same way. End the process (exit 1) so
            # its supervisor restarts it and a standby leads meanwhile.
            log.exception("could not start serving (term %d)", term)
            self.ctl.die(f"could not start serving: {type(e).__name__}: {e}")

    async def start_serving(self, term: int) -> None:
        t0 = time.monotonic()
        loaded, source = await self.load_state(term)
        t_state = time.monotonic()
        # Handlers act from here on: a stored event the consumer delivers the moment it is
        # subscribed must be handled, not left for redelivery after ack_wait.
        self.ctl.pipeline.reopen()
        self.ctl.roles.handle(Event.TOOK_OVER, f"term {term}, state from {source}")
        await self.subscribe(term)
        if self.ctl.roles.is_(Role.SERVING):
            self.ctl.serving.set()
        # Agents re-register when they hear this: a level-triggered resync after a takeover.
        await self.publish_hello()
        self.ctl.stats["leader.terms"] += 1
        log.info(
            "controller %s serving prefix %r at %s (leader, term %d; state from %s: "
            "%d worker(s), %d device(s), %d epoch(s) in %.0f ms: state %.0f ms, subscribing "
            "%.0f ms)",
            self.ctl.controller_id,
            self.ctl.subjects.prefix,
            redact(self.ctl.url),
            term,
            source,
            len(loaded.workers),
            sum(1 for _ in self.ctl.policy.drmap.devices()),  # not device_to_replicas: 0.15 s
            len(loaded.epochs),
            (time.monotonic() - t0) * 1000,
            (t_state - t0) * 1000,
            (time.monotonic() - t_state) * 1000,
        )

    async def load_state(self, term: int) -> tuple[Loaded, str]:
        """Claim the term in the store and make the policy we lead with: from the standby's
        mirror (prepared ahead if nothing changed since) or, if it lags, from the bucket."""
        assert (
            self.ctl.nc is not None and self.ctl.store is not None and self.ctl.mirror is not None
        )
        # Our first write: from now on no write of an earlier term (a lapsed leader's delayed
        # or reconnect-buffered one) can land, so the state read below is final (the store
        # refuses it; docs/decisions.md #13). Raises Fenced if a later term claimed it.
        await self.ctl.store.claim_term(term, self.ctl.controller_id)
        js = self.ctl.nc.jetstream(timeout=5.0)
        up_to_date = await self.ctl.mirror.caught_up(js)
        if up_to_date:
            # The handled events are read once the mirror has caught up, not while it does: a
            # deposed leader's last dedup records land before the state they go with, and
            # reading them first could miss one (the event would be handled twice). The events
            # bucket is not mirrored: its keys expire without a delete a watch would see.
            replies = await self.ctl.store.load_handled()
            prepared, self._prepared = self._prepared, None
            loaded, source = self.ctl.mirror.snapshot(), "mirror"
            if prepared is not None and prepared[0] == self.ctl.mirror.version:
                # Built while we stood by from exactly what the mirror holds now (no await
                # since the check).
                self.ctl.policy, source = prepared[1], "mirror, prepared"
                self.ctl.stats["state.from_prepared"] += 1
            else:
                self.ctl.policy = self.build_policy(loaded)
        else:
            self._prepared = None
            loaded, source = await self.ctl.store.load(), "bucket"
            replies = loaded.handled
            self.ctl.policy = self.build_policy(loaded)
        self.ctl.policy.resume(replies, time.time())
        self.ctl.stats["state.skipped_records"] += loaded.skipped
        return loaded, source

    async def subscribe(self, term: int) -> None:
        """The micro service's endpoints, the standby announcements, the health consumer."""
        assert self.ctl.nc is not None and self.ctl.health is not None
        s = self.ctl.subjects
        # A NATS micro service: `nats micro ls|info|stats` and $SRV.PING find the leader, its
        # endpoints and version (standbys serve nothing, so they are not listed). Each
        # endpoint's stats ``data`` is what its requests really came to (endpoint_stats).
        tallies = ServiceTallies()
        self._service = await micro.add_service(
            self.ctl.nc,
            name="marduk",
            version=__version__,
            description="Marduk controller: device<->replica map, targeted restarts",
            metadata={
                "prefix": s.prefix,
                "controller_id": self.ctl.controller_id,
                "term": str(term),
            },
            # Its own queue group, not a shared one: a leader whose lease lapsed and has not
            # unsubscribed yet must not take a share of the requests (it drops them); each
            # controller sees every request and only the one that leads answers.
            queue_group=f"marduk-{self.ctl.controller_id}",
            stats_handler=tallies.stats_handler,
        )
        for name, subject, type_, handler, concurrent in self.ctl.handlers.endpoints():
            tally = tallies.endpoint(name)
            await self._service.add_endpoint(
                name=name,
                subject=subject,
                handler=self.ctl.edge.endpoint(type_, handler, concurrent=concurrent, tally=tally),
            )
        self._subs = [await self.ctl.nc.subscribe(s.standby, cb=self.on_standby)]
        gone = self.ctl.leadership is not None and self.ctl.leadership.holder_gone
        await self.ctl.health.start(self.ctl.edge.on_health_msg, previous_gone=gone)
        await self.ctl.nc.flush()

    async def step_down(self, why: str, term: int) -> None:
        """Stop serving and give the lease up: whoever leads next rebuilds from the store.

        Tied to ``term``: a step-down decided in one term never stops or resigns a later one
        (we may have been deposed and re-elected while it waited, or while it drained)."""
        lead = self.ctl.leadership
        if (
            lead is None
            or lead.term != term
            or not self.ctl.roles.is_(Role.TAKING_OVER, Role.SERVING)
        ):
            log.info("not stepping down (%s): term %d is over", why, term)
            return
        log.error("stepping down (term %d): %s", term, why)
        self.ctl.roles.handle(Event.STEP_DOWN, why)
        await self.stop_serving()
        if self.ctl.roles.is_(Role.STEPPING_DOWN):  # not deposed (and maybe re-elected) meanwhile
            self.ctl.roles.handle(Event.STEPPED_DOWN, f"term {term}")
        await lead.resign(term)

    def spawn_step_down(self, why: str) -> None:
        # Not from inside the commit: _stop_serving waits for the commits in flight.
        term = self.ctl.leadership.term if self.ctl.leadership is not None else 0
        self.ctl.spawn_background(self.step_down(why, term), "step-down")

    async def on_deposed(self, why: str) -> None:
        before = self.ctl.role
        if self.ctl.roles.handle(Event.DEPOSED, why) is before:
            return  # stepped down already, or failed or stopping: stop() stops serving
        if self._term_task is not None:
            self._term_task.cancel()
            self._term_task = None
        self.ctl.stats["leader.depositions"] += 1
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
        if self.ctl.health is not None:
            await self.ctl.health.stop()
        # Nothing queued goes out any more; let what is going out or being written finish.
        self.ctl.pipeline.close()
        await self.ctl.pipeline.drain()

    def build_policy(self, loaded: Loaded) -> Policy:
        # 100k objects made at once would set off full collections over them again and again
        # (2/3 of the time at 25k workers): collect none while building, then freeze them all.
        gc.disable()
        try:
            return Policy.from_records(
                self.ctl.settings.policy, loaded.workers, loaded.epochs, loaded.devices
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
            lead, mirror = self.ctl.leadership, self.ctl.mirror
            if lead is None or mirror is None:
                await wait_any([self.ctl.role_pulse], None)
                continue
            wait, pulses = self.prepare_wait(time.monotonic(), built_at)
            if wait is not None and wait <= 0:
                version = mirror.version
                policy = self.build_policy(mirror.snapshot())  # no await: the mirror holds still
                self._prepared = (version, policy)
                built_at = time.monotonic()
                self.ctl.stats["state.prepared"] += 1
                continue
            await wait_any(pulses, wait)

    def prepare_wait(self, now: float, built_at: float) -> tuple[float | None, list[Pulse]]:
        """How long until a build is due (<= 0: now; None: not until something changes), and
        the changes that may make it due sooner."""
        lead, mirror = self.ctl.leadership, self.ctl.mirror
        assert lead is not None and mirror is not None
        roles, lease, records = self.ctl.role_pulse, lead.observed, mirror.changed
        if not self.ctl.roles.is_(Role.STANDBY):
            if self.ctl.roles.is_(Role.SERVING):
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

    async def standby_loop(self) -> None:
        """Standbys announce themselves to the leader about once a second (for status)."""
        while True:
            await asyncio.sleep(1.0)
            if self.ctl.nc is None or not self.ctl.nc.is_connected or self.ctl.leading():
                continue
            with contextlib.suppress(Exception):
                await self.ctl.nc.publish(
                    self.ctl.subjects.standby, encode(Standby(controller=self.ctl.info()))
                )

    def live_standbys(self) -> list[ControllerInfo]:
        """Standbys heard from in the last 3 s (they announce themselves every second)."""
        now = time.monotonic()
        self._standbys = {k: v for k, v in self._standbys.items() if now - v[1] < 3.0}
        return [info for info, _ in self._standbys.values()]

    async def on_standby(self, msg: Msg) -> None:
        try:
            info = decode(msg.data, Standby).controller
        except ProtocolError as e:
            self.ctl.edge.reject("standby", e.reason, str(e), msg.subject)
            return
        if info.controller_id != self.ctl.controller_id:
            self._standbys[info.controller_id] = (info, time.monotonic())

    async def publish_hello(self) -> None:
        assert self.ctl.nc is not None
        await self.ctl.nc.publish(
            self.ctl.subjects.hello,
            encode(Hello(controller_id=self.ctl.controller_id, started_at=self.ctl.started_at)),
        )
