"""The straggler detector (marduk/core/stragglers.py): pure, time passed in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from marduk.core.stragglers import (
    RankKey,
    StragglerConfig,
    StragglerDetector,
    implausible,
    note_slow,
    repeat_offenders,
)
from marduk.wire.perf import PerfSummary, SectionStats

W = 5.0  # window length


def summary(
    rank: int, p50: float, *, count: int = 20, incarnation: int = 0, section: str = "compute"
) -> PerfSummary:
    return PerfSummary(
        job="j",
        replica=f"r{rank}",
        worker=0,
        rank=rank,
        incarnation=incarnation,
        window_s=W,
        sections=[
            SectionStats(
                name=section, count=count, p50=p50, p90=p50 * 1.1, max=p50 * 1.3, min=p50 * 0.9
            ),
        ],
    )


def run(
    det: StragglerDetector, windows: int, times: dict[int, float], t0: float = 0.0, **kw: object
) -> tuple[list, float]:
    """``windows`` windows of every rank at ``times[rank]``; the findings and the time after."""
    found = []
    t = t0
    for _ in range(windows):
        t += W
        for rank, p50 in times.items():
            found += det.observe(summary(rank, p50, **kw), t).findings  # type: ignore[arg-type]
    return found, t


NORMAL = {0: 0.10, 1: 0.10, 2: 0.10, 3: 0.10}
SLOW = {0: 0.10, 1: 0.10, 2: 0.15, 3: 0.10}  # rank 2 is 1.5x slower


def test_slow_rank_detected_within_three_windows_and_cleared_on_recovery() -> None:
    det = StragglerDetector()
    found, t = run(det, 4, NORMAL)  # past the warm-up
    assert found == []
    found, t = run(det, 3, SLOW, t)
    assert [(f.kind, f.key.rank, f.section) for f in found] == [("detected", 2, "compute")]
    f = found[0]
    assert f.windows == 3 and f.ratio == pytest.approx(1.5)
    assert f.relative == pytest.approx(0.10 / 0.15) and f.individual == pytest.approx(0.10 / 0.15)
    assert len(det.stragglers("j")) == 1
    found, t = run(det, 2, NORMAL, t)
    assert found == []  # hysteresis: three normal windows to clear
    found, t = run(det, 1, NORMAL, t)
    assert [(f.kind, f.key.rank) for f in found] == [("cleared", 2)]
    assert det.stragglers() == []


def test_no_alarm_for_one_noisy_window_or_two() -> None:
    det = StragglerDetector()
    _, t = run(det, 3, NORMAL)
    for _ in range(5):  # two slow windows, one normal: never three in a row
        found, t = run(det, 2, {**NORMAL, 1: 0.3}, t)
        assert found == []
        found, t = run(det, 1, NORMAL, t)
        assert found == []


def test_no_alarm_during_warm_up_after_each_incarnation() -> None:
    det = StragglerDetector(StragglerConfig(warmup_windows=2))
    _, t = run(det, 4, NORMAL)
    # Rank 3 restarts: its first two windows (compile, restore) are 5x slow: ignored.
    found = []
    for _ in range(2):
        t += W
        for rank in range(3):
            found += det.observe(summary(rank, 0.10), t).findings
        found += det.observe(summary(3, 0.50, incarnation=1), t).findings
    assert found == []
    found, t = run(det, 5, {**NORMAL}, t, incarnation=0)  # ranks 0-2; rank 3 at incarnation 1:
    assert found == []


def test_checkpoint_pause_is_no_evidence() -> None:
    det = StragglerDetector(StragglerConfig(min_samples=5))
    _, t = run(det, 3, NORMAL)
    # A checkpoint: every rank's window has 2 long steps (too few samples), then one long step
    # in a full window (p50 does not move). Nothing fires.
    found, t = run(det, 3, {r: 5.0 for r in range(4)}, t, count=2)
    assert found == []
    found, t = run(det, 3, {**NORMAL, 0: 0.4}, t, count=2)  # only rank 0 checkpoints
    assert found == []


def test_restart_and_silence_clear_a_straggler() -> None:
    det = StragglerDetector(StragglerConfig(stale_after_s=12.0))
    _, t = run(det, 3, NORMAL)
    found, t = run(det, 3, SLOW, t)
    assert [f.kind for f in found] == ["detected"]
    found = det.observe(summary(2, 0.10, incarnation=1), t + W).findings
    assert [(f.kind, f.why) for f in found] == [("cleared", "restarted (new incarnation)")]
    found, t = run(det, 5, SLOW, t + W, incarnation=1)  # every rank's warm-up, then slow
    assert [f.kind for f in found] == ["detected"]
    found = det.sweep(t + 20.0)
    assert {f.kind for f in found} == {"cleared"} and len(det) == 0


def test_floods_and_lies_are_dropped_and_bounded() -> None:
    det = StragglerDetector(StragglerConfig(max_ranks=3))
    assert det.observe(summary(0, 0.1), 1.0).dropped is None
    assert det.observe(summary(0, 0.1), 1.1).dropped == "rate"
    det.observe(summary(1, 0.1), 1.0)
    det.observe(summary(2, 0.1), 1.0)
    assert det.observe(summary(3, 0.1), 1.0).dropped == "too_many_ranks"
    bad = summary(0, 0.1)
    bad.sections[0].p90 = 0.01
    assert implausible(bad) is not None
    assert det.observe(bad, 20.0).dropped == "implausible"
    many = summary(0, 0.1)
    many.sections[0].count, many.sections[0].min = 1_000_000, 0.05
    assert implausible(many) is not None  # 50,000 s of samples in a 5 s window
    assert det.observe(summary(0, 0.1, incarnation=1), 30.0).dropped is None
    assert det.observe(summary(0, 0.1, incarnation=0), 40.0).dropped == "stale_incarnation"


def test_a_lone_rank_is_never_a_straggler() -> None:
    det = StragglerDetector()
    found, _ = run(det, 10, {0: 1.0})
    assert found == []


def test_job_perf_view() -> None:
    det = StragglerDetector()
    _, t = run(det, 3, NORMAL, section="step")
    _, t = run(det, 3, SLOW, t, section="step")
    view = det.job_perf("j", t, {RankKey("j", "r2", 0, 2): ["gpu-2"]})
    assert view is not None and view.ranks == 4
    assert view.steps_per_s == pytest.approx(20 / W) and view.step_p50 == pytest.approx(0.10)
    assert [(r.rank, r.devices) for r in view.stragglers] == [(2, ["gpu-2"])]
    assert view.slowest[0].rank == 2


def test_device_record_names_each_run_once() -> None:
    det = StragglerDetector()
    _, t = run(det, 3, NORMAL)
    found, t = run(det, 3, SLOW, t)
    rec = note_slow(None, "gpu-2", found[0], t)
    rec = note_slow(rec, "gpu-2", found[0], t)
    assert rec.detections == 2 and rec.jobs == ["j/r2#0"]
    assert repeat_offenders([rec]) == []
    found = [f for f in found]
    other = type(found[0])(**{**found[0].__dict__, "incarnation": 1})
    rec = note_slow(rec, "gpu-2", other, t)
    assert rec.jobs == ["j/r2#0", "j/r2#1"] and repeat_offenders([rec]) == [rec]


@settings(max_examples=60, deadline=None)
@given(
    noise=st.lists(st.lists(st.floats(0.8, 1.25), min_size=4, max_size=4), min_size=3, max_size=30)
)
def test_no_straggler_while_every_rank_is_within_the_factor(noise: list[list[float]]) -> None:
    # Invariant: ranks whose times stay within factor of each other are never stragglers, nor
    # does anything clear that was never detected.
    det = StragglerDetector(StragglerConfig(factor=1.6, warmup_windows=0))
    t = 0.0
    for row in noise:
        t += W
        for rank, x in enumerate(row):
            assert det.observe(summary(rank, 0.1 * x), t).findings == []


@settings(max_examples=40, deadline=None)
@given(slowdown=st.floats(1.35, 5.0), before=st.integers(3, 8))
def test_a_steady_slowdown_is_always_detected_in_exactly_n_windows(
    slowdown: float, before: int
) -> None:
    det = StragglerDetector(StragglerConfig(factor=1.3, windows=3, warmup_windows=2))
    _, t = run(det, before, NORMAL)
    found, _ = run(det, 3, {**NORMAL, 1: 0.1 * slowdown}, t)
    assert [(f.kind, f.key.rank) for f in found] == [("detected", 1)]


def test_a_large_job_uses_the_whole_jobs_reference_and_still_finds_its_straggler() -> None:
    det = StragglerDetector()
    ranks = {r: 0.10 for r in range(64)}  # above EXACT_RANKS: the cached reference
    found, t = run(det, 3, ranks)
    assert found == []
    found, t = run(det, 4, {**ranks, 17: 0.16}, t)
    assert [(f.kind, f.key.rank) for f in found] == [("detected", 17)]
    view = det.job_perf("j", t)
    assert view is not None and view.ranks == 64 and view.slowest[0].rank == 17


def test_a_ranks_devices_are_its_workers_narrowed_by_what_it_says() -> None:
    from marduk.core.stragglers import rank_devices

    worker = ["g0", "g1", "g2", "g3"]
    assert rank_devices(worker, ["g2"], None, None) == ["g2"]  # --rank-devices split
    assert rank_devices(worker, ["g9"], None, None) == worker  # not its worker's: ignored
    assert rank_devices(worker, worker, 1, 4) == ["g1"]  # torchrun's cuda:LOCAL_RANK
    assert rank_devices(worker, worker, 1, 2) == worker  # two devices a rank: can't tell
    assert rank_devices(["g0"], ["g0"], 0, 1) == ["g0"]
