"""Reading and writing a JetStream key-value bucket the way the controller needs it: many keys
written at once with one subscription for their acknowledgements (``BatchWriter``), every record
read with one watch whose end is the server's own count (``read_bucket``). Knows nothing of the
records it carries: marduk/store/state.py does.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import KeyValueConfig
from nats.js.client import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    InvalidKeyError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue

from marduk.errors import MardukError

log = logging.getLogger("marduk.store")


class WriteError(MardukError):
    """The server refused (or did not acknowledge) some writes of a batch."""


class Fenced(WriteError):
    """The server refused a write because another leader's term began (the term key moved),
    or the term is already claimed: this controller is not the leader any more."""

    def __init__(self, message: str, term: int = 0) -> None:
        super().__init__(message)
        self.term = term  # the term claimed in the store, where known


TERM_KEY = "term"
"""A fenced bucket's fencing key: the term of the leader allowed to write (``TermRecord``)."""
_EXPECTED_SEQ = "Nats-Expected-Last-Subject-Sequence"
_EXPECTED_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"


class TermRecord(msgspec.Struct, kw_only=True):
    """The value of the ``term`` key: who leads the bucket, from which lease term."""

    term: int
    holder: str
    claimed_at: float = 0.0


async def claim_term(kv: KeyValue, term: int, holder: str) -> tuple[int, dict[str, str]]:
    """Make ``term`` the bucket's term: compare-and-set on its ``term`` key. Returns the key's
    revision and the headers every later write of the term carries (the server stores such a
    write only while the term key is still at that revision: once a successor claimed its
    term, a lapsed leader's delayed write is refused). Raises ``Fenced`` if the key already
    holds this term or a later one (another leader has claimed it: we are not the leader); this
    term already held by ``holder`` is its own claim, answered late, and returned as made."""
    value = msgspec.json.encode(TermRecord(term=term, holder=holder, claimed_at=time.time()))
    while True:
        try:
            entry = await kv.get(TERM_KEY)
        except (KeyNotFoundError, KeyDeletedError):
            entry = None
        current = decode_term(entry.value if entry is not None else None)
        ours = current is not None and (current.term, current.holder) == (term, holder)
        if entry is not None and entry.revision is not None and ours:
            # Our own claim: a create or update whose answer was lost (a loaded server answers
            # late, the client times out, the caller tries again) is stored all the same.
            return entry.revision, _fence_headers(kv, entry.revision)
        if current is not None and current.term >= term:
            raise Fenced(f"term {current.term} was claimed by {current.holder}", current.term)
        try:
            if entry is None:
                revision = await kv.create(TERM_KEY, value)
            else:
                revision = await kv.update(TERM_KEY, value, last=entry.revision)
        except KeyWrongLastSequenceError:
            continue  # someone wrote it meanwhile: read it again
        return revision, _fence_headers(kv, revision)


def _fence_headers(kv: KeyValue, revision: int) -> dict[str, str]:
    return {_EXPECTED_SEQ: str(revision), _EXPECTED_SEQ_SUBJECT: kv._pre + TERM_KEY}


def decode_term(value: bytes | None) -> TermRecord | None:
    if not value:
        return None
    try:
        return msgspec.json.decode(value, type=TermRecord)
    except msgspec.DecodeError:
        return None


_WRONG_LAST_SEQUENCE = b"10071"  # JetStream's err_code for "wrong last sequence"
_VALID_KEY = re.compile(r"[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*")


