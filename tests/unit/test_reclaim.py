"""Waiting for device memory between incarnations, with a fake NVML reading."""

from __future__ import annotations

from agent.supervise.reclaim import nvml_used_mib, wait_for_release


async def test_waits_until_memory_drops_below_tolerance() -> None:
    readings = {"GPU-a": [9000.0, 4000.0, 100.0], "GPU-b": [50.0]}

    def used(d: str) -> float | None:
        r = readings.get(d)
        if r is None:
            return None
        return r.pop(0) if len(r) > 1 else r[0]

    busy = await wait_for_release(
        ["GPU-a", "GPU-b", "host:cpu:0"], tolerance_mib=512, timeout_s=5, poll_s=0.01, used_mib=used
    )
    assert busy == {} and readings["GPU-a"] == [100.0]


async def test_gives_up_after_timeout_and_says_which() -> None:
    busy = await wait_for_release(["GPU-a"], timeout_s=0.05, poll_s=0.01, used_mib=lambda d: 8000.0)
    assert busy == {"GPU-a": 8000.0}


def test_non_nvidia_devices_are_not_measured() -> None:
    assert nvml_used_mib("node-1:tpu:0") is None
