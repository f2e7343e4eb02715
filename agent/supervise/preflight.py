"""A device check between incarnations (a runtime that crashed can fail
again in the next process if the device is bad: check it before starting one).

A crashed accelerator runtime can poison the process it ran in, and a fresh process cures it;
but a device that is really broken fails the fresh process too. Before starting a new trainer
after a device-class failure, ``marduk agent run --preflight`` runs this module in a separate
process (never in the supervisor: a hang or a crash here must not take it down): jax lists the
devices, and a tiny computation runs on each, under a timeout. Exit 0: all well. Exit 1: a
device is missing or fails; the lines on stdout say which (``PREFLIGHT FAIL <id>: <why>``).

    python -m agent.supervise.preflight --expect 8
"""

from __future__ import annotations

import argparse
import sys
import time

from marduk.transport.children import run_with_deadline


def check(expect: int | None) -> list[str]:
    """Failures, one line each (empty: all well). Imports jax here, in the child only."""
    import jax
    import jax.numpy as jnp

    failures = []
    devices = jax.local_devices()
    if expect is not None and len(devices) < expect:
        failures.append(f"expected {expect} device(s), jax sees {len(devices)}")
    for d in devices:
        try:
            x = jax.device_put(jnp.arange(8, dtype=jnp.float32), d)
            got = float((x * 2).sum())
            if got != 56.0:
                failures.append(f"{d.platform}:{d.id}: computed {got}, expected 56.0")
        except Exception as e:
            failures.append(f"{d.platform}:{d.id}: {type(e).__name__}: {e}"[:300])
    return failures


async def run_check(
    env: dict[str, str], expect: int | None, timeout_s: float
) -> tuple[bool, list[str]]:
    """In the supervisor: run this module in a fresh process (its own session) under a
    timeout; (passed, its output lines)."""
    cmd = [sys.executable, "-m", "agent.supervise.preflight"]
    if expect:
        cmd += ["--expect", str(expect)]
    code, lines = await run_with_deadline(cmd, timeout_s, env)
    if code is None:
        return False, [f"PREFLIGHT FAIL no answer within {timeout_s:g}s"]
    return code == 0, lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--expect", type=int, default=None, help="devices this host must have")
    args = p.parse_args()
    t0 = time.perf_counter()
    try:
        failures = check(args.expect)
    except Exception as e:  # jax cannot even start: that is the finding
        failures = [f"runtime: {type(e).__name__}: {e}"[:300]]
    for line in failures:
        print(f"PREFLIGHT FAIL {line}", flush=True)
    print(
        f"PREFLIGHT {'FAILED' if failures else 'OK'} in {time.perf_counter() - t0:.2f}s", flush=True
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