class BatchWriter:
    """Writes many keys of a bucket at once, with one subscription for every acknowledgement.

    ``KeyValue.put`` is one request per key: a reply future, a timer, a random token (an
    ``os.urandom`` call) and a parsed acknowledgement each, about a quarter of the leader's
    CPU at 2,000 registrations a second. Here a batch's puts and deletes are published with
    replies to ``<inbox>.<batch>.<n>``, on one subscription made once per connection (not a
    subscription per batch: on a cluster every SUB and UNSUB is interest that travels the
    routes), and the acknowledgements are counted.
    """

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._inbox = ""
        self._sub: Any = None
        self._subscribing = asyncio.Lock()
        self._batches: dict[str, _Batch] = {}
        self._next = 0

    async def write(
        self,
        kv: KeyValue,
        writes: dict[str, bytes | None],
        *,
        timeout: float = 5.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Put (or, for None, delete) the keys, each with ``headers`` (the term's fence).
        Raises ``Fenced`` if the fence refused any, ``WriteError`` if any other was refused or
        not acknowledged within ``timeout``; every write is idempotent, so the caller may
        retry the batch (not a fenced one: it will never be stored)."""
        for key in writes:
            if not _VALID_KEY.fullmatch(key):
                raise InvalidKeyError(key)
        if not writes:
            return
        await self._subscribe()
        self._next += 1
        batch_id = str(self._next)
        batch = self._batches[batch_id] = _Batch(len(writes))
        reply_prefix = f"{self._inbox}.{batch_id}."
        try:
            for i, (key, value) in enumerate(writes.items()):
                # kv._pre: the bucket's subject prefix ("$KV.<bucket>.", or with a JetStream
                # API prefix), as KeyValue.put itself builds the subject.
                subject, reply = kv._pre + key, reply_prefix + str(i)
                if value is None:
                    hdrs = {**headers, _KV_OP: _KV_DEL} if headers else {_KV_OP: _KV_DEL}
                    await self.nc.publish(subject, b"", reply=reply, headers=hdrs)
                else:
                    await self.nc.publish(subject, value, reply=reply, headers=headers or None)
            try:
                await asyncio.wait_for(asyncio.shield(batch.done), timeout)
            except TimeoutError:
                raise WriteError(
                    f"{batch.remaining} of {len(writes)} writes not acknowledged"
                ) from None
        finally:
            del self._batches[batch_id]  # a late acknowledgement is dropped
        if batch.fenced:
            raise Fenced(f"{batch.fenced} of {len(writes)} writes refused: another term began")
        if batch.refused:
            raise WriteError(
                f"{len(batch.refused)} of {len(writes)} writes refused: {batch.refused[0]}"
            )

    async def _subscribe(self) -> None:
        async with self._subscribing:
            if self._sub is None:
                self._inbox = self.nc.new_inbox()
                self._sub = await self.nc.subscribe(
                    self._inbox + ".>",
                    cb=self._on_ack,
                    pending_msgs_limit=1_000_000,
                    pending_bytes_limit=256 * 1024 * 1024,
                )

    async def _on_ack(self, msg: Msg) -> None:
        batch = self._batches.get(msg.subject[len(self._inbox) + 1 :].split(".", 1)[0])
        if batch is not None:
            batch.acknowledged(msg)


class _Batch:
    def __init__(self, count: int) -> None:
        self.remaining = count
        self.refused: list[str] = []
        self.fenced = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def acknowledged(self, msg: Msg) -> None:
        # {"stream":..,"seq":..} or {"error":{..}}; a bare status (503: no stream) is an error.
        if b'"error"' in msg.data or not msg.data:
            self.refused.append(msg.data.decode(errors="replace")[:200] or str(msg.headers))
            if _WRONG_LAST_SEQUENCE in msg.data:
                self.fenced += 1
        self.remaining -= 1
        if self.remaining == 0 and not self.done.done():
            self.done.set_result(None)


_KV_OP, _KV_DEL = "KV-Operation", "DEL"


async def open_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    try:
        return await js.key_value(config.bucket)
    except BucketNotFoundError:
        return await js.create_key_value(config)


async def read_bucket(
    kv: KeyValue, bucket: str, *, timeout: float = 10.0
) -> AsyncIterator[tuple[str, bytes]]:
    """Every key of a bucket with its value (deleted keys left out), read with one watch.

    Not ``KeyValue.watchall``'s end marker: nats-py sends it when the consumer's info says
    nothing is pending and its callback has not run yet, which is also the case when the server
    has already pushed every record and the callback is waiting for that very answer: a load
    then read an empty bucket (a restarted controller with no workers, 6 loads in 150 of a
    bucket of 303 records). The end here is the server's own count on each record: the one
    delivered with nothing pending after it. An empty bucket is known from the stream's message
    count before watching; a quiet second with nothing pending on the server (the last record
    expired while we read) ends it too. Raises ``TimeoutError`` after ``timeout`` seconds
    without a record while the server says more are pending."""
    info = await kv._js.stream_info(f"KV_{bucket}")
    if not info.state.messages:
        return
    watcher = await kv.watchall()
    quiet = 0.0
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=1.0)  # type: ignore[no-untyped-call]
            except (TimeoutError, NatsTimeoutError):
                sub: Any = watcher._sub  # the watch's ordered consumer
                pending = (await sub.consumer_info()).num_pending
                quiet += 1.0
                if not pending:
                    return
                if quiet >= timeout:
                    raise TimeoutError(
                        f"{bucket}: {pending} records pending, none delivered"
                    ) from None
                continue
            quiet = 0.0
            if entry is None:  # nats-py's end marker (see above): not trusted
                continue
            if entry.value is not None and entry.operation is None:
                yield entry.key, entry.value
            if not entry.delta:
                return
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]
