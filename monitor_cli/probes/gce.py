"""Compute Engine maintenance and preemption notices, from the metadata server.

Two keys are watched with Google's documented hanging GET: ``?wait_for_change=true`` with the
``last_etag`` of the previous answer, so the server answers at once when the value changed and
otherwise holds the request up to ``timeout_sec``
(https://cloud.google.com/compute/docs/metadata/querying-metadata, "wait for changes"):

* ``instance/maintenance-event``: ``NONE``, or ``MIGRATE_ON_HOST_MAINTENANCE`` /
  ``TERMINATE_ON_HOST_MAINTENANCE`` about 60 s before host maintenance starts, back to ``NONE``
  when it is over (https://cloud.google.com/compute/docs/metadata/getting-live-migration-notice).
  VMs with GPUs or TPUs generally cannot live-migrate: they get TERMINATE.
* ``instance/preempted``: ``FALSE``, ``TRUE`` once a Spot or preemptible VM is being preempted
  (about 30 s of notice).

Either one, when set, is a ``preempting`` condition of every device of the host: the trainers
should checkpoint now. Any maintenance value but ``NONE`` counts (an unknown one is reported,
not ignored); ``preempted`` counts when ``TRUE``. A metadata server that is down or answers
errors (it may answer 503 during maintenance) is logged and counted in ``stats`` and retried
with backoff; it never ends the watch and never clears a condition already seen.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence

from marduk.aio import Backoff
from monitor_cli.probes.base import Condition, Emit
from monitor_cli.probes.httpget import HttpError, http_get

log = logging.getLogger("marduk.monitor.gce")

METADATA_URL = "http://metadata.google.internal/computeMetadata/v1/"
HEADERS = {"Metadata-Flavor": "Google"}
MAINTENANCE_EVENT = "instance/maintenance-event"
PREEMPTED = "instance/preempted"

_NOTICE = {
    "MIGRATE_ON_HOST_MAINTENANCE": "the VM is about to be live-migrated for host maintenance",
    "TERMINATE_ON_HOST_MAINTENANCE": "the VM is about to stop for host maintenance",
}


def metadata_url(base_url: str | None = None) -> str:
    """The argument, else MARDUK_GCE_METADATA_URL, else Google's; always ending in ``/``."""
    url = base_url or os.environ.get("MARDUK_GCE_METADATA_URL") or METADATA_URL
    return url if url.endswith("/") else url + "/"


def conditions_for(values: dict[str, str], devices: Sequence[str]) -> list[Condition]:
    """Every condition the current key values imply (pure, for tests and the probe)."""
    reasons: list[tuple[str, str]] = []
    event = values.get(MAINTENANCE_EVENT, "").upper()
    if event not in ("", "NONE"):
        why = _NOTICE.get(event, "a host maintenance notice")
        reasons.append(("gce:maintenance-event", f"GCE maintenance-event {event}: {why}"))
    if values.get(PREEMPTED, "").upper() == "TRUE":
        reasons.append(("gce:preempted", "GCE preempted TRUE: the Spot/preemptible VM is stopping"))
    return [
        Condition(device=d, state="preempting", key=key, reason=reason)
        for key, reason in reasons
        for d in devices
    ]


class GceMetadataProbe:
    """An ``EventProbe``: emits ``preempting`` for every device of the host while GCE says the
    VM is about to stop (maintenance or preemption), and an empty list once it no longer does.

    ``stats`` counts answers and errors by kind (``errors.unreachable``, ``errors.status_503``,
    ...); ``last_error`` is the latest one, empty once the server answers again.
    """

    name = "gce-metadata"

    def __init__(
        self,
        devices: Sequence[str] | Callable[[], Sequence[str]],
        *,
        base_url: str | None = None,
        wait_timeout_s: int = 60,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        # A sequence, or a callable giving the host's devices as the daemon learns them.
        self._devices = devices
        self.base_url = metadata_url(base_url)
        self.wait_timeout_s = wait_timeout_s  # the server holds a hanging GET this long
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.stats: Counter[str] = Counter()
        self.last_error = ""
        self._values: dict[str, str] = {}
        self._emitted: list[Condition] | None = None
        self._lock = asyncio.Lock()

    @property
    def devices(self) -> list[str]:
        d = self._devices
        return list(d() if callable(d) else d)

    async def watch(self, emit: Emit) -> None:
        """Long-poll both keys until cancelled; ``emit`` the conditions whenever they change."""
        tasks = [
            asyncio.create_task(self._watch_key(key, emit), name=f"gce-metadata {key}")
            for key in (MAINTENANCE_EVENT, PREEMPTED)
        ]
        try:
            # Only a bug (or ``emit`` raising) ends a key's loop: raise that, not a group of it.
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch_key(self, key: str, emit: Emit) -> None:
        etag = "0"  # Google's samples start from 0: the first answer comes at once
        backoff = Backoff(self.backoff_s, self.max_backoff_s, jitter=0.2)
        failing = False
        while True:
            url = (
                f"{self.base_url}{key}?wait_for_change=true&last_etag={etag}"
                f"&timeout_sec={self.wait_timeout_s}"
            )
            try:
                response = await http_get(url, headers=HEADERS, timeout=self.wait_timeout_s + 10)
                if response.status != 200:
                    raise _Failure(f"status_{response.status}", f"HTTP {response.status}")
                if response.headers.get("Metadata-Flavor") != "Google":
                    # Google's server always says so; anything else is not it (a proxy, a
                    # captive portal, a wrong MARDUK_GCE_METADATA_URL).
                    raise _Failure("not_metadata", "the answer lacks Metadata-Flavor: Google")
                new_etag = response.headers.get("ETag", "")
                if not new_etag:
                    raise _Failure("no_etag", "the answer has no ETag")
            except (HttpError, _Failure) as e:
                kind = e.kind if isinstance(e, _Failure) else "unreachable"
                self.stats[f"errors.{kind}"] += 1
                self.last_error = f"{key}: {e}"
                level = logging.WARNING if not failing else logging.DEBUG
                log.log(
                    level, "metadata server: %s; retrying in %.1fs", self.last_error, backoff.delay
                )
                failing = True
                await asyncio.sleep(backoff.next())
                continue
            if failing:
                log.info("metadata server answers again (%s)", key)
                failing, self.last_error = False, ""
            backoff.reset()
            self.stats["answers"] += 1
            etag = new_etag
            await self._update(key, response.text().strip(), emit)

    async def _update(self, key: str, value: str, emit: Emit) -> None:
        async with self._lock:  # two keys, one emitted list
            if self._values.get(key) != value:
                log.info("GCE %s: %s", key, value)
            self._values[key] = value
            conditions = conditions_for(self._values, self.devices)
            if conditions != self._emitted:
                self._emitted = conditions
                await emit(conditions)


class _Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
