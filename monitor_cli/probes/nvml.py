"""NVIDIA GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``): XID events and health.

Two probes share one NVML handle:

* ``XidProbe`` (an ``EventProbe``, name ``nvml-xid``): registers every GPU for
  ``nvmlEventTypeXidCriticalError`` in an NVML event set and waits on it
  (``nvmlEventSetWait_v2``, one second at a time, in a worker thread). Each XID is classified by
  ``XID_TABLE`` below. An XID is an edge, a condition is a level: an XID condition holds for
  ``hold_s`` after its last occurrence (default 300 s), then clears. A GPU that stays broken
  stays visible through ``HealthProbe``'s level-triggered checks.
* ``HealthProbe`` (a polled ``Probe``, name ``nvml``), per GPU: "GPU is lost"
  (``NVML_ERROR_GPU_IS_LOST`` from any call) -> failed; row remapping failed (no spare rows,
  ``nvmlDeviceGetRemappedRows``) -> failed; a row remap pending (takes effect at the next GPU
  reset) -> degraded; new volatile uncorrectable ECC errors (``nvmlDeviceGetTotalEccErrors``,
  uncorrected, volatile: counted since the last driver load or GPU reset) -> failed for
  ``hold_s`` after the count last grew, while a count already non-zero when the monitor started
  is degraded (the error is old, its trainers have long seen it); hardware slowdown, thermal or
  power-brake clock throttling (``nvmlDeviceGetCurrentClocksEventReasons``) -> degraded.
  ``NVML_ERROR_NOT_SUPPORTED`` (no ECC on the board, no row remapper before Ampere) means
  "nothing to see", not a failure.

Device ids are NVML UUIDs (``nvmlDeviceGetUUID``), exactly what agents register
(``agent/library/devices.py``). The library is the seam: every function takes the ``pynvml`` module
as an argument, so tests hand in an object that answers with recorded values.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Final

from marduk.errors import MardukError
from marduk.wire.protocol import HealthState
from monitor_cli.probes.base import Condition, Emit

log = logging.getLogger("monitor_cli.probes.nvml")

DEFAULT_HOLD_S: Final = 300.0


class NvmlUnavailable(MardukError):
    """NVML cannot be used here (no nvidia-ml-py, no driver, no GPU)."""


# --- XID classification ------------------------------------------------------------------------
# NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors/, "Analyzing Xid Errors with the Xid
# Catalog", and the older "Xid Errors" table) gives each XID a resolution bucket: RESTART_APP,
# RESET_GPU, RESTART_BM (reboot), CONTACT_SUPPORT, or CHECK_APP/CUDA (usually the application).
# Marduk's reading: "failed" restarts the trainers on the GPU (the controller's action),
# "degraded" is recorded and shown but restarts nothing by default, None is only logged.
# An XID that the application causes is not reported as failed: the trainer already crashed
# and its agent restarts it; a "failed" event would spend the device's restart budget on a bug.

XID_TABLE: Final[dict[int, tuple[HealthState | None, str]]] = {
    # GPU stopped processing (channel idle timeout); RESTART_APP, often the application.
    8: ("degraded", "GPU stopped processing (channel timeout)"),
    # Graphics engine exception: usually an application bug (out-of-range access, bad
    # instruction), rarely hardware. CHECK_APP/CUDA.
    13: ("degraded", "graphics engine exception (usually an application bug)"),
    # GPU memory page fault (MMU): usually an illegal address in the application.
    31: ("degraded", "GPU memory page fault (usually an application bug)"),
    # GPU stopped processing: the driver reset a channel whose application faulted or was killed.
    43: ("degraded", "GPU stopped processing (an application faulted or was killed)"),
    # Preemptive cleanup after an earlier error: a consequence; the cause is its own XID.
    45: (None, "preemptive cleanup after an earlier error"),
    # Double-bit (uncorrectable) ECC error: data corrupted; RESET_GPU.
    48: ("failed", "double-bit ECC error (uncorrectable)"),
    # Internal micro-controller breakpoint/warning: RESET_GPU.
    61: ("failed", "internal micro-controller breakpoint/warning"),
    # Internal micro-controller halt: RESET_GPU.
    62: ("failed", "internal micro-controller halt"),
    # ECC page retirement / row remapping recorded: the repair applies at the next GPU reset;
    # the uncorrectable error behind it is reported on its own (48, 94, 95).
    63: ("degraded", "ECC page retirement or row remapping recorded (reset the GPU when drained)"),
    # ECC page retirement / row remapper recording failure: the bad memory stays in use.
    64: ("failed", "ECC page retirement or row remapping failed"),
    # Video decoder (NVDEC) exception: not an engine training uses; record it.
    68: ("degraded", "video decoder (NVDEC) exception"),
    # Graphics engine class error: usually the application or driver.
    69: ("degraded", "graphics engine class error"),
    # NVLink error: collectives over the link fail or hang; RESET_GPU or reboot.
    74: ("failed", "NVLink error"),
    # GPU has fallen off the bus: unreachable until a reboot; RESTART_BM.
    79: ("failed", "GPU has fallen off the bus"),
    # High single-bit ECC error rate: corrected, but a sign of failing memory.
    92: ("degraded", "high single-bit ECC error rate"),
    # Contained uncorrectable ECC error: only the applications using that memory are hit and
    # must restart (RESTART_APP): exactly the trainers Marduk restarts.
    94: ("failed", "contained uncorrectable ECC error"),
    # Uncontained uncorrectable ECC error: every application on the GPU is hit; RESET_GPU.
    95: ("failed", "uncontained uncorrectable ECC error"),
    # Context switch timeout: RESTART_APP, often a hung kernel.
    109: ("degraded", "context switch timeout"),
    # GSP RPC timeout: the GPU's firmware processor stopped answering; RESET_GPU.
    119: ("failed", "GSP RPC timeout"),
    # GSP error: firmware processor error; RESET_GPU.
    120: ("failed", "GSP error"),
    # Unrecovered ECC error (Hopper and later): RESET_GPU.
    140: ("failed", "unrecovered ECC error"),
}


def classify_xid(xid: int) -> tuple[HealthState | None, str]:
    """The state an XID puts its GPU in (None: log only) and a one-line reason."""
    state, text = XID_TABLE.get(
        xid, ("degraded", "not in Marduk's table; see NVIDIA's Xid catalog")
    )
    return state, f"XID {xid}: {text}"


@dataclass
class RecentEvents:
    """Edges -> levels: a key holds for ``hold_s`` after it was last seen. Pure (time passed in)."""

    hold_s: float
    _last: dict[tuple[str, str], tuple[float, Condition]] = field(default_factory=dict)

    def record(self, condition: Condition, now: float) -> None:
        self._last[(condition.device, condition.key)] = (now, condition)

    def conditions(self, now: float) -> list[Condition]:
        for k in [k for k, (t, _) in self._last.items() if now - t >= self.hold_s]:
            del self._last[k]
        return [c for _, c in sorted(self._last.values(), key=lambda tc: tc[0])]


# --- the library seam --------------------------------------------------------------------------


def load_nvml() -> Any:
    """The ``pynvml`` module, initialised; ``NvmlUnavailable`` (one line) when it cannot be."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable(
            "NVML is not available: install nvidia-ml-py (the marduk[monitor] extra)"
        ) from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NvmlUnavailable(f"NVML cannot start (no NVIDIA driver here?): {e}") from None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _code(nvml: Any, error: BaseException) -> int | None:
    if isinstance(error, nvml.NVMLError):
        return getattr(error, "value", None)
    return None


