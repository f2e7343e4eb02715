"""Cloud TPU chips of this host, seen from outside the trainer (name ``tpu``, polled).

What a node-level monitor CAN observe:

* **Chips present.** Each chip is a device file: ``/dev/accel<N>`` (TPU v2-v4) or
  ``/dev/vfio/<group>`` (v5e, v5p, v6e, 7x), and a PCI function of Google's vendor id
  (``0x1ae0``) under ``/sys/bus/pci/devices``. The first check is the baseline (or
  ``expected_chips`` when given); a chip whose device file disappears later -> ``failed`` for
  its devices, "fewer chips than expected" with no way to tell which -> ``failed`` for every
  TPU device of the host (a host short of a chip cannot join its slice anyway).
* **The runtime's own metrics, while a trainer runs.** libtpu serves runtime metrics over gRPC
  (``TPU_RUNTIME_METRICS_PORTS``, default port 8431) from *inside the trainer process*; Google's
  ``tpu-info`` reads them (``tpu_info.metrics.get_chip_usage``: HBM used/total, duty cycle per
  device), and so does this probe through the ``RuntimeMetrics`` seam when ``runtime_addr`` is
  set. The channel uses gRPC local credentials: it only works from the trainer's network
  namespace (a sidecar, or both pods on ``hostNetwork``). When it answers, a device it lists
  with no usable HBM (total 0) -> ``degraded``.

What it CANNOT observe:

* **A crashed or poisoned runtime** (seen on TPU fleets: "Core halted unexpectedly", "program
  continuator has halted unexpectedly", an unexpected peer in the launch group). Those live in the
  trainer process: the runtime raises them into it, the process must be replaced, and only the
  agent, which runs that process and reads its log (``agent/supervise/signatures.py``), sees them.
  The chips stay present and look fine from here.
* **"The runtime does not answer"** is not a condition: the metrics server lives and dies with
  the trainer, so it is also silent between two trainers, during startup and after a job ends.
  Unreachability is only counted (``stats``) and logged at debug level.
* HBM errors, ICI link health, chip temperatures: libtpu exposes no such metric to outside
  readers today.

Device ids are those agents register: ``<host>:tpu:<local id>`` (``agent/library/devices.py``, jax's
``local_hardware_id``). Chip ``i`` (in device-file order) holds local ids
``i*devices_per_chip ... (i+1)*devices_per_chip - 1``, the order ``tpu-info`` itself assumes when
it spreads per-chip values over devices; ``devices_per_chip`` is 2 for v2, v3 and 7x (from
``tpu-info``'s chip table when installed), else 1. ``<host>`` must be the trainer's hostname:
on Kubernetes trainers run with ``hostNetwork`` (as GKE TPU pods usually do) or set
``MARDUK_DEVICES`` to the same ids.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from marduk.errors import MardukError
from monitor_cli.probes.base import Condition

log = logging.getLogger("monitor_cli.probes.tpu")

GOOGLE_PCI_VENDOR: Final = "0x1ae0"
# PCI device ids of TPU chips (as tpu-info's TpuChip table lists them; Google's vendor id also
# covers gVNIC network cards, which must not count): v2/v3, v4, v5p, v5e, v6e, 7x.
TPU_PCI_DEVICES: Final = {"0x0027", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}
TWO_DEVICE_CHIPS: Final = {"0x0027", "0x0076"}  # v2/v3, 7x
_ACCEL_RE: Final = re.compile(r"\Aaccel(\d+)\Z")


class TpuUnavailable(MardukError):
    """No TPU is visible here, or the runtime metrics cannot be read."""


@dataclass(frozen=True)
class DeviceUsage:
    """HBM of one TPU device as the runtime reports it."""

    device_id: int
    memory_used: int
    memory_total: int


class RuntimeMetrics(Protocol):
    """libtpu's runtime metrics: the seam (``TpuInfoRuntime`` is the real one)."""

    def usage(self) -> list[DeviceUsage]:
        """Per-device HBM; raises ``TpuUnavailable`` when the runtime does not answer."""
        ...


class TpuInfoRuntime:
    """Runtime metrics through the ``tpu-info`` package's Python API (``marduk[monitor]``)."""

    def __init__(self, addr: str = "localhost:8431") -> None:
        self.addr = addr
        self._chip_type: Any = None

    def usage(self) -> list[DeviceUsage]:
        try:
            from tpu_info import device, metrics
        except ImportError:
            raise TpuUnavailable(
                "reading TPU runtime metrics needs the tpu-info package "
                "(pip install 'marduk[monitor]')"
            ) from None
        if self._chip_type is None:
            try:
                self._chip_type, _count = device.get_local_chips()
            except Exception as e:  # AssertionError for mixed chip types, OSError
                raise TpuUnavailable(f"tpu-info cannot identify the TPU chips: {e}") from None
            if self._chip_type is None:
                raise TpuUnavailable("tpu-info finds no TPU chip on this host")
        try:
            got = metrics.get_chip_usage(self._chip_type, addr=self.addr)
        except Exception as e:  # grpc.RpcError (unavailable), AssertionError (partial answer)
            raise TpuUnavailable(f"libtpu runtime metrics at {self.addr}: {e}") from None
        return [DeviceUsage(u.device_id, u.memory_usage, u.total_memory) for u in got]


