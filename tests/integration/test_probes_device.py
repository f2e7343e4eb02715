"""The device probes' logic through their seams, with recorded values: a stand-in for the
``pynvml`` module (real pynvml errors, constants and ctypes structures), real device files in a
temporary /dev and /sys, and a real HTTP(S) server for the Kubernetes API."""

from __future__ import annotations

import asyncio
import ctypes
import json
import shutil
import ssl
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pynvml
import pytest

from monitor_cli.probes.base import Condition
from monitor_cli.probes.node import NodeApi, NodeApiError, NodeProbe, judge_node
from monitor_cli.probes.nvml import (
    XID_TABLE,
    HealthProbe,
    NvmlUnavailable,
    XidProbe,
    classify_xid,
    read_gpu,
)
from monitor_cli.probes.tpu import (
    ChipFiles,
    DeviceUsage,
    TpuInfoRuntime,
    TpuProbe,
    TpuUnavailable,
    tpu_visible,
)

T0 = 1_700_000_000.0

# --- NVML --------------------------------------------------------------------------------------


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


class RecordedNvml:
    """Answers NVML calls as a driver did (values recorded per GPU); errors and structures are
    the real pynvml ones, handles real ctypes pointers."""

    NVMLError = pynvml.NVMLError

    def __init__(self, uuids: list[str]) -> None:
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType", "nvmlClocks")):
                setattr(self, name, getattr(pynvml, name))
        self.uuids = uuids
        self.handles = [
            ctypes.cast(ctypes.c_void_p(0x1000 + 0x10 * i), pynvml.c_nvmlDevice_t)
            for i in range(len(uuids))
        ]
        self.answers: dict[tuple[str, int], Any] = {}  # (function, gpu) -> value or exception
        self.xids: deque[tuple[int, int]] = deque()  # (gpu, xid) as the event set delivers them
        self.unsupported_events: set[int] = set()
        self.freed = False

    def _index(self, handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        return [ctypes.cast(h, ctypes.c_void_p).value for h in self.handles].index(address)

    def _answer(self, fn: str, handle: Any, default: Any) -> Any:
        value = self.answers.get((fn, self._index(handle)), default)
        if isinstance(value, BaseException):
            raise value
        return value

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return self.handles[index]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._answer("uuid", handle, self.uuids[self._index(handle)])

    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]:
        return self._answer("rows", handle, (0, 0, 0, 0))

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter: int) -> int:
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        assert counter == pynvml.NVML_VOLATILE_ECC
        return self._answer("ecc", handle, 0)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._answer("clocks", handle, pynvml.nvmlClocksEventReasonGpuIdle)

    def nvmlEventSetCreate(self) -> Any:
        return pynvml.c_nvmlEventSet_t()

    def nvmlDeviceRegisterEvents(self, handle: Any, types: int, event_set: Any) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError
        if self._index(handle) in self.unsupported_events:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlEventSetWait_v2(self, event_set: Any, timeout_ms: int) -> Any:
        if not self.xids:
            time.sleep(0.01)  # the driver would block up to timeout_ms
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        gpu, xid = self.xids.popleft()
        data = pynvml.c_nvmlEventData_t()
        data.device = self.handles[gpu]
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = xid
        return data

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self.freed = True


def test_xid_table_decisions() -> None:
    failed = {x for x, (s, _) in XID_TABLE.items() if s == "failed"}
    assert failed == {48, 61, 62, 64, 74, 79, 94, 95, 119, 120, 140}
    assert classify_xid(13) == (
        "degraded",
        "XID 13: graphics engine exception (usually an application bug)",
    )
    assert classify_xid(31)[0] == "degraded" and "application" in classify_xid(31)[1]
    assert classify_xid(45)[0] is None  # a consequence of another XID
    assert classify_xid(63)[0] == "degraded" and classify_xid(92)[0] == "degraded"
    state, reason = classify_xid(999)
    assert state == "degraded" and "not in Marduk's table" in reason
    assert all(text and "\n" not in text for _, text in XID_TABLE.values())


