"""The HTTP probes against real HTTP servers: a GCE metadata server that long-polls with ETags."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from monitor_cli.probes.base import Condition
from monitor_cli.probes.gce import MAINTENANCE_EVENT, PREEMPTED, GceMetadataProbe
from tests.conftest import eventually, free_port

# --- a fake GCE metadata server ------------------------------------------------------------------


def etag_of(value: str) -> str:
    return hashlib.sha1(value.encode()).hexdigest()[:16]


class FakeMetadata:
    """Google's documented behaviour: ``Metadata-Flavor: Google`` required and answered; with
    ``wait_for_change=true`` the answer waits until the value's ETag differs from ``last_etag``
    or ``timeout_sec`` passes. ``fail_with`` answers that status instead (503 in maintenance)."""

    def __init__(self, port: int = 0) -> None:
        self.values = {MAINTENANCE_EVENT: "NONE", PREEMPTED: "FALSE"}
        self.cond = threading.Condition()
        self.requests: list[tuple[str, dict[str, str], str | None]] = []
        self.fail_with: int | None = None
        self.stopping = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                key = url.path.removeprefix("/computeMetadata/v1/")
                flavor = self.headers.get("Metadata-Flavor")
                fake.requests.append((key, query, flavor))
                if flavor != "Google":
                    self.send_error(403, "Missing Metadata-Flavor:Google header.")
                    return
                if key not in fake.values:
                    self.send_error(404)
                    return
                with fake.cond:
                    if query.get("wait_for_change") == "true":
                        fake.cond.wait_for(
                            lambda: (
                                etag_of(fake.values[key]) != query.get("last_etag")
                                or fake.fail_with is not None
                                or fake.stopping
                            ),
                            float(query.get("timeout_sec", "3600")),
                        )
                    fail, value = fake.fail_with, fake.values[key]
                if fail is not None:
                    self.send_error(fail)
                    return
                body = value.encode()
                self.send_response(200)
                self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Type", "application/text")
                self.send_header("ETag", etag_of(value))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/computeMetadata/v1/"

    def set(self, key: str, value: str) -> None:
        with self.cond:
            self.values[key] = value
            self.cond.notify_all()

    def fail(self, status: int | None) -> None:
        with self.cond:
            self.fail_with = status
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metadata() -> Iterator[FakeMetadata]:
    fake = FakeMetadata()
    yield fake
    fake.stop()


class Emitted:
    def __init__(self) -> None:
        self.lists: list[list[Condition]] = []

    async def __call__(self, conditions: list[Condition]) -> None:
        self.lists.append(list(conditions))

    @property
    def last(self) -> list[Condition] | None:
        return self.lists[-1] if self.lists else None

    def keys(self) -> set[tuple[str, str, str]]:
        return {(c.device, c.state, c.key) for c in self.last or []}


DEVICES = ["GPU-aaaa", "GPU-bbbb"]


async def test_gce_long_polls_with_etags_and_marks_every_device_preempting(
    metadata: FakeMetadata,
) -> None:
    probe = GceMetadataProbe(DEVICES, base_url=metadata.base_url, wait_timeout_s=30)
    emitted = Emitted()
    task = asyncio.create_task(probe.watch(emitted))
    try:
        await eventually(lambda: emitted.lists == [[]])  # the first answers: all well

        metadata.set(MAINTENANCE_EVENT, "TERMINATE_ON_HOST_MAINTENANCE")
        await eventually(lambda: len(emitted.lists) == 2)
        assert emitted.keys() == {(d, "preempting", "gce:maintenance-event") for d in DEVICES}
        assert "TERMINATE_ON_HOST_MAINTENANCE" in emitted.lists[1][0].reason

        metadata.set(PREEMPTED, "TRUE")
        await eventually(lambda: len(emitted.lists) == 3)
        assert emitted.keys() == {
            (d, "preempting", k)
            for d in DEVICES
            for k in ("gce:maintenance-event", "gce:preempted")
        }

        metadata.set(MAINTENANCE_EVENT, "NONE")
        metadata.set(PREEMPTED, "FALSE")
        await eventually(lambda: emitted.last == [] and len(emitted.lists) >= 5)
        assert all(a != b for a, b in zip(emitted.lists, emitted.lists[1:], strict=False))
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    # Google's hanging GET: the header, wait_for_change, and the ETag of the previous answer.
    assert all(flavor == "Google" for _, _, flavor in metadata.requests)
    assert all(q["wait_for_change"] == "true" for _, q, _ in metadata.requests)
    sent = [q["last_etag"] for key, q, _ in metadata.requests if key == MAINTENANCE_EVENT]
    assert sent[:3] == [
        "0",
        etag_of("NONE"),
        etag_of("TERMINATE_ON_HOST_MAINTENANCE"),
    ]
    assert probe.stats["errors.unreachable"] == 0


async def test_gce_metadata_server_down_or_503_is_counted_and_retried_never_a_crash() -> None:
    port = free_port()
    probe = GceMetadataProbe(
        DEVICES,
        base_url=f"http://127.0.0.1:{port}/computeMetadata/v1/",
        wait_timeout_s=30,
        backoff_s=0.02,
        max_backoff_s=0.1,
    )
    emitted = Emitted()
    task = asyncio.create_task(probe.watch(emitted))
    metadata: FakeMetadata | None = None
    try:
        await eventually(lambda: probe.stats["errors.unreachable"] >= 4)
        assert not task.done() and emitted.lists == []
        assert probe.last_error.startswith(("instance/maintenance-event:", "instance/preempted:"))
        assert "\n" not in probe.last_error

        metadata = FakeMetadata(port)  # the server comes (back)
        metadata.set(MAINTENANCE_EVENT, "MIGRATE_ON_HOST_MAINTENANCE")
        await eventually(lambda: emitted.keys() and probe.last_error == "")
        assert {c.key for c in emitted.last or []} == {"gce:maintenance-event"}

        # 503 during maintenance (Google documents it): counted, and the notice is not cleared.
        metadata.fail(503)
        await eventually(lambda: probe.stats["errors.status_503"] >= 2)
        assert emitted.keys() == {(d, "preempting", "gce:maintenance-event") for d in DEVICES}
        metadata.fail(None)
        metadata.set(MAINTENANCE_EVENT, "NONE")
        await eventually(lambda: emitted.last == [])
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        if metadata is not None:
            metadata.stop()


async def test_gce_answer_without_metadata_flavor_is_not_believed() -> None:
    class Impostor(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # a captive portal: 200, but not Google's server
            self.send_response(200)
            self.send_header("ETag", "x")
            self.send_header("Content-Length", "4")
            self.end_headers()
            self.wfile.write(b"TRUE")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    probe = GceMetadataProbe(
        DEVICES, base_url=f"http://127.0.0.1:{server.server_address[1]}/", backoff_s=0.02
    )
    emitted = Emitted()
    task = asyncio.create_task(probe.watch(emitted))
    try:
        await eventually(lambda: probe.stats["errors.not_metadata"] >= 2)
        assert emitted.lists == []
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        server.shutdown()
        server.server_close()


async def test_gce_an_emit_that_raises_ends_the_watch_with_that_error(
    metadata: FakeMetadata,
) -> None:
    async def broken(conditions: list[Condition]) -> None:
        raise RuntimeError("the daemon's bug")

    probe = GceMetadataProbe(DEVICES, base_url=metadata.base_url)
    with pytest.raises(RuntimeError, match="the daemon's bug"):
        await asyncio.wait_for(probe.watch(broken), 30)


def test_gce_base_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARDUK_GCE_METADATA_URL", "http://127.0.0.1:1/computeMetadata/v1")
    assert GceMetadataProbe([]).base_url == "http://127.0.0.1:1/computeMetadata/v1/"
    assert GceMetadataProbe([], base_url="http://x/").base_url == "http://x/"
    monkeypatch.delenv("MARDUK_GCE_METADATA_URL")
    assert GceMetadataProbe([]).base_url.startswith("http://metadata.google.internal/")
