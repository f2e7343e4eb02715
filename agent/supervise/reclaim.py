"""Between incarnations: wait until the GPUs' memory is released (as NVRx's launcher does).

A killed trainer's device memory is freed by the driver shortly after the process is gone;
starting the next trainer before that can make it fail to allocate. For each device of this
worker that NVML knows (a ``GPU-...`` UUID), poll its used memory until it drops below the
tolerance or the timeout passes; then go on (best effort: the timeout is logged, not fatal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("agent.reclaim")

# device UUID -> used MiB, or None when the device is not an NVML device.
UsedMiB = Callable[[str], float | None]


def nvml_used_mib(device: str) -> float | None:
    """Used memory of an NVIDIA GPU by NVML UUID; None when NVML cannot tell."""
    if not device.startswith(("GPU-", "MIG-")):
        return None
    from agent.library.devices import _nvml

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


async def clean_up(
    stale_files: list[str],
    cleanup_cmd: str,
    devices: list[str],
    *,
    reclaim_timeout_s: float,
    reclaim_tolerance_mib: float,
) -> None:
    """Remove stale lockfiles, run the user's cleanup command, wait for the GPUs' memory to be
    released (``marduk agent run`` does this before every restart)."""
    for path in stale_files:
        with contextlib.suppress(FileNotFoundError, PermissionError):
            os.unlink(path)  # a local lockfile: no thread hop on the restart's path
            log.info("removed stale %s", path)
    if cleanup_cmd:
        proc = await asyncio.create_subprocess_shell(cleanup_cmd)
        try:
            code = await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            code = -9
        if code != 0:
            log.warning("cleanup command exited %s", code)
    if reclaim_timeout_s > 0:
        await wait_for_release(
            devices, tolerance_mib=reclaim_tolerance_mib, timeout_s=reclaim_timeout_s
        )