async def collect_until(probe: XidProbe, done: Any, timeout: float = 10.0) -> list[list[Condition]]:
    seen: list[list[Condition]] = []

    async def emit(conditions: list[Condition]) -> None:
        seen.append(conditions)

    task = asyncio.create_task(probe.watch(emit))
    deadline = time.monotonic() + timeout
    try:
        while not done(seen):
            assert time.monotonic() < deadline, seen
            assert not task.done(), task
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return seen


async def test_xid_events_become_held_conditions_then_clear() -> None:
    nv = RecordedNvml(["GPU-aaa", "GPU-bbb", "GPU-ccc"])
    nv.unsupported_events = {2}  # this GPU cannot deliver events: watched without it
    nv.xids.extend([(0, 79), (1, 13), (1, 45), (0, 79)])
    probe = XidProbe(nv, hold_s=0.5, wait_ms=10)
    seen = await collect_until(probe, lambda s: len(s) >= 2 and s[-1] == [])
    assert seen[0] == []  # first: nothing holds
    assert probe.known_devices() == ["GPU-aaa", "GPU-bbb"]
    held = [c for conds in seen for c in conds]
    assert Condition("GPU-aaa", "failed", "xid:79", "XID 79: GPU has fallen off the bus") in held
    assert {c.key for c in held if c.device == "GPU-bbb"} == {"xid:13"}  # 45 is not a condition
    assert probe.stats == {"xids": 4, "ignored": 1}
    assert nv.freed  # the event set is released when the watch ends


async def test_xid_watch_raises_on_nvml_errors_other_than_timeout() -> None:
    nv = RecordedNvml(["GPU-aaa"])

    def broken(event_set: Any, timeout_ms: int) -> Any:
        raise nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    nv.nvmlEventSetWait_v2 = broken  # type: ignore[method-assign]
    probe = XidProbe(nv, wait_ms=10)

    async def emit(conditions: list[Condition]) -> None:
        pass

    with pytest.raises(pynvml.NVMLError):
        await asyncio.wait_for(probe.watch(emit), 5)


def test_gpu_health_from_recorded_values() -> None:
    uuids = [f"GPU-{i}" for i in range(7)]
    nv = RecordedNvml(uuids)
    lost = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    unsupported = nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    nv.answers.update(
        {
            ("rows", 1): (0, 2, 0, 1),  # remapping failed
            ("rows", 2): (0, 1, 1, 0),  # remap pending
            ("rows", 3): lost,
            ("ecc", 3): lost,
            ("clocks", 3): lost,
            ("rows", 4): unsupported,  # pre-Ampere: no row remapper, no ECC
            ("ecc", 4): unsupported,
            ("clocks", 5): pynvml.nvmlClocksEventReasonHwThermalSlowdown
            | pynvml.nvmlClocksEventReasonSwPowerCap,  # power capping at full load is normal
            ("clocks", 6): pynvml.nvmlClocksEventReasonHwSlowdown
            | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown,
        }
    )
    probe = HealthProbe(nv)
    got = {(c.device, c.state, c.key) for c in probe.check_now(T0)}
    assert got == {
        ("GPU-1", "failed", "row-remap:failed"),
        ("GPU-2", "degraded", "row-remap:pending"),
        ("GPU-3", "failed", "gpu-lost"),
        ("GPU-5", "degraded", "throttle:hw-thermal"),
        ("GPU-6", "degraded", "throttle:hw-slowdown"),
        ("GPU-6", "degraded", "throttle:hw-power-brake"),
    }
    assert probe.known_devices() == uuids
    assert read_gpu(nv, nv.handles[4], "GPU-4").remapped_rows is None  # "not supported": none


