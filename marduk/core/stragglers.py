"""Straggler detection (decisions.md 19): pure, time passed in.

Each rank sends one ``PerfSummary`` per window (count, p50, p90, max, min per section). A rank
is compared, section by section, with the job's reference: the median p50 of the *other* ranks
that reported that section in their latest window (fresh, past their warm-up). A rank whose p50
is at least ``factor`` times the reference for ``windows`` windows in a row is a straggler on
that section (``detected``); it is back once it stays under ``clear_factor`` for
``clear_windows`` windows (``cleared``), or when it restarts or goes silent.

False alarms, and what keeps each out (docs/architecture.md, *Stragglers*):

* a restart's first steps and a compile: the first ``warmup_windows`` windows of every
  incarnation neither count nor feed the reference;
* a checkpoint or one long step: p50, not the mean or max, so one long sample in a window
  of ``min_samples`` or more does not move it; a window with fewer samples (the checkpoint took
  most of it) is no evidence either way, and a stall of the whole job moves every rank alike;
* one noisy window: ``windows`` consecutive slow windows; one normal window resets the count;
* flapping: a straggler clears only under ``clear_factor`` (between 1 and ``factor``).

Scores, NVRx's: relative = the job's best p50 / this rank's; individual = this rank's best p50
(since its incarnation began) / its current; both in 0..1, 1 is as fast as it gets.

Everything a sender can make grow is bounded: ranks tracked (``max_ranks``), sections per rank,
history per rank, the rate of summaries per rank (``min_interval_s``).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from marduk.wire.perf import MAX_SECTIONS, PerfSummary, SectionStats, SlowDevice
from marduk.wire.perf import JobPerf as JobPerfInfo
from marduk.wire.perf import SlowRank as SlowRankInfo

STEP = "step"
"""The section the library fills from ``client.step()``: the time between two steps."""


@dataclass(frozen=True)
class StragglerConfig:
    """When a rank is a straggler (operations.md, *Stragglers*)."""

    factor: float = 1.3
    """A rank this many times slower than the job's reference (p50 / median of the others)."""
    windows: int = 3
    """...for this many windows in a row is a straggler."""
    clear_factor: float = 0.0
    """Back to normal under this ratio (0: halfway between 1 and ``factor``)."""
    clear_windows: int = 3
    """...for this many windows in a row."""
    warmup_windows: int = 2
    """Windows ignored after each incarnation starts (compile, first steps, a restore)."""
    min_samples: int = 5
    """A section with fewer samples in a window is no evidence (a checkpoint took the window)."""
    min_ranks: int = 2
    """Ranks reporting a section before any is compared (this one included)."""
    stale_after_s: float = 0.0
    """A rank silent this long is forgotten (0: three of its windows, at least 10 s)."""
    min_interval_s: float = 0.5
    """Summaries of one rank closer together than this are dropped (a flood)."""
    max_ranks: int = 200_000
    """Ranks tracked at most; a summary from one more is dropped and counted."""
    history: int = 12
    """Windows of step times kept per rank (status's view)."""

    def __post_init__(self) -> None:
        if self.factor <= 1.0:
            raise ValueError(f"straggler factor must be above 1 (got {self.factor:g})")
        if self.windows < 1 or self.clear_windows < 1 or self.warmup_windows < 0:
            raise ValueError("straggler windows must be at least 1 (warm-up at least 0)")
        if self.clear_factor and not 1.0 < self.clear_factor <= self.factor:
            raise ValueError(f"straggler clear factor must be in (1, {self.factor:g}]")

    @property
    def clear_below(self) -> float:
        return self.clear_factor or 1.0 + (self.factor - 1.0) / 2.0


class RankKey(NamedTuple):
    job: str
    replica: str
    worker: int
    rank: int


@dataclass(frozen=True)
class Finding:
    """A change of straggler state: the shell turns it into an event, with the rank's devices."""

    kind: Literal["detected", "cleared"]
    key: RankKey
    section: str
    incarnation: int
    relative: float
    individual: float
    ratio: float
    p50: float
    reference: float
    windows: int
    why: str = ""


@dataclass
class _Straggling:
    since: float
    relative: float
    individual: float
    ratio: float
    ok: int = 0  # consecutive normal windows


@dataclass
class _Rank:
    incarnation: int
    window_s: float
    last_at: float
    windows: int = 0  # windows received in this incarnation
    latest: dict[str, SectionStats] = field(default_factory=dict)  # past warm-up, enough samples
    best: dict[str, float] = field(default_factory=dict)
    slow: dict[str, int] = field(default_factory=dict)
    straggling: dict[str, _Straggling] = field(default_factory=dict)
    steps: deque[tuple[float, int, float]] = field(default_factory=deque)  # (at, count, p50)


