"""One serving controller: a lease in JetStream KV, taken and renewed by compare-and-set.

Every controller of a deployment (same NATS, same prefix) runs a ``Leadership``. The lease is one
key, ``leader``, in the bucket ``<prefix>_leader``; its value names the holder, its term and its
TTL. The holder renews it every ``ttl / 4`` with ``update(last=revision)``; a renewal that finds
another revision means someone else holds it now, and the holder steps down at once.

Expiry is timed by the observers, not the server (as Kubernetes Leases are): a standby notes, on
its own monotonic clock, when it first saw the current revision; when ``ttl`` passes without a new
revision it takes the lease with ``update(last=that revision)``. Only one such update can win.
No clocks need to agree and no server-side TTL is needed.

Fencing. The holder serves only while its last successful renewal was *sent* less than
``FENCE * ttl`` ago (``serving()``); the controller checks it before every commit. The standby's
clock started when the renewal was already stored, so the old leader stops at least
``(1 - FENCE) * ttl`` before anyone may take over: two never serve at once, partition included.
A leader that cannot reach NATS therefore stops serving within ``FENCE * ttl`` and campaigns
again when it can.

A holder that is gone is noticed sooner. Every controller answers on its own liveness subject
(``<prefix>.ctl.alive.<holder>``, named in its lease value), subscribed before it campaigns; a
standby asks the lease holder's every ``PROBE_INTERVAL`` (a holder whose lease names none, an
older version, is never probed). When the holder's process dies (SIGKILL included) or its
connection closes, the server drops its subscription and the request is answered "no
responders" at once: the standby takes the lease then (the same compare-and-set on the revision
it observed), without waiting out the TTL. A holder that is only slow or partitioned with its
connection up still has its subscription (the request times out), so it keeps its lease until
the TTL. A takeover that is early by mistake (the holder lost its connection and would have
reconnected) is still safe: the store refuses the old term's writes once the new term is
claimed (``marduk.store.state``), and the old leader's next renewal finds another revision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    BucketNotFoundError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue

from marduk.aio import Pulse
from marduk.core.lease import Lease, Sighting, campaign, serving, term_to_claim

log = logging.getLogger("marduk.leadership")

KEY = "leader"
PROBE_INTERVAL = 0.05
"""How often a standby asks the lease holder whether it is alive (seconds)."""
PROBE_TIMEOUT = 0.25
"""A probe unanswered this long proves nothing (the holder may be slow): the TTL decides."""
GONE_AFTER = 2
"""Consecutive "no responders" answers after which the holder counts as gone."""


def alive_subject(prefix: str, holder: str) -> str:
    """Where the controller ``holder`` answers "alive" (holder ids are single tokens)."""
    return f"{prefix}.ctl.alive.{holder}"


def lease_bucket_name(prefix: str) -> str:
    return prefix.replace(".", "_") + "_leader"


OnChange = Callable[[int], Awaitable[None]]


class Leadership:
    """Campaigns for, holds and renews the lease; tells the controller when it wins or loses."""

    def __init__(
        self,
        nc: NATS,
        prefix: str,
        holder: str,
        *,
        ttl: float,
        replicas: int = 1,
        pid: int = 0,
        host: str = "",
        on_elected: OnChange,
        on_deposed: Callable[[str], Awaitable[None]],
    ) -> None:
        self.nc = nc
        self.prefix = prefix
        self.holder = holder
        self.ttl = ttl
        self.replicas = replicas
        self.pid, self.host = pid, host
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self.kv: KeyValue | None = None
        self.is_leader = False
        self.term = 0
        self.lease: Lease | None = None  # the lease as last seen (ours or another's)
        self._revision = 0
        self._observed_at = 0.0  # monotonic time the current revision was first seen
        self._renewed_sent = 0.0  # monotonic time our last successful renewal was sent
        self._acquired_at = 0.0
        self.renew_failures = 0
        self.early_takeovers = 0
        self.term_floor = 0
        """A term the store has seen claimed: ours are above it (the lease bucket may have been
        recreated, restarting its terms at 1, while the state bucket kept its term key)."""
        self.holder_gone = False
        """Whether this term's lease was taken from a holder provably gone (no responders)."""
        self._alive_sub: Any = None
        self.observed = Pulse()
        """Beats when the lease is seen to change hands or be renewed, or we win or lose it."""

    def campaign_above(self, term: int) -> None:
        """The store has seen ``term`` claimed (our claim was fenced): campaign above it."""
        self.term_floor = max(self.term_floor, term)

    async def open(self) -> None:
        self._alive_sub = await self.nc.subscribe(
            alive_subject(self.prefix, self.holder), cb=self._on_alive
        )
        await self.nc.flush()  # answering before anyone can see us hold the lease
        js = self.nc.jetstream(timeout=max(0.5, self.ttl / 4))
        name = lease_bucket_name(self.prefix)
        try:
            self.kv = await js.key_value(name)
        except BucketNotFoundError:
            self.kv = await js.create_key_value(
                KeyValueConfig(
                    bucket=name,
                    history=1,
                    storage=StorageType.FILE,
                    replicas=self.replicas,
                    description="Marduk controller leadership lease",
                )
            )

    async def close(self) -> None:
        """Stop answering on the liveness subject (a controller that failed to start)."""
        sub, self._alive_sub = self._alive_sub, None
        if sub is not None:
            await sub.unsubscribe()

    async def _on_alive(self, msg: Msg) -> None:
        if msg.reply:
            await self.nc.publish(msg.reply, b"alive")

    async def watch_holder(self) -> None:
        """While we stand by, ask the lease holder whether it is alive; take the lease over as
        soon as it provably is not (its subscription is gone: "no responders"). Until
        cancelled."""
        gone, revision = 0, 0
        while True:
            await asyncio.sleep(PROBE_INTERVAL)
            lease = self.lease
            if (
                self.is_leader
                or lease is None
                or not lease.alive
                or lease.holder == self.holder
                or not self._revision
            ):
                gone = 0
                continue
            if self._revision != revision:
                gone, revision = 0, self._revision  # a new holder or a renewal: ask afresh
            try:
                await self.nc.request(
                    lease.alive,
                    b"",
                    timeout=min(PROBE_TIMEOUT, self.ttl / 4),
                )
                gone = 0
            except NoRespondersError:
                gone += 1
            except Exception:  # a timeout (alive but slow, or we are cut off): wait the TTL
                gone = 0
            if gone >= GONE_AFTER and not self.is_leader and self._revision == revision:
                # Only on the revision we saw its subscription gone under (compare-and-set).
                log.info("lease holder %s is gone (no responders): taking over", lease.holder)
                term = max(self.term, lease.term) + 1
                self.early_takeovers += 1
                try:
                    await self._take(revision, term, time.monotonic(), holder_gone=True)
                except Exception as e:  # NATS away: the campaign loop tries again
                    log.debug("early takeover: %s: %s", type(e).__name__, e)
                gone = 0

    def serving(self) -> bool:
        """True while this controller may act as leader (checked before every commit)."""
        return serving(self.is_leader, self._renewed_sent, self.ttl, time.monotonic())

    def since_renewal(self) -> float:
        """Seconds since this leader last sent a renewal (the fence counts from it)."""
        return time.monotonic() - self._renewed_sent

    def silent_for(self) -> float:
        """Seconds since the lease last changed hands or was renewed, as a standby sees it (0
        while we lead): past half a TTL, the leader has missed renewals and may be gone."""
        if self.is_leader or not self._observed_at:
            return 0.0
        return time.monotonic() - self._observed_at

    async def run(self) -> None:
        """Campaign and renew until cancelled."""
        assert self.kv is not None
        while True:
            try:
                if self.is_leader:
                    await self._renew()
                else:
                    await self._campaign()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # NATS away, a timeout: try again next round
                log.debug("lease: %s: %s", type(e).__name__, e)
            if self.is_leader and not self.serving():
                await self._depose(
                    f"could not renew the lease for {time.monotonic() - self._renewed_sent:.1f}s"
                )
            await asyncio.sleep(self.ttl / 4 if self.is_leader else self.ttl / 8)

    async def _renew(self) -> None:
        assert self.kv is not None
        sent = time.monotonic()
        value = self._value(self.term)
        try:
            self._revision = await asyncio.wait_for(
                self.kv.update(KEY, value, last=self._revision), self.ttl / 4
            )
        except KeyWrongLastSequenceError:
            # Our previous renewal may have landed after its answer timed out: if the lease
            # still names us, adopt its revision instead of stepping down.
            entry = await self.kv.get(KEY)
            lease = _decode(entry.value)
            if lease is not None and lease.holder == self.holder and lease.term == self.term:
                self._revision = entry.revision or self._revision
                self.renew_failures += 1
                return
            await self._depose("another controller holds the lease")
            return
        except Exception:
            self.renew_failures += 1
            raise
        self._renewed_sent = sent

    async def _campaign(self) -> None:
        assert self.kv is not None
        now = time.monotonic()
        try:
            entry = await self.kv.get(KEY)
        except (KeyNotFoundError, KeyDeletedError):
            entry = None
        except Exception:
            # Cannot see the lease (NATS away, the bucket electing a leader): the holder cannot
            # renew either, so time without sight does not count towards its expiry. It
            # resumes when the bucket is back; we would otherwise race it for nothing.
            self._observed_at = time.monotonic()
            raise
        seen = Sighting(self._revision, self._observed_at, self.lease)
        seen, take = campaign(
            seen,
            None if entry is None else entry.revision or 0,
            None if entry is None else _decode(entry.value),
            me=self.holder,
            my_term=self.term,
            ttl=self.ttl,
            now=now,
        )
        before = (self._revision, self._observed_at)
        self._revision, self._observed_at, self.lease = seen.revision, seen.since, seen.lease
        if (self._revision, self._observed_at) != before:
            self.observed.notify()
        if take is not None:
            await self._take(take.last, take.term, now)

    async def _take(self, last: int, term: int, sent: float, *, holder_gone: bool = False) -> None:
        assert self.kv is not None
        term = term_to_claim(term, self.term_floor)
        try:
            if last == 0:
                self._revision = await self.kv.create(KEY, self._value(term))
            else:
                self._revision = await self.kv.update(KEY, self._value(term), last=last)
        except KeyWrongLastSequenceError:
            return  # someone else was quicker; observe again next round
        self._renewed_sent = sent
        self._acquired_at = time.time()
        self.is_leader, self.term = True, term
        self.holder_gone = holder_gone
        self.lease = _decode(self._value(term))
        self.observed.notify()
        log.info("elected leader (term %d, lease TTL %gs)", term, self.ttl)
        await self._on_elected(term)

    async def _depose(self, why: str) -> None:
        if not self.is_leader:
            return
        self.is_leader = False
        # Observe afresh: a standby waits a whole TTL from now before taking it back.
        self._observed_at = time.monotonic()
        self.observed.notify()
        log.warning("stepping down (term %d): %s", self.term, why)
        await self._on_deposed(why)

    async def resign(self, term: int | None = None) -> None:
        """Give the lease up on a clean stop, so a standby need not wait for it to lapse.
        With ``term``: only if we still hold that term (a step-down decided in an earlier term
        never resigns a later one)."""
        if not self.is_leader or self.kv is None or (term is not None and term != self.term):
            return
        self.is_leader = False
        try:
            await asyncio.wait_for(self.kv.delete(KEY, last=self._revision), 1.0)
        except Exception as e:
            log.debug("resign: %s", e)

    def _value(self, term: int) -> bytes:
        return msgspec.json.encode(
            Lease(
                holder=self.holder,
                term=term,
                ttl=self.ttl,
                pid=self.pid,
                host=self.host,
                acquired_at=self._acquired_at or time.time(),
                alive=alive_subject(self.prefix, self.holder),
            )
        )


def _decode(value: bytes | None) -> Lease | None:
    if not value:
        return None
    try:
        return msgspec.json.decode(value, type=Lease)
    except msgspec.DecodeError:
        return None
