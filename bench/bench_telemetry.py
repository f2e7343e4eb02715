"""Benchmark: performance telemetry (decisions.md 19). What it costs in the training loop, and in
the controller with many ranks reporting every window.

``loop`` (a few seconds, in this process): ``timeit`` of the sync client's ``step()`` and of a
``with client.section(...)`` block as a NATS-registered trainer runs them (the methods of
``agent.library.sync_client.Client`` on a client whose transport is not started: the same code
path, without a controller), of the recorder alone, and, for comparison, of the cross-thread
hop (``asyncio.run_coroutine_threadsafe``) that the supervised path still pays per call and
that ``step()`` paid before. Best of 5 repeats.

``controller`` (about a minute): one nats-server; ``marduk controller --no-embedded`` as its own
process; ``--workers`` workers registered by plain requests (jobs of ``--ranks-per-job``), then
one summary per worker per ``--window`` seconds for ``--seconds`` seconds from this process,
spread evenly over each window; one rank per job 1.5x slower. Measured: the controller's CPU
time over the run (/proc, user + system) as a share of one core, the message rate sent, the
summaries it used and dropped (its counters, by ``ctl.perf_query``), stragglers it named.

    .venv/bin/python bench/bench_telemetry.py loop
    .venv/bin/python bench/bench_telemetry.py controller --workers 2000 --window 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_notify import machine, source_version, start_nats_server

from agent.library.perf import PerfRecorder
from agent.library.sync_client import Client
from marduk.wire import protocol as wire


def per_call_us(fn, number: int = 200_000) -> float:  # type: ignore[no-untyped-def]
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def loop_costs() -> dict[str, float]:
    rec = PerfRecorder(max_samples=10**8)
    client = Client.__new__(Client)  # the facade's methods, without connecting
    client._perf = rec
    client._progress_here = True
    client._async = SimpleNamespace(last_step=None, last_progress=0.0)  # type: ignore[assignment]
    client._closed = False

    def section() -> None:
        with client.section("compute"):
            pass

    def bare_section() -> None:
        started = rec.enter()
        rec.leave("compute", started)

    out = {
        "client.step() us": per_call_us(lambda: client.step(1)),
        "with client.section() us": per_call_us(section),
        "recorder step us": per_call_us(rec.step),
        "recorder enter+leave us": per_call_us(bare_section),
    }
    rec.take()
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()

    async def nothing() -> None:
        return None

    def hop() -> None:
        asyncio.run_coroutine_threadsafe(nothing(), loop)

    out["cross-thread hop (supervised path) us"] = per_call_us(hop, number=20_000)
    # What was handed over runs first (FIFO), then the loop stops with nothing pending.
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)
    return {k: round(v, 3) for k, v in out.items()}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def controller_run(args: argparse.Namespace) -> dict[str, object]:
    import nats

    from marduk.transport import bus
    from marduk.wire.subjects import Subjects

    tmp = Path(tempfile.mkdtemp(prefix="bench-telemetry-"))
    server, url = start_nats_server(tmp)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MARDUK_LOG_LEVEL": "warning"}
    ctl = subprocess.Popen(
        [sys.executable, "-m", "marduk", "controller", "--no-embedded", "--addr", url,
         "--state-dir", str(tmp / "state"), "--worker-ttl", "600", "--straggler-warmup", "1"],
        env=env, stderr=(tmp / "controller.log").open("wb"),
    )  # fmt: skip
    s = Subjects()
    nc = await nats.connect(url)
    try:
        deadline = time.monotonic() + 30
        while True:  # serving once a query answers
            try:
                await bus.request(nc, s.query, wire.Query(what="ping"), wire.QueryReply, timeout=1)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        n, per_job = args.workers, args.ranks_per_job
        who = [(f"job{i // per_job}", f"r{i % per_job}", i % per_job) for i in range(n)]
        started = time.monotonic()
        for lo in range(0, n, 200):
            await asyncio.gather(
                *(
                    bus.request(
                        nc,
                        s.register(job),
                        wire.Registration(
                            job=job, replica=replica, devices=[f"{job}-gpu-{rank}"], pid=1
                        ),
                        wire.RegisterReply,
                        timeout=30,
                    )
                    for job, replica, rank in who[lo : lo + 200]
                )
            )
        registered_s = time.monotonic() - started

        def payload(job: str, replica: str, rank: int, seq: int) -> bytes:
            p50 = 0.1 * (1.5 if rank == 3 else 1.0)
            sec = [
                wire.SectionStats(name="step", count=8, p50=p50 + 0.02, p90=p50 + 0.03,
                                  max=p50 + 0.05, min=p50),
                wire.SectionStats(name="compute", count=8, p50=p50, p90=p50 * 1.05,
                                  max=p50 * 1.2, min=p50 * 0.95),
            ]  # fmt: skip
            return wire.encode(
                wire.PerfSummary(job=job, replica=replica, worker=0, rank=rank,
                                 window_s=args.window, seq=seq, sections=sec)
            )  # fmt: skip

        cpu0, t0 = cpu_seconds(ctl.pid), time.monotonic()
        sent, seq = 0, 0
        slots = 20  # each window in 20 slices, a 20th of the workers each
        while time.monotonic() - t0 < args.seconds:
            window_start = time.monotonic()
            for k in range(slots):
                for job, replica, rank in who[k::slots]:
                    await nc.publish(s.perf(job), payload(job, replica, rank, seq))
                    sent += 1
                await nc.flush()
                pause = window_start + (k + 1) * args.window / slots - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
            seq += 1
        await nc.flush()
        await asyncio.sleep(0.5)
        wall, cpu = time.monotonic() - t0, cpu_seconds(ctl.pid) - cpu0
        reply = await bus.request(nc, s.perf_query, wire.PerfQuery(), wire.PerfReply, timeout=10)
        stats = reply.stats
        return {
            "workers": n,
            "ranks_per_job": per_job,
            "window_s": args.window,
            "equivalent_workers_at_5s": round(n * 5.0 / args.window),
            "registered_in_s": round(registered_s, 1),
            "seconds": round(wall, 1),
            "sent_per_s": round(sent / wall),
            "used": stats.get("perf.summaries", 0),
            "dropped_or_rejected": {k: v for k, v in stats.items() if ".dropped." in k or
                                    ".rejected." in k},
            "stragglers_named": stats.get("perf.straggler_detected", 0),
            "controller_cpu_share_of_one_core": round(cpu / wall, 3),
            "controller_cpu_us_per_summary": round(cpu / max(1, stats.get("perf.summaries", 1))
                                                   * 1e6, 1),
        }  # fmt: skip
    finally:
        await nc.close()
        ctl.terminate()
        try:
            ctl.wait(10)
        except subprocess.TimeoutExpired:
            ctl.kill()
        server.terminate()
        server.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mode", choices=["loop", "controller"])
    ap.add_argument("--workers", type=int, default=2000)
    ap.add_argument("--ranks-per-job", type=int, default=250)
    ap.add_argument("--window", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args()
    result = {"source": source_version(), "machine": machine(), "load": os.getloadavg()}
    if args.mode == "loop":
        result["loop"] = loop_costs()
    else:
        result["controller"] = asyncio.run(controller_run(args))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