def _handle_key(handle: Any) -> Any:
    """A hashable identity for an NVML device handle (a ctypes pointer, or anything in tests)."""
    with contextlib.suppress(Exception):
        return ctypes.cast(handle, ctypes.c_void_p).value
    return handle


def gpu_uuids(nvml: Any) -> list[tuple[Any, str]]:
    """(handle, UUID) of every GPU NVML sees, in NVML's order (PCI bus id)."""
    out = []
    for index in range(nvml.nvmlDeviceGetCount()):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            out.append((handle, _text(nvml.nvmlDeviceGetUUID(handle))))
        except nvml.NVMLError as e:
            # A GPU already lost cannot tell its UUID, so no event can name it; the agent's
            # trainer fails on it and reports that.
            log.warning("GPU %d cannot be named (%s); not watched", index, e)
    return out


# --- XID events --------------------------------------------------------------------------------


class XidProbe:
    """XID critical-error events of every GPU (see the module docstring)."""

    def __init__(
        self,
        nvml: Any = None,
        *,
        name: str = "nvml-xid",
        hold_s: float = DEFAULT_HOLD_S,
        wait_ms: int = 1000,
    ) -> None:
        self.name = name
        self._nvml = nvml
        self.recent = RecentEvents(hold_s)
        self.wait_ms = wait_ms
        self._uuids: list[str] = []
        self.stats: dict[str, int] = {"xids": 0, "ignored": 0}

    def _lib(self) -> Any:
        if self._nvml is None:
            self._nvml = load_nvml()
        return self._nvml

    def known_devices(self) -> list[str]:
        return list(self._uuids)

    async def watch(self, emit: Emit) -> None:
        nvml = self._lib()
        event_set, by_handle = await asyncio.to_thread(self._register, nvml)
        try:
            held: list[Condition] = []
            await emit(held)
            while True:
                data = await asyncio.to_thread(self._wait, nvml, event_set)
                now = time.time()
                if data is not None:
                    self._record(nvml, data, by_handle, now)
                current = self.recent.conditions(now)
                if current != held:
                    held = current
                    await emit(list(held))
        finally:
            with contextlib.suppress(Exception):
                nvml.nvmlEventSetFree(event_set)

    def _register(self, nvml: Any) -> tuple[Any, dict[Any, str]]:
        event_set = nvml.nvmlEventSetCreate()
        by_handle: dict[Any, str] = {}
        for handle, uuid in gpu_uuids(nvml):
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
            except nvml.NVMLError as e:
                # NOT_SUPPORTED on some boards/MIG setups: that GPU's XIDs go unseen; say so.
                log.warning("GPU %s: XID events unavailable: %s", uuid, e)
                continue
            by_handle[_handle_key(handle)] = uuid
        self._uuids = list(by_handle.values())
        log.info("watching XID events of %d GPU(s): %s", len(by_handle), ", ".join(self._uuids))
        return event_set, by_handle

    def _wait(self, nvml: Any, event_set: Any) -> Any:
        try:
            return nvml.nvmlEventSetWait_v2(event_set, self.wait_ms)
        except nvml.NVMLError as e:
            if _code(nvml, e) == nvml.NVML_ERROR_TIMEOUT:
                return None
            raise

    def _record(self, nvml: Any, data: Any, by_handle: dict[Any, str], now: float) -> None:
        if not int(data.eventType) & int(nvml.nvmlEventTypeXidCriticalError):
            return
        xid = int(data.eventData)
        uuid = by_handle.get(_handle_key(data.device))
        if uuid is None:
            with contextlib.suppress(Exception):
                uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
        if uuid is None:
            log.warning("XID %d from a GPU this probe did not register; ignored", xid)
            return
        self.stats["xids"] += 1
        state, reason = classify_xid(xid)
        if state is None:
            self.stats["ignored"] += 1
            log.info("GPU %s: %s (not a device condition)", uuid, reason)
            return
        self.recent.record(Condition(uuid, state, f"xid:{xid}", reason), now)