def test_ecc_counts_new_errors_are_failed_for_a_while_old_ones_degraded() -> None:
    nv = RecordedNvml(["GPU-a", "GPU-b"])
    nv.answers[("ecc", 0)] = 2  # errors from before the monitor started
    probe = HealthProbe(nv, hold_s=60)

    def keys(now: float) -> set[tuple[str, str, str]]:
        return {(c.device, c.state, c.key) for c in probe.check_now(now)}

    old = ("GPU-a", "degraded", "ecc:uncorrectable-before-start")
    assert keys(T0) == {old}
    nv.answers[("ecc", 1)] = 1  # GPU-b: a new uncorrectable error
    assert keys(T0 + 10) == {old, ("GPU-b", "failed", "ecc:uncorrectable")}
    assert keys(T0 + 30) == {old, ("GPU-b", "failed", "ecc:uncorrectable")}  # held
    assert keys(T0 + 71) == {old}  # 60 s after it last grew: cleared
    nv.answers[("ecc", 0)] = 0  # GPU-a was reset: its old errors are gone
    assert keys(T0 + 80) == set()
    nv.answers[("ecc", 0)] = 1
    assert keys(T0 + 90) == {("GPU-a", "failed", "ecc:uncorrectable")}


def test_a_gpu_lost_before_start_cannot_be_named_and_is_skipped() -> None:
    nv = RecordedNvml(["GPU-a", "GPU-b"])
    nv.answers[("uuid", 1)] = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    probe = HealthProbe(nv)
    assert probe.check_now(T0) == [] and probe.known_devices() == ["GPU-a"]


def test_nvml_unavailable_is_one_clear_error() -> None:
    probe = HealthProbe()  # the real pynvml: no driver on this machine
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        with pytest.raises(NvmlUnavailable, match="no NVIDIA driver"):
            probe.check_now(T0)
    else:  # a machine with a GPU: the real library answers
        pynvml.nvmlShutdown()
        assert all(c.device.startswith(("GPU-", "MIG-")) for c in probe.check_now(T0))


# --- TPU ---------------------------------------------------------------------------------------


def make_host(root: Path, files: list[str], pci: list[str] = ()) -> ChipFiles:  # type: ignore[assignment]
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for f in files:
        p = root / "dev" / f
        p.parent.mkdir(parents=True, exist_ok=True)
        p.touch()
    for i, device in enumerate(pci):
        d = root / "sys" / "bus" / "pci" / "devices" / f"0000:00:{4 + i:02x}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x1ae0\n")
        (d / "device").write_text(f"{device}\n")
    return ChipFiles(dev=root / "dev", sys=root / "sys")


def test_tpu_chip_disappearing_fails_its_devices(tmp_path: Path) -> None:
    files = make_host(tmp_path, ["accel0", "accel1", "accel2", "accel3", "null"])
    probe = TpuProbe("w3", files=files)
    assert probe.check_now(T0) == []
    assert probe.known_devices() == [f"w3:tpu:{i}" for i in range(4)]
    (tmp_path / "dev" / "accel2").unlink()
    [c] = probe.check_now(T0 + 1)
    assert (c.device, c.state, c.key) == ("w3:tpu:2", "failed", "chip:gone")
    assert "accel2" in c.reason
    (tmp_path / "dev" / "accel2").touch()
    assert probe.check_now(T0 + 2) == []


def test_tpu_vfio_groups_and_two_device_chips(tmp_path: Path) -> None:
    # 7x: two devices per chip; vfio groups are IOMMU group numbers, not 0..n-1.
    files = make_host(
        tmp_path,
        ["vfio/vfio", "vfio/12", "vfio/13", "vfio/14", "vfio/15"],
        pci=["0x0076"] * 4 + ["0x0042"],  # and a gVNIC, Google's vendor id too
    )
    assert files.pci_chips() == (4, 2)
    probe = TpuProbe("w", files=files)
    assert probe.check_now(T0) == [] and len(probe.known_devices()) == 8
    (tmp_path / "dev" / "vfio" / "13").unlink()
    assert {c.device for c in probe.check_now(T0 + 1)} == {"w:tpu:2", "w:tpu:3"}


