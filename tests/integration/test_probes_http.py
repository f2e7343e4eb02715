"""The HTTP probes against real HTTP servers: a GCE metadata server that long-polls with ETags,
and a dcgm-exporter serving recorded /metrics text."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from monitor_cli.probes.base import Condition
from monitor_cli.probes.dcgm import (
    DcgmError,
    DcgmExporterProbe,
    conditions_from_metrics,
)
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


# --- dcgm-exporter ---------------------------------------------------------------------------------

UUIDS = [f"GPU-{i}a1b2c3d-0000-1111-2222-33334444555{i}" for i in range(8)]


def _labels(i: int) -> str:
    return (
        f'gpu="{i}",UUID="{UUIDS[i]}",pci_bus_id="00000000:{0x18 + i:02X}:00.0",'
        f'device="nvidia{i}",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-node-17",'
        'DCGM_FI_DRIVER_VERSION="550.54.15"'
    )


def _family(name: str, kind: str, help_: str, values: list[float | int]) -> str:
    lines = [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{{{_labels(i)}}} {v}" for i, v in enumerate(values)]
    return "\n".join(lines) + "\n"


XID_TEXT = {0: "No Error", 13: "Graphics Engine Exception", 79: "GPU has fallen off the bus",
            63: "ECC page retirement or row remapping recording event",
            94: "Contained ECC error"}  # fmt: skip
XIDS = [0, 13, 79, 0, 0, 63, 94, 0]

# An 8-GPU H100 node as dcgm-exporter 3.x renders it (etc/default-counters.csv plus the ECC and
# pending-remap fields enabled), with DCGM's blank sentinel on one memory temperature.
DCGM_SAMPLE = (
    _family("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", [1980] * 8)
    + _family(
        "DCGM_FI_DEV_MEMORY_TEMP",
        "gauge",
        "Memory temperature (in C).",
        [38, 39, 40, 41, 38, 37, 40, 9223372036854775794],
    )
    + _family("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", [97] * 8)
    + "# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.\n"
    + "# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n"
    + "".join(
        f'DCGM_FI_DEV_XID_ERRORS{{{_labels(i)},err_code="{x}",err_msg="{XID_TEXT[x]}"}} {x}\n'
        for i, x in enumerate(XIDS)
    )
    + _family("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", [71234] * 8)
    + _family(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "counter",
        "Total number of single-bit volatile ECC errors.",
        [0, 0, 0, 15, 0, 2, 0, 0],
    )
    + _family(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Total number of double-bit volatile ECC errors.",
        [0, 0, 0, 2, 0, 0, 0, 0],
    )
    + _family(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for uncorrectable errors",
        [0, 0, 0, 1, 512, 1, 0, 0],
    )
    + _family(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Number of remapped rows for correctable errors",
        [0, 0, 0, 0, 3, 0, 0, 0],
    )
    + _family(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "gauge",
        "Whether remapping of rows has failed",
        [0, 0, 0, 0, 1, 0, 0, 0],
    )
    + _family(
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "gauge",
        "Whether remapping of rows is pending",
        [0, 0, 0, 0, 0, 1, 0, 0],
    )
)

EXPECTED = {
    (UUIDS[2], "failed", "xid:79"),
    (UUIDS[3], "failed", "ecc:uncorrectable"),
    (UUIDS[4], "failed", "row-remap:failed"),
    (UUIDS[5], "degraded", "xid:63"),
    (UUIDS[5], "degraded", "row-remap:pending"),
    (UUIDS[6], "degraded", "xid:94"),
}


def test_dcgm_sample_maps_by_uuid() -> None:
    found = conditions_from_metrics(DCGM_SAMPLE)
    assert {(c.device, c.state, c.key) for c in found} == EXPECTED
    by_key = {(c.device, c.key): c.reason for c in found}
    assert by_key[(UUIDS[2], "xid:79")] == (
        "XID 79 (GPU 2): GPU has fallen off the bus (dcgm-exporter)"
    )
    assert "2 uncorrectable" in by_key[(UUIDS[3], "ecc:uncorrectable")]
    # Only the host's devices, when given; XID 13 (an application's fault) is never a condition.
    only = conditions_from_metrics(DCGM_SAMPLE, devices={UUIDS[1], UUIDS[2]})
    assert [(c.device, c.key) for c in only] == [(UUIDS[2], "xid:79")]


def test_dcgm_default_counters_only_and_the_old_uuid_label() -> None:
    # dcgm-exporter's defaults (no ECC fields) and its 1.x-compatible lowercase label.
    text = (
        "# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n"
        'DCGM_FI_DEV_XID_ERRORS{gpu="0", uuid="GPU-x"} 48\n'
        'DCGM_FI_DEV_XID_ERRORS{gpu="1", uuid="GPU-y"} 0\n'
        "# TYPE DCGM_FI_DEV_ROW_REMAP_FAILURE gauge\n"
        'DCGM_FI_DEV_ROW_REMAP_FAILURE{gpu="1", uuid="GPU-y"} 0\n'
    )
    assert [(c.device, c.state, c.key) for c in conditions_from_metrics(text)] == [
        ("GPU-x", "failed", "xid:48")
    ]
    assert conditions_from_metrics("") == []


class FakeExporter:
    """Serves ``text`` at /metrics, with Content-Length or chunked like Go's net/http."""

    def __init__(self) -> None:
        self.text = DCGM_SAMPLE
        self.status = 200
        self.chunked = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                body = fake.text.encode()
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                self.send_response(fake.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                if fake.chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for i in range(0, len(body), 1000):
                        part = body[i : i + 1000]
                        self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter() -> Iterator[FakeExporter]:
    fake = FakeExporter()
    yield fake
    fake.stop()


async def test_dcgm_probe_scrapes_a_real_exporter(exporter: FakeExporter) -> None:
    probe = DcgmExporterProbe(exporter.url)
    assert probe.name == "dcgm-exporter" and probe.interval_s > 0
    assert {(c.device, c.state, c.key) for c in await probe.check()} == EXPECTED
    exporter.chunked = True
    assert {(c.device, c.state, c.key) for c in await probe.check()} == EXPECTED
    # The GPUs recover (reset): the same probe reports nothing; it keeps no state.
    exporter.text = _family("DCGM_FI_DEV_XID_ERRORS", "gauge", "Last XID.", [0] * 8)
    assert await probe.check() == []


async def test_dcgm_probe_failures_are_one_line_errors(exporter: FakeExporter) -> None:
    probe = DcgmExporterProbe(exporter.url, timeout_s=2.0)
    exporter.status = 500
    with pytest.raises(DcgmError, match="HTTP 500"):
        await probe.check()
    exporter.status, exporter.text = 200, "<html>dcgm-exporter is starting</html>\n"
    with pytest.raises(DcgmError, match="is not Prometheus text") as bad:
        await probe.check()
    down = DcgmExporterProbe(f"http://127.0.0.1:{free_port()}/metrics", timeout_s=2.0)
    with pytest.raises(DcgmError, match=r"dcgm-exporter: GET http://127\.0\.0\.1") as refused:
        await down.check()
    for e in (bad.value, refused.value):
        assert "\n" not in str(e)
    exporter.text = DCGM_SAMPLE  # and the next check works again
    assert len(await probe.check()) == len(EXPECTED)