# --- polled health -----------------------------------------------------------------------------

# Clock-event (throttle) reasons that mean the hardware slowed the GPU down. SW power capping
# (0x4) is normal at full load and is left out; names as pynvml spells them, values as NVML's.
THROTTLE_REASONS: Final[dict[str, tuple[int, str]]] = {
    "hw-slowdown": (0x08, "hardware slowdown (HW_SLOWDOWN: temperature or power)"),
    "sw-thermal": (0x20, "thermal slowdown by the driver (SW_THERMAL)"),
    "hw-thermal": (0x40, "hardware thermal slowdown (HW_THERMAL)"),
    "hw-power-brake": (0x80, "hardware power brake (external power brake assertion)"),
}


@dataclass
class GpuReading:
    """One GPU's values, as NVML answered them (None: not supported on this GPU)."""

    uuid: str
    lost: bool = False
    error: str = ""
    remapped_rows: tuple[int, int, int, int] | None = None  # corr, unc, pending, failure
    ecc_uncorrected_volatile: int | None = None
    clock_event_reasons: int | None = None


def read_gpu(nvml: Any, handle: Any, uuid: str) -> GpuReading:
    """Every value ``HealthProbe`` judges, for one GPU (the only place that calls NVML)."""
    r = GpuReading(uuid)

    def ask(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except nvml.NVMLError as e:
            code = _code(nvml, e)
            if code == nvml.NVML_ERROR_GPU_IS_LOST:
                r.lost = True
            elif code != nvml.NVML_ERROR_NOT_SUPPORTED:
                r.error = r.error or str(e)
            return None

    rows = ask(nvml.nvmlDeviceGetRemappedRows, handle)
    r.remapped_rows = tuple(int(v) for v in rows) if rows is not None else None  # type: ignore[assignment]
    r.ecc_uncorrected_volatile = ask(
        nvml.nvmlDeviceGetTotalEccErrors,
        handle,
        nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        nvml.NVML_VOLATILE_ECC,
    )
    reasons_fn = (
        getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    r.clock_event_reasons = ask(reasons_fn, handle)
    return r


class HealthProbe:
    """Polled health of every GPU (see the module docstring)."""

    def __init__(
        self,
        nvml: Any = None,
        *,
        name: str = "nvml",
        interval_s: float = 10.0,
        hold_s: float = DEFAULT_HOLD_S,
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self._nvml = nvml
        self.recent = RecentEvents(hold_s)
        self._gpus: list[tuple[Any, str]] | None = None
        self._ecc_seen: dict[str, int] = {}
        self._ecc_at_start: dict[str, int] = {}

    def known_devices(self) -> list[str]:
        return [uuid for _, uuid in self._gpus or []]

    async def check(self) -> list[Condition]:
        return await asyncio.to_thread(self.check_now, time.time())

    def check_now(self, now: float) -> list[Condition]:
        """One round of NVML calls, judged (blocking; ``check`` runs it in a thread)."""
        if self._nvml is None:
            self._nvml = load_nvml()
        nvml = self._nvml
        if self._gpus is None:
            # Handles and UUIDs are read once: a GPU that is lost later can no longer be asked
            # its UUID, and must still be named.
            self._gpus = gpu_uuids(nvml)
            log.info("checking %d GPU(s): %s", len(self._gpus), ", ".join(self.known_devices()))
        readings = [read_gpu(nvml, handle, uuid) for handle, uuid in self._gpus]
        return self.judge(readings, now)

    def judge(self, readings: list[GpuReading], now: float) -> list[Condition]:
        """Readings -> conditions. Pure but for the ECC baseline it keeps."""
        out: list[Condition] = []
        for r in readings:
            out.extend(self._judge_one(r, now))
        return out + self.recent.conditions(now)

    def _judge_one(self, r: GpuReading, now: float) -> list[Condition]:
        if r.lost:
            return [Condition(r.uuid, "failed", "gpu-lost", "NVML: GPU is lost (needs a reset)")]
        out: list[Condition] = []
        if r.remapped_rows is not None:
            _, unc, pending, failure = r.remapped_rows
            if failure:
                out.append(
                    Condition(
                        r.uuid,
                        "failed",
                        "row-remap:failed",
                        "row remapping failed: no spare memory rows left (replace the GPU)",
                    )
                )
            elif pending:
                out.append(
                    Condition(
                        r.uuid,
                        "degraded",
                        "row-remap:pending",
                        f"row remap pending after {unc} uncorrectable error(s): reset the GPU "
                        "when drained",
                    )
                )
        count = r.ecc_uncorrected_volatile
        if count is not None:
            previous = self._ecc_seen.get(r.uuid)
            new = 0
            if previous is None:
                self._ecc_at_start[r.uuid] = count  # old news: the baseline
            elif count < previous:  # the GPU was reset (or the driver reloaded): counts restart
                self._ecc_at_start[r.uuid] = 0
                new = count
            else:
                new = count - previous
            if new:
                reason = f"{new} new uncorrectable ECC error(s) ({count} since the last reset)"
                self.recent.record(Condition(r.uuid, "failed", "ecc:uncorrectable", reason), now)
            self._ecc_seen[r.uuid] = count
            before = self._ecc_at_start.get(r.uuid, 0)
            if before:
                out.append(
                    Condition(
                        r.uuid,
                        "degraded",
                        "ecc:uncorrectable-before-start",
                        f"{before} uncorrectable ECC error(s) since the last GPU reset, before "
                        "this monitor started",
                    )
                )
        if r.clock_event_reasons:
            for key, (bit, text) in THROTTLE_REASONS.items():
                if r.clock_event_reasons & bit:
                    out.append(Condition(r.uuid, "degraded", f"throttle:{key}", f"clocks: {text}"))
        if r.error:
            log.debug("GPU %s: NVML error: %s", r.uuid, r.error)
        return out