def test_tpu_fewer_chips_than_expected_fails_the_host(tmp_path: Path) -> None:
    files = make_host(tmp_path, ["accel0", "accel1", "accel2"])
    probe = TpuProbe("w", files=files, expected_chips=4)
    conds = probe.check_now(T0)
    assert {c.device for c in conds} == {f"w:tpu:{i}" for i in range(4)}
    assert {c.key for c in conds} == {"chips:missing"}
    assert "3 of 4 TPU chips present" in conds[0].reason


def test_no_tpu_is_a_probe_failure_not_a_condition(tmp_path: Path) -> None:
    files = make_host(tmp_path, ["null"])
    assert not tpu_visible(files)
    with pytest.raises(TpuUnavailable, match="no TPU chip"):
        TpuProbe("w", files=files).check_now(T0)


class RecordedRuntime:
    def __init__(self) -> None:
        self.answer: list[DeviceUsage] | Exception = []

    def usage(self) -> list[DeviceUsage]:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_tpu_runtime_metrics_through_the_seam(tmp_path: Path) -> None:
    files = make_host(tmp_path, ["accel0", "accel1"])
    runtime = RecordedRuntime()
    probe = TpuProbe("w", files=files, runtime=runtime)
    gib = 2**30
    runtime.answer = [DeviceUsage(0, 3 * gib, 32 * gib), DeviceUsage(1, 0, 32 * gib)]
    assert probe.check_now(T0) == []
    runtime.answer = [DeviceUsage(0, 3 * gib, 32 * gib), DeviceUsage(1, 0, 0)]
    [c] = probe.check_now(T0 + 1)
    assert (c.device, c.state, c.key) == ("w:tpu:1", "degraded", "runtime:no-hbm")
    # Not answering is no condition: the metrics server lives in the trainer (module doc).
    runtime.answer = TpuUnavailable("connection refused")
    assert probe.check_now(T0 + 2) == []
    assert probe.stats == {"runtime.unreachable": 1, "runtime.answers": 2}
    runtime.answer = [DeviceUsage(0, 3 * gib, 32 * gib)]  # device 1 unused by this trainer
    assert probe.check_now(T0 + 3) == []


def test_tpu_info_runtime_without_a_tpu_says_so() -> None:
    pytest.importorskip("tpu_info")
    with pytest.raises(TpuUnavailable):
        TpuInfoRuntime("127.0.0.1:1").usage()


# --- Kubernetes node ---------------------------------------------------------------------------