@dataclass
class ChipFiles:
    """Where chips show themselves: device files and PCI functions (roots injectable)."""

    dev: Path = Path("/dev")
    sys: Path = Path("/sys")

    def present(self) -> list[str]:
        """Chip device files that exist now, in chip order (numeric)."""
        found: list[tuple[int, str]] = []
        if self.dev.is_dir():
            for p in self.dev.iterdir():
                m = _ACCEL_RE.match(p.name)
                if m:
                    found.append((int(m.group(1)), str(p)))
        vfio = self.dev / "vfio"
        if vfio.is_dir():
            for p in vfio.iterdir():
                if p.name.isdigit():  # not /dev/vfio/vfio, the container device
                    found.append((int(p.name), str(p)))
        return [path for _, path in sorted(found)]

    def pci_chips(self) -> tuple[int, int]:
        """(TPU chips on the PCI bus, devices per chip)."""
        count, per_chip = 0, 1
        root = self.sys / "bus" / "pci" / "devices"
        if not root.is_dir():
            return 0, 1
        for fn in root.iterdir():
            try:
                if (fn / "vendor").read_text().strip() != GOOGLE_PCI_VENDOR:
                    continue
                dev = (fn / "device").read_text().strip()
            except OSError:
                continue
            if dev in TPU_PCI_DEVICES:
                count += 1
                if dev in TWO_DEVICE_CHIPS:
                    per_chip = 2
        return count, per_chip


def tpu_visible(files: ChipFiles | None = None) -> bool:
    """Whether this host shows any TPU chip (for the CLI's default probe list)."""
    files = files or ChipFiles()
    return bool(files.present()) or files.pci_chips()[0] > 0


class TpuProbe:
    """Chips present, and the runtime's metrics when reachable (see the module docstring)."""

    def __init__(
        self,
        host: str,
        *,
        name: str = "tpu",
        interval_s: float = 10.0,
        expected_chips: int | None = None,
        devices_per_chip: int | None = None,
        files: ChipFiles | None = None,
        runtime: RuntimeMetrics | None = None,
    ) -> None:
        self.name = name
        self.host = host
        self.interval_s = interval_s
        self.expected_chips = expected_chips
        self.devices_per_chip = devices_per_chip
        self.files = files or ChipFiles()
        self.runtime = runtime
        self._baseline: list[str] | None = None
        self._expected = 0
        self.stats: dict[str, int] = {"runtime.unreachable": 0, "runtime.answers": 0}
        self._runtime_error = ""

    def device_ids(self, chip: int) -> list[str]:
        per = self.devices_per_chip or 1
        return [f"{self.host}:tpu:{chip * per + j}" for j in range(per)]

    def known_devices(self) -> list[str]:
        return [d for i in range(self._expected) for d in self.device_ids(i)]

    async def check(self) -> list[Condition]:
        return await asyncio.to_thread(self.check_now, time.time())

    def check_now(self, now: float) -> list[Condition]:
        present = self.files.present()
        if self._baseline is None:
            pci, per_chip = self.files.pci_chips()
            if self.devices_per_chip is None:
                self.devices_per_chip = per_chip
            self._baseline = present
            self._expected = max(self.expected_chips or 0, len(present), pci)
            if not self._expected:
                self._baseline = None
                raise TpuUnavailable("no TPU chip here (no /dev/accel*, /dev/vfio/<n> or PCI chip)")
            log.info(
                "checking %d TPU chip(s) (%s; %d device(s) each): %s",
                self._expected,
                ", ".join(present) or "no device file yet",
                self.devices_per_chip,
                ", ".join(self.known_devices()),
            )
        out: list[Condition] = []
        gone = [(i, path) for i, path in enumerate(self._baseline) if path not in present]
        for i, path in gone:
            for d in self.device_ids(i):
                out.append(
                    Condition(d, "failed", "chip:gone", f"TPU chip {i} ({path}) disappeared")
                )
        if len(present) < self._expected and not gone:
            reason = (
                f"{len(present)} of {self._expected} TPU chips present "
                f"({', '.join(present) or 'none'}): the host cannot run its share of the slice"
            )
            out.extend(
                Condition(d, "failed", "chips:missing", reason) for d in self.known_devices()
            )
        if self.runtime is not None:
            out.extend(self._judge_runtime(present))
        return out

    def _judge_runtime(self, present: list[str]) -> list[Condition]:
        assert self.runtime is not None
        try:
            usage = self.runtime.usage()
        except TpuUnavailable as e:
            self.stats["runtime.unreachable"] += 1
            if str(e) != self._runtime_error:
                log.debug("TPU runtime metrics unavailable: %s", e)
                self._runtime_error = str(e)
            return []
        self.stats["runtime.answers"] += 1
        self._runtime_error = ""
        reported = {u.device_id: u for u in usage}
        out = []
        for i, path in enumerate(self._baseline or []):
            if path not in present:
                continue
            for local, d in enumerate(self.device_ids(i)):
                device_id = i * (self.devices_per_chip or 1) + local
                u = reported.get(device_id)
                # A device the runtime does not list may belong to no trainer (a process can
                # use a subset of the chips, TPU_VISIBLE_CHIPS): only a listed one is judged.
                if u is not None and u.memory_total <= 0:
                    out.append(
                        Condition(
                            d,
                            "degraded",
                            "runtime:no-hbm",
                            f"the TPU runtime reports no HBM for device {device_id} ({path})",
                        )
                    )
        return out
