"""The library's timing (agent/library/perf.py): samples bounded, summaries as the wire wants."""

from __future__ import annotations

import asyncio

from agent.library.perf import (
    PerfRecorder,
    PerfSender,
    local_from_env,
    section_name,
    summarize,
    window_from_env,
)
from marduk.wire import protocol as wire
from marduk.wire.perf import MAX_SECTIONS, PerfSummary


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_steps_and_sections_are_timed_and_the_buffer_is_bounded() -> None:
    clock = Clock()
    rec = PerfRecorder(max_samples=3, clock=clock)
    rec.step()  # the first step starts the first interval
    for dt in (0.1, 0.2):
        clock.t += dt
        rec.step()
    started = rec.enter()
    clock.t += 0.05
    rec.leave("compute", started)
    rec.leave("compute", started)  # past the bound: counted, not kept
    samples, dropped = rec.take()
    assert [(n, round(x, 3)) for n, x in samples] == [
        ("step", 0.1),
        ("step", 0.2),
        ("compute", 0.05),
    ]
    assert dropped == 1 and rec.take() == ([], 0)  # a fresh window


def test_summary_percentiles_sections_and_names() -> None:
    samples = [("step", float(i)) for i in range(1, 11)]
    samples += [(f"s{i}", 1.0) for i in range(MAX_SECTIONS + 4)]  # too many sections
    samples += [("bad name/ü", 2.0), ("bad name/ü", 3.0)]
    out = summarize(samples)
    assert len(out) == MAX_SECTIONS
    step = out[0]
    assert (step.name, step.count, step.p50, step.p90, step.max, step.min) == (
        "step",
        10,
        5.0,
        10.0,
        10.0,
        1.0,
    )
    assert out[1].name == "bad_name__" and out[1].count == 2  # the most sampled kept
    assert section_name("x" * 100) == "x" * 64


def test_a_summary_decodes_strictly_and_an_idle_window_sends_nothing() -> None:
    rec = PerfRecorder()
    sent: list[PerfSummary] = []

    async def send(s: PerfSummary) -> bool:
        sent.append(s)
        return True

    sender = PerfSender(
        rec, send, job="j", replica="r", worker=0, rank=3, incarnation=1, devices=["g3"]
    )
    assert sender.summary(5.0) is None
    for _ in range(4):
        rec.step()
    s = sender.summary(5.0)
    assert s is not None and s.seq == 0 and s.sections[0].count == 3
    assert wire.decode(wire.encode(s), PerfSummary) == s
    assert asyncio.run(send(s)) and sent == [s]


def test_window_and_local_rank_from_the_environment() -> None:
    assert window_from_env({}) == 5.0
    assert window_from_env({"MARDUK_PERF_WINDOW": "0"}) == 0.0
    assert window_from_env({"MARDUK_PERF_WINDOW": "soon"}) == 5.0
    assert local_from_env({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}) == (2, 4)
    assert local_from_env({"LOCAL_RANK": "-1"}) == (None, None)