def node(
    ready: str = "True",
    pressure: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A Node as the API documents it (v1 Node: status.conditions, spec.taints)."""
    kinds = {"MemoryPressure": "False", "DiskPressure": "False", "PIDPressure": "False"}
    kinds.update(pressure or {})
    conditions = [
        {
            "type": k,
            "status": v,
            "lastHeartbeatTime": "2026-01-01T00:00:00Z",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
            "reason": f"KubeletHas{'Sufficient' if v == 'False' else 'Insufficient'}{k}",
            "message": f"kubelet reports {k} {v}",
        }
        for k, v in kinds.items()
    ]
    conditions.append(
        {
            "type": "Ready",
            "status": ready,
            "reason": "KubeletReady" if ready == "True" else "NodeStatusUnknown",
            "message": "kubelet is posting ready status"
            if ready == "True"
            else "Kubelet stopped posting node status.",
        }
    )
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": "gke-tpu-1", "labels": {"kubernetes.io/hostname": "gke-tpu-1"}},
        "spec": {"podCIDR": "10.0.0.0/24", **({"taints": taints} if taints else {})},
        "status": {"conditions": conditions, "capacity": {"google.com/tpu": "4"}},
    }


def test_judge_node() -> None:
    devs = ["h:tpu:0", "h:tpu:1"]
    assert judge_node(node(), devs) == []
    down = judge_node(node("Unknown"), devs)
    assert [(c.device, c.state, c.key) for c in down] == [
        ("h:tpu:0", "failed", "node:ready"),
        ("h:tpu:1", "failed", "node:ready"),
    ]
    assert "not Ready (status Unknown: NodeStatusUnknown: Kubelet stopped" in down[0].reason
    conds = judge_node(
        node(
            pressure={"DiskPressure": "True"},
            taints=[
                {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
                {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"},  # cordon
                {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"},
            ],
        ),
        ["d"],
    )
    assert {(c.state, c.key) for c in conds} == {
        ("degraded", "node:DiskPressure"),
        ("failed", "taint:node.kubernetes.io/unreachable"),
        ("preempting", "taint:ToBeDeletedByClusterAutoscaler"),
    }
    assert judge_node({}, ["d"]) == []  # a node without status says nothing


class FakeApiServer:
    """A real HTTP(S) server answering GET /api/v1/nodes/<name> like the API server."""

    def __init__(self, token: str | None = None, tls: tuple[Path, Path] | None = None) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.token = token
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests.append(self.path)
                if outer.token and self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._send(401, {"kind": "Status", "code": 401})
                name = self.path.removeprefix("/api/v1/nodes/")
                if name not in outer.nodes:
                    return self._send(404, {"kind": "Status", "reason": "NotFound", "code": 404})
                self._send(200, outer.nodes[name])

            def _send(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        scheme = "http"
        if tls is not None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api_server() -> Iterator[FakeApiServer]:
    s = FakeApiServer(token="t0ken")
    yield s
    s.close()


async def test_node_probe_over_http(api_server: FakeApiServer, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    api_server.nodes["gke-tpu-1"] = node("False")
    devices = ["h:tpu:0"]
    probe = NodeProbe("gke-tpu-1", lambda: devices, NodeApi(api_server.url, token_path=token))
    [c] = await probe.check()
    assert (c.device, c.state, c.key) == ("h:tpu:0", "failed", "node:ready")
    api_server.nodes["gke-tpu-1"] = node("True")
    assert await probe.check() == []
    assert api_server.requests[-1] == "/api/v1/nodes/gke-tpu-1"
    # The token is read at every request (kubelet rotates it).
    token.write_text("rotated")
    with pytest.raises(NodeApiError, match="HTTP 401: the token was refused"):
        await probe.check()
    api_server.token = "rotated"
    assert await probe.check() == []
    with pytest.raises(NodeApiError, match="HTTP 404: no such node"):
        await NodeProbe("other", lambda: devices, NodeApi(api_server.url, token_path=token)).check()


async def test_node_api_unreachable_is_one_line() -> None:
    api = NodeApi("http://127.0.0.1:1", timeout_s=1)
    with pytest.raises(NodeApiError, match=r"GET node n from http://127.0.0.1:1: .*refused"):
        await asyncio.to_thread(api.get_node, "n")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_node_api_over_tls_with_the_given_ca(tmp_path: Path) -> None:
    cert, key = tmp_path / "ca.crt", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=kubernetes"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    token = tmp_path / "token"
    token.write_text("t0ken")
    server = FakeApiServer(token="t0ken", tls=(cert, key))
    try:
        server.nodes["n"] = node()
        api = NodeApi(server.url, token_path=token, ca_path=cert)
        assert api.get_node("n")["kind"] == "Node"
        # Without our CA the server is not trusted: refused, one line.
        with pytest.raises(NodeApiError, match="CERTIFICATE_VERIFY_FAILED"):
            NodeApi(server.url, token_path=token).get_node("n")
    finally:
        server.close()


def test_in_cluster_needs_the_service_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(NodeApiError, match="not in a Kubernetes pod"):
        NodeApi.in_cluster()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    with pytest.raises(NodeApiError, match="no service account token"):
        NodeApi.in_cluster()
