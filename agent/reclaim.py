"""Between incarnations: wait until the GPUs' memory is released (seed 004's memory reclaim).

A killed trainer's device memory is freed by the driver shortly after the process is gone;
starting the next trainer before that can make it fail to allocate. For each device of this
worker that NVML knows (a ``GPU-...`` UUID), poll its used memory until it drops below the
tolerance or the timeout passes; then go on (best effort: the timeout is logged, not fatal).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("agent.reclaim")

# device UUID -> used MiB, or None when the device is not an NVML device.
UsedMiB = Callable[[str], float | None]


def nvml_used_mib(device: str) -> float | None:
    """Used memory of an NVIDIA GPU by NVML UUID; None when NVML cannot tell."""
    if not device.startswith(("GPU-", "MIG-")):
        return None
    from agent.devices import _nvml

    pynvml = _nvml()
    if pynvml is None:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(device)
        return float(pynvml.nvmlDeviceGetMemoryInfo(handle).used) / (1024 * 1024)
    except Exception as e:  # NVMLError: not found, not supported
        log.debug("NVML memory of %s: %s", device, e)
        return None


async def wait_for_release(
    devices: list[str],
    *,
    tolerance_mib: float = 512.0,
    timeout_s: float = 50.0,
    poll_s: float = 0.5,
    used_mib: UsedMiB = nvml_used_mib,
) -> dict[str, float]:
    """Wait until every measurable device uses at most ``tolerance_mib``. Returns the last
    reading of the devices still above it (empty: all released, or nothing measurable)."""
    deadline = time.monotonic() + timeout_s
    while True:
        readings = {d: used_mib(d) for d in devices}
        busy = {d: u for d, u in readings.items() if u is not None and u > tolerance_mib}
        if not busy:
            return {}
        if time.monotonic() >= deadline:
            log.error(
                "device memory not released within %gs: %s; starting anyway",
                timeout_s,
                ", ".join(f"{d} {u:.0f} MiB" for d, u in busy.items()),
            )
            return busy
        await asyncio.sleep(poll_s)