EXACT_RANKS = 32
"""Up to this many ranks in a job, each is compared with the median of exactly the others."""
REFERENCE_REFRESH_S = 1.0
"""In a larger job, how often the job's reference on a section is computed again."""


class _Reference(NamedTuple):
    at: float
    median: float
    best: float
    ranks: int


def implausible(s: PerfSummary) -> str | None:
    """Why a summary that decoded cannot be true (a worker that lies), or None."""
    names: set[str] = set()
    for sec in s.sections:
        if sec.name in names:
            return f"section {sec.name!r} twice"
        names.add(sec.name)
        if not sec.min <= sec.p50 <= sec.p90 <= sec.max:
            return f"section {sec.name!r}: not min <= p50 <= p90 <= max"
        if sec.count == 0 and sec.max > 0:
            return f"section {sec.name!r}: times without samples"
        # One section's samples cannot add up to much more than the window (twice: a section
        # open across the window's edge, or timed on two threads).
        if sec.count * sec.min > 2.0 * s.window_s + 1.0:
            return f"section {sec.name!r}: {sec.count} samples of {sec.min:g}s in {s.window_s:g}s"
    return None


class Observed(NamedTuple):
    findings: list[Finding]
    dropped: str | None = None  # why the summary was not used (a counter's label)


class StragglerDetector:
    """The ranks' latest windows, the job's reference, who is a straggler on which section."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._ranks: dict[RankKey, _Rank] = {}
        self._jobs: dict[str, set[RankKey]] = {}
        self._refs: dict[tuple[str, str], _Reference] = {}  # large jobs' (job, section)

    def __len__(self) -> int:
        return len(self._ranks)

    # --- input -----------------------------------------------------------------------------------

    def observe(self, s: PerfSummary, now: float) -> Observed:
        """One rank's window, received at ``now``: what changed (stragglers detected or
        cleared), or why it was dropped."""
        c = self.config
        why = implausible(s)
        if why is not None:
            return Observed([], "implausible")
        key = RankKey(s.job, s.replica, s.worker, s.rank)
        st = self._ranks.get(key)
        findings: list[Finding] = []
        if st is not None and s.incarnation < st.incarnation:
            return Observed([], "stale_incarnation")  # late, or a sender that lies
        if (
            st is not None
            and st.incarnation == s.incarnation
            and now - st.last_at < c.min_interval_s
        ):
            return Observed([], "rate")
        if st is None or st.incarnation != s.incarnation:
            if st is None and len(self._ranks) >= c.max_ranks:
                return Observed([], "too_many_ranks")
            if st is not None:
                findings += self._clear_all(key, st, "restarted (new incarnation)")
            st = _Rank(incarnation=s.incarnation, window_s=s.window_s, last_at=now)
            self._ranks[key] = st
            self._jobs.setdefault(key.job, set()).add(key)
        st.windows += 1
        st.last_at, st.window_s = now, s.window_s
        if st.windows <= c.warmup_windows:
            st.latest = {}
            return Observed(findings)
        st.latest = {sec.name: sec for sec in s.sections if sec.count >= c.min_samples}
        step = st.latest.get(STEP)
        if step is not None:
            st.steps.append((now, step.count, step.p50))
            while len(st.steps) > c.history:
                st.steps.popleft()
        for name, sec in st.latest.items():
            found = self._judge(key, st, name, sec, now)
            if found is not None:
                findings.append(found)
        self._prune(st)
        return Observed(findings)

    def sweep(self, now: float) -> list[Finding]:
        """Forget the ranks silent for longer than their staleness (a straggler that went
        silent is cleared: nothing says it is slow now)."""
        findings: list[Finding] = []
        for key, st in list(self._ranks.items()):
            if now - st.last_at > self._stale_after(st):
                findings += self._clear_all(key, st, "no longer reporting")
                self._forget(key)
        return findings

    def forget_job(self, job: str) -> None:
        for key in list(self._jobs.get(job, ())):
            self._forget(key)

    # --- the rule --------------------------------------------------------------------------------

    def _judge(
        self, key: RankKey, st: _Rank, name: str, sec: SectionStats, now: float
    ) -> Finding | None:
        c = self.config
        ref = self._reference(key, name, now)
        if ref is None or ref.ranks + 1 < c.min_ranks:
            return None  # nothing to compare with: no evidence either way
        reference = ref.median
        best_now = min(ref.best, sec.p50)
        best_own = min(st.best.get(name, sec.p50), sec.p50)
        st.best[name] = best_own
        p50 = sec.p50
        ratio = p50 / reference if reference > 0 else (1.0 if p50 == 0 else c.factor)
        relative = min(1.0, best_now / p50) if p50 > 0 else 1.0
        individual = min(1.0, best_own / p50) if p50 > 0 else 1.0

        def finding(kind: Literal["detected", "cleared"], windows: int, why: str) -> Finding:
            return Finding(
                kind,
                key,
                name,
                st.incarnation,
                relative,
                individual,
                ratio,
                p50,
                reference,
                windows,
                why,
            )

        strag = st.straggling.get(name)
        if strag is None:
            if ratio >= c.factor:
                st.slow[name] = st.slow.get(name, 0) + 1
            else:
                st.slow.pop(name, None)
            n = st.slow.get(name, 0)
            if n >= c.windows:
                st.slow.pop(name, None)
                st.straggling[name] = _Straggling(now, relative, individual, ratio)
                return finding(
                    "detected", n, f"{ratio:.2f}x the job's median for {n} windows in a row"
                )
            return None
        strag.relative, strag.individual, strag.ratio = relative, individual, ratio
        strag.ok = strag.ok + 1 if ratio < c.clear_below else 0
        if strag.ok >= c.clear_windows:
            del st.straggling[name]
            return finding(
                "cleared", strag.ok, f"under {c.clear_below:.2f}x for {strag.ok} windows"
            )
        return None

    def _reference(self, key: RankKey, name: str, now: float) -> _Reference | None:
        """The job's reference on a section for ``key``: exact (the other ranks) in a small
        job; in a large one the whole job's, computed at most once per ``REFERENCE_REFRESH_S``
        (one rank moves the median of more than ``EXACT_RANKS`` by at most one place), so a
        window of N ranks costs N log N, not N squared."""
        keys = self._jobs.get(key.job, set())
        if len(keys) <= EXACT_RANKS:
            return self._compute_reference(keys, name, now, exclude=key)
        cached = self._refs.get((key.job, name))
        if cached is None or now - cached.at >= REFERENCE_REFRESH_S or now < cached.at:
            cached = self._compute_reference(keys, name, now, exclude=None)
            if cached is None:
                self._refs.pop((key.job, name), None)
                return None
            self._refs[(key.job, name)] = cached
        return cached

    def _compute_reference(
        self, keys: Iterable[RankKey], name: str, now: float, exclude: RankKey | None
    ) -> _Reference | None:
        p50s: list[float] = []
        for other in keys:
            if other == exclude:
                continue
            st = self._ranks[other]
            sec = st.latest.get(name)
            if sec is not None and now - st.last_at <= self._stale_after(st):
                p50s.append(sec.p50)
        if not p50s:
            return None
        return _Reference(now, statistics.median(p50s), min(p50s), len(p50s))

    def _stale_after(self, st: _Rank) -> float:
        return self.config.stale_after_s or max(10.0, 3.0 * st.window_s)

    def _clear_all(self, key: RankKey, st: _Rank, why: str) -> list[Finding]:
        out = [
            Finding(
                "cleared",
                key,
                name,
                st.incarnation,
                g.relative,
                g.individual,
                g.ratio,
                0.0,
                0.0,
                0,
                why,
            )
            for name, g in sorted(st.straggling.items())
        ]
        st.straggling.clear()
        return out

    def _prune(self, st: _Rank) -> None:
        # A sender that renames its sections every window must not grow our state.
        keep = set(st.latest) | set(st.straggling)
        for d in (st.best, st.slow):
            if len(d) > 2 * MAX_SECTIONS:
                for name in [n for n in d if n not in keep]:
                    del d[name]

    def _forget(self, key: RankKey) -> None:
        self._ranks.pop(key, None)
        keys = self._jobs.get(key.job)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._jobs[key.job]
                for ref in [r for r in self._refs if r[0] == key.job]:
                    del self._refs[ref]

    # --- views -----------------------------------------------------------------------------------

    def stragglers(self, job: str | None = None) -> list[tuple[RankKey, str, _Straggling]]:
        """(rank, section, its scores) of every current straggler."""
        out: list[tuple[RankKey, str, _Straggling]] = []
        keys = self._ranks if job is None else self._jobs.get(job, set())
        for key in sorted(keys):
            st = self._ranks[key]
            for name, g in sorted(st.straggling.items()):
                out.append((key, name, g))
        return out

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def tracked(self, key: RankKey) -> bool:
        return key in self._ranks

    def rank_keys(self, job: str) -> list[RankKey]:
        return sorted(self._jobs.get(job, ()))

    def job_perf(
        self, job: str, now: float, devices: dict[RankKey, list[str]] | None = None, top: int = 3
    ) -> JobPerfInfo | None:
        """A job's step rate and step time (the median rank's), its slowest ranks and its
        stragglers, from each fresh rank's latest window."""
        keys = [
            k
            for k in self._jobs.get(job, ())
            if now - self._ranks[k].last_at <= self._stale_after(self._ranks[k])
        ]
        if not keys:
            return None
        devices = devices or {}
        rates: list[float] = []
        p50s: list[float] = []
        p90s: list[float] = []
        for k in keys:
            st = self._ranks[k]
            step = st.latest.get(STEP)
            if step is not None:
                rates.append(step.count / st.window_s)
                p50s.append(step.p50)
                p90s.append(step.p90)
        slow: list[SlowRankInfo] = []
        for k in keys:
            st = self._ranks[k]
            for name, sec in st.latest.items():
                ref = self._reference(k, name, now)
                if ref is None or sec.p50 <= 0 or ref.median <= 0:
                    continue
                best = min(ref.best, sec.p50)
                g = st.straggling.get(name)
                slow.append(
                    SlowRankInfo(
                        replica=k.replica,
                        worker=k.worker,
                        rank=k.rank,
                        section=name,
                        relative=round(min(1.0, best / sec.p50), 3),
                        individual=round(min(1.0, st.best.get(name, sec.p50) / sec.p50), 3),
                        ratio=round(sec.p50 / ref.median, 3),
                        devices=devices.get(k, []),
                        since=g.since if g is not None else 0.0,
                    )
                )
        slow.sort(key=lambda r: (r.since == 0.0, r.relative))
        stragglers = [r for r in slow if r.since > 0]
        seen: set[tuple[str, int, int]] = set()
        slowest: list[SlowRankInfo] = []
        for r in slow:  # one row per rank: its worst section
            if (r.replica, r.worker, r.rank) not in seen and len(slowest) < top:
                seen.add((r.replica, r.worker, r.rank))
                slowest.append(r)
        return JobPerfInfo(
            job=job,
            ranks=len(keys),
            steps_per_s=round(statistics.median(rates), 3) if rates else 0.0,
            step_p50=statistics.median(p50s) if p50s else 0.0,
            step_p90=statistics.median(p90s) if p90s else 0.0,
            slowest=slowest,
            stragglers=stragglers,
        )


