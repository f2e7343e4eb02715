"""Stragglers over a real nats-server: four library clients, one made 1.5x slower, the
controller names its device; bad telemetry counted and survived; records outlive a restart."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import msgspec
import nats
import pytest

import agent
from marduk.controller import Controller
from marduk.core.stragglers import StragglerConfig
from marduk.wire import protocol as wire
from marduk.wire.subjects import Subjects
from monitor_cli import client as monitor
from monitor_cli import perf_view
from monitor_cli.status_view import plain_lines
from tests.conftest import NatsServer, controller_settings, eventually, start_serving

WINDOW = 0.5
FAST = StragglerConfig(factor=1.3, windows=3, warmup_windows=1, min_samples=3, min_interval_s=0.1)


def settings(server: NatsServer, tmp_path: Path):  # type: ignore[no-untyped-def]
    st = controller_settings(server, tmp_path)
    st.stragglers = FAST
    return st


class Trainer:
    """A library client in a thread of its own: ``compute`` then ``step``, ``slow`` x slower."""

    def __init__(self, url: str, rank: int) -> None:
        self.client = agent.connect(f"r{rank}", [f"gpu-{rank}"], "train", url)
        self.slow = 1.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        step = 0
        while not self.stop.is_set():
            with self.client.section("compute"):
                time.sleep(0.02 * self.slow)
            step += 1
            self.client.step(step)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.client.close()


async def events(url: str, kinds: set[str]) -> tuple[nats.NATS, list[wire.ControllerEvent]]:
    nc = await nats.connect(url)
    seen: list[wire.ControllerEvent] = []

    async def on(msg) -> None:  # type: ignore[no-untyped-def]
        e = wire.decode(msg.data, wire.ControllerEvent)
        if e.kind in kinds:
            seen.append(e)

    await nc.subscribe(Subjects().all_events, cb=on)
    return nc, seen


@pytest.mark.timeout(90)
async def test_slow_rank_named_by_device_then_cleared(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MARDUK_PERF_WINDOW", str(WINDOW))
    c = await start_serving(Controller(settings(nats_server, tmp_path)))
    nc, seen = await events(nats_server.url, {"straggler_detected", "straggler_cleared"})
    trainers = [await asyncio.to_thread(Trainer, nats_server.url, r) for r in range(4)]
    try:
        await eventually(lambda: c.stats["perf.summaries"] >= 12, timeout=20)
        assert seen == []  # four equal ranks: nothing to say
        trainers[2].slow = 1.5
        slowed = time.monotonic()
        await eventually(lambda: any(e.kind == "straggler_detected" for e in seen), timeout=20)
        took = time.monotonic() - slowed
        e = seen[0]
        assert (e.job, e.replica, e.worker, e.device) == ("train", "r2", 0, "gpu-2")
        assert e.straggler is not None and e.straggler.devices == ["gpu-2"]
        assert e.straggler.section in {"compute", "step"}
        assert 0 < e.straggler.relative < 0.85 and e.straggler.ratio > 1.3
        # Within three windows past the slowdown, give or take the window it fell in.
        assert took < 6 * WINDOW + 2.0, took

        # status's view: the job's rate and its straggler, with its device
        reply = await c.perf.reply("train")
        (job,) = reply.jobs
        assert job.ranks == 4 and job.steps_per_s > 0 and job.step_p50 > 0
        assert {(s.replica, tuple(s.devices)) for s in job.stragglers} == {("r2", ("gpu-2",))}
        metrics = "".join(str(m) for m in c.perf.metrics())
        assert "marduk_straggler_relative_score" in metrics
        # What `marduk monitor status` asks and prints.
        answer = await monitor.perf(nats_server.url, "marduk", None, 5.0)
        lines = "\n".join(plain_lines(perf_view.perf_blocks(answer)))
        assert "train" in lines and "gpu-2" in lines and "straggler" in lines, lines

        trainers[2].slow = 1.0
        await eventually(lambda: any(e.kind == "straggler_cleared" for e in seen), timeout=20)
        cleared = [e for e in seen if e.kind == "straggler_cleared"]
        assert cleared[0].replica == "r2" and cleared[0].device == "gpu-2"
        assert not [e for e in seen if e.replica != "r2"]  # no other rank was ever named
    finally:
        for t in trainers:
            await asyncio.to_thread(t.close)
        await nc.close()
        await c.stop()

    # The device's record outlives the controller: a new one reads it from the store.
    c2 = await start_serving(Controller(settings(nats_server, tmp_path)))
    try:
        assert c2.perf.store is not None
        record = await c2.perf.store.get("gpu-2")
        assert record is not None and record.detections >= 1 and record.jobs == ["train/r2#0"]
    finally:
        await c2.stop()


def summary(**kw: object) -> bytes:
    base: dict[str, object] = {
        "type": "perf",
        "v": 1,
        "job": "train",
        "replica": "r0",
        "worker": 0,
        "rank": 0,
        "window_s": 1.0,
        "sections": [
            {"name": "compute", "count": 10, "p50": 0.01, "p90": 0.02, "max": 0.03, "min": 0.01}
        ],
    }
    base.update(kw)
    return msgspec.json.encode(base)


@pytest.mark.timeout(60)
async def test_bad_telemetry_is_counted_and_survived(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    c = await start_serving(Controller(settings(nats_server, tmp_path)))
    client = await asyncio.to_thread(agent.connect, "r0", ["gpu-0"], "train", nats_server.url)
    nc = await nats.connect(nats_server.url)
    s = Subjects()
    try:
        sec = {"name": "compute", "count": 10, "p50": 0.01, "p90": 0.02, "max": 0.03}
        bad = {
            "malformed": b"{not json",
            "oversized": b"x" * 20_000,
            "invalid": summary(sections=[{**sec, "name": f"s{i}"} for i in range(40)]),
            "invalid_value": summary(sections=[{**sec, "p50": float("1e12")}]),
            "implausible": summary(sections=[{**sec, "p50": 0.5}]),  # p50 above max
            "unknown_worker": summary(replica="nobody"),
            "misdirected": summary(job="other"),
        }
        for payload in bad.values():
            await nc.publish(s.perf("train"), payload)
        for _ in range(200):  # a flood from one rank
            await nc.publish(s.perf("train"), summary())
        await nc.flush()
        await eventually(lambda: c.stats["perf.rejected.malformed"] >= 1, timeout=10)
        await eventually(lambda: c.stats["perf.dropped.rate"] >= 150, timeout=10)
        st = c.stats
        assert st["perf.rejected.oversized"] == 1
        assert st["perf.rejected.invalid"] == 2  # too many sections; a day-long section
        assert st["perf.dropped.implausible"] == 1
        assert st["perf.rejected.unknown_worker"] == 1
        assert st["perf.rejected.misdirected"] == 1
        assert len(c.perf.detector) == 1  # the flood is one rank, tracked once
        # Still serving: a query answers.
        reply = await nc.request(s.perf_query, msgspec.json.encode({"type": "perf_query"}), 5)
        assert msgspec.json.decode(reply.data)["type"] == "perf_reply"
        assert c.stats["perf.rejected.invalid"] == 2  # the query is no summary
    finally:
        await nc.close()
        await asyncio.to_thread(client.close)
        await c.stop()
