"""The shared asyncio toolkit (marduk/aio): backoff, rate-limited log, tasks, addresses."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from marduk.aio import (
    Backoff,
    Pulse,
    RateLimitedLog,
    TaskSet,
    parse_host_port,
    restart_forever,
    wait_any,
)
from marduk.errors import MardukError
from tests.conftest import eventually

# --- Backoff -------------------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_cap_and_stays_there() -> None:
    b = Backoff(initial=0.05, cap=0.5)
    assert [b.next() for _ in range(6)] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5, 0.5])


def test_backoff_starts_over_after_reset() -> None:
    b = Backoff(initial=1.0, cap=60.0)
    b.next(), b.next(), b.next()
    assert b.delay == 8.0
    b.reset()
    assert b.delay == 1.0 and b.next() == 1.0 and b.delay == 2.0


def test_backoff_delay_is_the_next_pause_before_jitter() -> None:
    b = Backoff(initial=0.5, cap=10.0)
    assert b.delay == 0.5
    assert b.next() == 0.5
    assert b.delay == 1.0


def test_backoff_with_a_factor_other_than_two() -> None:
    b = Backoff(initial=1.0, cap=10.0, factor=3.0)
    assert [b.next() for _ in range(4)] == [1.0, 3.0, 9.0, 10.0]


def test_backoff_jitter_scales_each_pause_but_not_the_growth() -> None:
    asked: list[tuple[float, float]] = []

    def uniform(lo: float, hi: float) -> float:
        asked.append((lo, hi))
        return hi

    b = Backoff(initial=1.0, cap=30.0, jitter=0.2, uniform=uniform)
    assert [b.next() for _ in range(3)] == pytest.approx([1.2, 2.4, 4.8])
    assert asked == [pytest.approx((0.8, 1.2))] * 3
    assert b.delay == 8.0


def test_backoff_without_jitter_draws_nothing() -> None:
    def uniform(lo: float, hi: float) -> float:
        raise AssertionError("drew a random number")

    assert Backoff(initial=1.0, cap=2.0, uniform=uniform).next() == 1.0


def test_backoff_whose_initial_pause_is_over_its_cap_falls_to_the_cap() -> None:
    b = Backoff(initial=5.0, cap=2.0)
    assert [b.next(), b.next()] == [5.0, 2.0]


@pytest.mark.parametrize(
    "kw",
    [
        {"initial": -1.0, "cap": 1.0},
        {"initial": 1.0, "cap": 1.0, "factor": 0.5},
        {"initial": 1.0, "cap": 1.0, "jitter": 1.0},
    ],
)
def test_backoff_refuses_nonsense(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kw)


# --- RateLimitedLog ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0 * 60

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_rate_limited_log_says_the_first_few_then_one_note(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("t"), clock=clock)
    with caplog.at_level(logging.INFO, logger="t"):
        logged = [limited.log("bad", logging.WARNING, "bad %d", i) for i in range(9)]
    assert logged == [True] * 5 + [False] * 4
    assert lines(caplog) == [*(f"bad {i}" for i in range(5)), "(more bad this minute are "
                             "counted, not logged)"]  # fmt: skip
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_rate_limited_log_counts_each_key_apart(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(logging.getLogger("t"), burst=1, more=None, clock=Clock())
    with caplog.at_level(logging.INFO, logger="t"):
        for key in ("a", "b", "a", "b"):
            limited.log(key, logging.ERROR, "%s", key)
    assert lines(caplog) == ["a", "b"]


def test_rate_limited_log_starts_over_in_the_next_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("t"), burst=2, more="(more)", clock=clock)
    with caplog.at_level(logging.INFO, logger="t"):
        for _ in range(4):
            limited.log("k", logging.INFO, "x")
        clock.now += 59.9  # same minute as 1000*60: windows are aligned on the clock
        limited.log("k", logging.INFO, "x")
        clock.now += 0.1
        limited.log("k", logging.INFO, "y")
    assert lines(caplog) == ["x", "x", "(more)", "y"]


def test_rate_limited_log_forgets_keys_past_its_limit() -> None:
    limited = RateLimitedLog(logging.getLogger("t"), burst=1, clock=Clock(), max_keys=3)
    assert [limited.seen(k) for k in ("a", "a", "b", "c")] == [1, 2, 1, 1]
    assert limited.seen("a") == 1  # a fourth key would not fit: the window's counts start over


def test_rate_limited_log_passes_exc_info_on(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(logging.getLogger("t"), burst=1, clock=Clock())
    error = RuntimeError("boom")
    with caplog.at_level(logging.INFO, logger="t"):
        limited.log("k", logging.ERROR, "failed", exc_info=error)
    assert caplog.records[0].exc_info is not None and caplog.records[0].exc_info[1] is error


# --- parse_host_port -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("127.0.0.1:9095", ("127.0.0.1", 9095)),
        (":9090", ("0.0.0.0", 9090)),
        ("[::1]:0", ("::1", 0)),
        ("localhost:65535", ("localhost", 65535)),
    ],
)
def test_parse_host_port(text: str, want: tuple[str, int]) -> None:
    assert parse_host_port(text, option="--listen", example="0.0.0.0:9095") == want


def test_parse_host_port_takes_a_bare_port_only_when_asked() -> None:
    assert parse_host_port("9090", option="--x", example="e", bare_port=True) == ("0.0.0.0", 9090)
    with pytest.raises(MardukError, match=r"--listen '9095': expected HOST:PORT, e.g. 0.0.0.0:9"):
        parse_host_port("9095", option="--listen", example="0.0.0.0:9095")


@pytest.mark.parametrize("text", ["host:", "host:http", "host:65536", "host:-1", "", "a:b:c"])
def test_parse_host_port_refuses_what_is_not_an_address(text: str) -> None:
    with pytest.raises(MardukError, match="--metrics-addr"):
        parse_host_port(text, option="--metrics-addr", example="0.0.0.0:9090", bare_port=True)


# --- TaskSet and restart_forever -----------------------------------------------------------------


async def test_a_task_that_raises_goes_to_on_error_with_its_name() -> None:
    seen: list[tuple[str, str]] = []
    tasks = TaskSet(lambda t, e: seen.append((t.get_name(), str(e))), prefix="p-")

    async def broken() -> None:
        raise RuntimeError("boom")

    task = tasks.spawn(broken(), "renew")
    await asyncio.wait([task])
    await asyncio.sleep(0)
    assert seen == [("p-renew", "boom")] and len(tasks) == 0


async def test_a_task_that_returns_goes_to_on_return_and_a_cancelled_one_nowhere() -> None:
    returned: list[str] = []
    tasks = TaskSet(lambda t, e: pytest.fail(f"on_error {e}"), on_return=lambda t: returned.append(t.get_name()))  # fmt: skip

    async def done() -> None:
        return None

    tasks.spawn(done(), "once")
    forever = tasks.spawn(asyncio.Event().wait(), "forever")
    await asyncio.sleep(0.01)
    forever.cancel()
    await asyncio.sleep(0.01)
    assert returned == ["once"] and len(tasks) == 0


async def stubborn(release: asyncio.Event) -> None:
    """Runs until ``release``, swallowing every cancellation meanwhile."""
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            continue


async def test_stop_cancels_and_names_the_tasks_that_would_not_stop() -> None:
    tasks = TaskSet(lambda t, e: None)
    release = asyncio.Event()
    tasks.spawn(asyncio.Event().wait(), "polite")
    tasks.spawn(stubborn(release), "stubborn")
    await asyncio.sleep(0)
    assert await tasks.stop(grace_s=0.05) == ["stubborn"]
    release.set()
    await asyncio.sleep(0.01)
    assert len(tasks) == 0


async def test_drain_lets_tasks_finish_within_the_grace_then_cancels_the_rest() -> None:
    tasks = TaskSet(lambda t, e: None)
    finished: list[str] = []

    async def quick() -> None:
        await asyncio.sleep(0.01)
        finished.append("quick")

    slow = tasks.spawn(asyncio.Event().wait(), "slow")
    tasks.spawn(quick(), "quick")
    assert await tasks.drain(grace_s=0.2) == ["slow"]  # stuck: named
    assert finished == ["quick"]  # not cancelled: it had the time it needed
    assert slow.cancelled() and len(tasks) == 0


async def test_drain_waits_only_cancel_s_for_a_task_that_ignores_its_cancellation() -> None:
    tasks = TaskSet(lambda t, e: None)
    release = asyncio.Event()
    task = tasks.spawn(stubborn(release), "stubborn")
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert await tasks.drain(grace_s=0.05, cancel_s=0.05) == ["stubborn"]
    assert loop.time() - began < 1.0 and not task.done()
    release.set()
    await asyncio.sleep(0.01)
    assert len(tasks) == 0


async def test_restart_forever_restarts_with_backoff_until_cancelled() -> None:
    ends: list[tuple[str, float]] = []
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs % 2:
            raise RuntimeError(f"run {runs}")

    def on_stop(error: BaseException | None, pause: float) -> None:
        ends.append((str(error) if error else "returned", pause))

    task = asyncio.create_task(restart_forever(flaky, Backoff(0.001, 0.004), on_stop))
    await eventually(lambda: len(ends) >= 4, interval=0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ends[:4] == [("run 1", 0.001), ("returned", 0.002), ("run 3", 0.004), ("returned", 0.004)]  # fmt: skip


async def test_restart_forever_starts_the_backoff_over_after_a_long_healthy_run() -> None:
    pauses: list[float] = []
    backoff = Backoff(0.001, 1.0)
    backoff.next(), backoff.next()

    async def quick() -> None:
        await asyncio.sleep(0.002)

    task = asyncio.create_task(
        restart_forever(quick, backoff, lambda e, p: pauses.append(p), healthy_after_s=0.001)
    )
    await eventually(lambda: len(pauses) >= 2, interval=0.001)
    task.cancel()
    assert pauses[:2] == [0.001, 0.001]


async def test_wait_any_returns_at_the_first_beat_after_the_call() -> None:
    a, b = Pulse(), Pulse()
    a.notify()  # before the call: not waited for
    waiter = asyncio.create_task(wait_any([a, b], None))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    b.notify()
    await asyncio.wait_for(waiter, 1.0)


async def test_wait_any_ends_at_its_timeout_without_a_beat() -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await wait_any([Pulse()], 0.05)
    assert 0.04 <= loop.time() - t0 < 1.0


async def test_a_pulse_wakes_every_waiter() -> None:
    p = Pulse()
    waiters = [asyncio.create_task(p.wait(p.count)) for _ in range(3)]
    await asyncio.sleep(0)
    p.notify()
    await asyncio.wait_for(asyncio.gather(*waiters), 1.0)