def rank_devices(
    registered: list[str],
    said: list[str],
    local_rank: int | None,
    local_world_size: int | None,
) -> list[str]:
    """The devices of a rank, from its worker's registered devices (in their order): those the
    rank says it has, if they are a proper part of the worker's (``--rank-devices split``);
    else, with one device per local rank (torchrun's ``cuda:LOCAL_RANK``), its LOCAL_RANK's;
    else all of the worker's. Never a device the worker did not register."""
    mine = [d for d in registered if d in set(said)]
    if mine and len(mine) < len(registered):
        return mine
    if (
        local_rank is not None
        and local_world_size is not None
        and local_world_size == len(registered) > 1
        and local_rank < local_world_size
    ):
        return [registered[local_rank]]
    return list(registered)


# --- devices' records --------------------------------------------------------------------------

MAX_JOBS_PER_DEVICE = 8
"""The runs a device's record names (its latest); its ``detections`` counts them all."""


def note_slow(
    record: SlowDevice | None,
    device: str,
    finding: Finding,
    now: float,
) -> SlowDevice:
    """A device's record after a ``detected`` finding on a rank that uses it: counted, the run
    (job/replica#incarnation) named once, the worst relative score kept."""
    k = finding.key
    run = f"{k.job}/{k.replica}#{finding.incarnation}"
    jobs = [] if record is None else [j for j in record.jobs if j != run]
    jobs = [*jobs, run][-MAX_JOBS_PER_DEVICE:]
    return SlowDevice(
        device=device,
        detections=(0 if record is None else record.detections) + 1,
        jobs=jobs,
        last_at=now,
        worst_relative=min(finding.relative, 1.0 if record is None else record.worst_relative),
    )


def repeat_offenders(records: Iterable[SlowDevice]) -> list[SlowDevice]:
    """Devices slow in more than one job or incarnation, the worst first."""
    return sorted(
        (r for r in records if len(r.jobs) > 1),
        key=lambda r: (r.worst_relative, -r.detections, r.device),
    )
