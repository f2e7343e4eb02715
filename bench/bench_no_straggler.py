"""Benchmark: no false straggler in a long run with no slowdown (decisions.md 19).

A run of ``--seconds`` (default 300) on this machine, loaded as it is: one nats-server, one
``marduk controller --no-embedded`` (default detection: factor 1.3, 3 windows, warm-up 2), and
two jobs under ``marduk agent run``: ``gloo``, four torch gloo ranks under one agent (an
all_reduce a step: a synchronous job, tests/trainers/gloo_perf.py), and ``lib``, three
supervised replicas stepping on their own (tests/trainers/lib_trainer.py --mode compute). No
rank is ever made slower. ``marduk monitor watch --json`` collects every event; every
``--poll`` seconds the controller's performance view (``ctl.perf_query``) is read for the worst
ratio to the job's median and the worst relative score it shows. Reported: straggler events
(the target: none), windows judged, the worst ratio seen (how far below the factor the noise
stayed), the machine's load average.

    .venv/bin/python bench/bench_no_straggler.py --seconds 300 --window 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_notify import machine, source_version, start_nats_server


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        args, env=env, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def agent(env: dict[str, str], log: Path, *opts: str, cmd: list[str]) -> subprocess.Popen[bytes]:
    return spawn([sys.executable, "-m", "marduk", "agent", "run", *opts, "--", *cmd], env, log)


def perf(env: dict[str, str]) -> dict:  # type: ignore[type-arg]
    """The controller's performance view ({} when none answered in time: a loaded machine)."""
    import asyncio

    import msgspec

    from monitor_cli import client

    reply = asyncio.run(client.perf(env["MARDUK_ADDR"], "marduk", None, 20.0))
    return msgspec.to_builtins(reply) if reply is not None else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--window", type=float, default=5.0, help="MARDUK_PERF_WINDOW")
    p.add_argument("--poll", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "no_straggler.json")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="marduk-nostrag-"))
    server, url = start_nats_server(tmp)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "MARDUK_ADDR": url,
        "MARDUK_PERF_WINDOW": str(args.window),
    }
    procs: list[subprocess.Popen[bytes]] = []
    events: list[dict] = []  # type: ignore[type-arg]
    try:
        procs.append(
            spawn(
                [
                    sys.executable,
                    "-m",
                    "marduk",
                    "controller",
                    "--no-embedded",
                    "--state-dir",
                    str(tmp / "ctl"),
                ],
                env,
                tmp / "controller.log",
            )
        )
        watch = subprocess.Popen(
            [sys.executable, "-m", "marduk", "monitor", "watch", "--json"],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )  # fmt: skip
        procs.append(watch)  # type: ignore[arg-type]

        def pump() -> None:
            assert watch.stdout is not None
            for line in watch.stdout:
                if line.startswith("{"):
                    events.append(json.loads(line))

        threading.Thread(target=pump, daemon=True).start()
        procs.append(
            agent(
                env,
                tmp / "gloo.log",
                *("--job", "gloo", "--replica", "r0", "--devices", "g0,g1,g2,g3"),
                *("--nproc-per-node", "4", "--preload", "torch"),
                cmd=[sys.executable, "tests/trainers/gloo_perf.py"],
            )
        )
        for r in range(3):
            procs.append(
                agent(
                    env,
                    tmp / f"lib{r}.log",
                    *("--job", "lib", "--replica", f"r{r}", "--devices", f"lib-{r}"),
                    *("--preload", "none"),
                    cmd=[sys.executable, "tests/trainers/lib_trainer.py", "--mode", "compute"],
                )
            )
        # From the first window of every rank on: 7 ranks report.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            view = perf(env)
            if sum(j["ranks"] for j in view.get("jobs", [])) >= 7:
                break
            time.sleep(2)
        else:
            raise SystemExit(f"the ranks never all reported; logs in {tmp}")
        t0 = time.monotonic()
        worst_ratio, worst_relative, polls, load = 0.0, 1.0, 0, []
        while time.monotonic() - t0 < args.seconds:
            time.sleep(args.poll)
            view = perf(env)
            polls += 1
            load.append(os.getloadavg()[0])
            for j in view.get("jobs", []):
                for r in j["slowest"]:
                    worst_ratio = max(worst_ratio, r["ratio"])
                    worst_relative = min(worst_relative, r["relative"])
        final = perf(env)
        kinds = [e["kind"] for e in events]
        result = {
            "bench": "no_straggler",
            "seconds": args.seconds,
            "window_s": args.window,
            "ranks": 7,
            "windows_per_rank": int(args.seconds / args.window),
            "straggler_detected": kinds.count("straggler_detected"),
            "straggler_events": [e for e in events if e["kind"].startswith("straggler_")],
            "worst_ratio_to_median": round(worst_ratio, 3),
            "worst_relative": round(worst_relative, 3),
            "polls": polls,
            "loadavg_1m": {"min": min(load), "max": max(load), "mean": sum(load) / len(load)},
            "summaries_used": final.get("stats", {}).get("perf.summaries", 0),
            "dropped": {k: v for k, v in final.get("stats", {}).items() if "dropped" in k},
            "trainer_restarts": kinds.count("trainer_restarting"),
            "machine": machine(),
            "source": source_version(),
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
