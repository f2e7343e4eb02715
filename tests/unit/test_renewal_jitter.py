"""The library's renewals are jittered: a fleet whose workers registered together does not
renew together (1,000 clients renewing in the same instant every interval is a burst the
controller and the server take on top of whatever else they are doing)."""

from __future__ import annotations

import asyncio
import random

import pytest

from agent.library import nats_client
from agent.library.client import AsyncClient, Options


def client(rand: object) -> AsyncClient:
    opts = Options(
        job="j", replica="r1", worker=0, devices=["a"], addr="", prefix="marduk",
        scope="replica", timeout=1, incarnation=0, epoch=0, resync_interval=5.0,
    )  # fmt: skip
    return AsyncClient(opts, rand=rand)  # type: ignore[arg-type]


async def renewal_delays(c: AsyncClient, n: int, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The first ``n`` sleeps of the client's own renewal loop (not connected: nothing sent)."""
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        if len(delays) == n:
            raise asyncio.CancelledError

    monkeypatch.setattr(nats_client.asyncio, "sleep", sleep)
    with pytest.raises(asyncio.CancelledError):
        await c._resync_loop()
    return delays


async def test_the_renewal_loop_draws_each_delay_from_the_random_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    draws = iter([0.0, 0.0, 0.999999, 0.5])
    c = client(lambda: next(draws))
    delays = await renewal_delays(c, 4, monkeypatch)
    # First: anywhere in 0.2-1.2 intervals; then the interval +-20%.
    assert delays == pytest.approx([1.0, 4.0, 6.0, 5.0], abs=1e-4)


async def test_a_fleet_started_together_renews_spread_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 200 clients registered in the same instant: when does each renew, over 10 intervals?
    # Without jitter every one of them renews at 5, 10, 15 ... s: 200 at once, every time.
    rng = random.Random(15)
    fleet = [client(rng.random) for _ in range(200)]
    times = []
    for c in fleet:
        delays = await renewal_delays(c, 10, monkeypatch)
        assert all(0.2 * 5.0 <= d <= 1.2 * 5.0 for d in delays)  # never near the worker TTL
        times.append([sum(delays[: i + 1]) for i in range(len(delays))])
    for k in (0, 9):  # the first renewal, and the tenth
        # In any 100 ms window, few of the fleet renew (all 200 would without jitter).
        at = sorted(t[k] for t in times)
        busiest = max(sum(1 for u in at if s <= u < s + 0.1) for s in at)
        assert busiest <= 20, (k, busiest)


def test_renewal_delay_bounds() -> None:
    assert nats_client.renewal_delay(5.0, True, lambda: 0.0) == pytest.approx(1.0)
    assert nats_client.renewal_delay(5.0, False, lambda: 0.5) == pytest.approx(5.0)
    for r in (0.0, 0.3, 0.999999):
        assert 4.0 <= nats_client.renewal_delay(5.0, False, lambda r=r: r) <= 6.0
