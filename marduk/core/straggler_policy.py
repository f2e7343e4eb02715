"""What the controller does about a straggler (decisions.md 19): pure, time passed in.

Detection (``marduk/core/stragglers.py``) only reports. This decides whether to act, damped:

* the policy is per controller (``--straggler-action``) and per job (``--straggler-action-job
  JOB=ACTION``): ``report`` (the default: events only), ``drain`` (take a persistent
  straggler's node out through the path ``marduk monitor drain`` uses, only when the job has a
  free spare to take its ranks), ``shrink`` (as ``drain``, and without a spare the job shrinks,
  never below MIN);
* only a job whose ranks the controller assigns (``--nnodes MIN:MAX``), with a membership in
  force and no resize under way: nothing else can hand a node's ranks to another;
* only a straggler that stayed one for ``act_after_s`` after its detection (persistent);
* at most one action per job per ``interval_s`` (the resize interval), counted from this
  controller's last action on the job and from the job's last membership change, whoever made
  it (a new leader starts from the latter: it is on the epoch record);
* one straggler per job at a time: the worst (lowest relative score).

A straggler the policy would act on but cannot (no spare, at MIN, damped, the job resizing) is
said once per straggler episode and reason (``Verdict`` with ``act`` False), not every sweep.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

from marduk.core.stragglers import RankKey

ActionMode = Literal["report", "drain", "shrink"]
ACTION_MODES: tuple[str, ...] = get_args(ActionMode)


def parse_job_actions(items: Iterable[str]) -> tuple[tuple[str, ActionMode], ...]:
    """``JOB=ACTION`` items (a comma list each, as an environment variable gives them), checked:
    a ValueError names the first bad one."""
    out: dict[str, ActionMode] = {}
    for item in items:
        for part in (p.strip() for p in item.split(",")):
            if not part:
                continue
            job, sep, mode = part.partition("=")
            job, mode = job.strip(), mode.strip()
            if not sep or not job or mode not in ACTION_MODES:
                raise ValueError(
                    f"straggler action {part!r}: expected JOB=ACTION, ACTION one of "
                    f"{', '.join(ACTION_MODES)}"
                )
            out[job] = mode  # type: ignore[assignment]  # checked just above
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class ActionConfig:
    """The policy (operations.md, *Stragglers*)."""

    mode: ActionMode = "report"
    """What to do by default: report, drain (only with a spare), shrink (drain; without a
    spare the job shrinks, never below MIN)."""
    jobs: tuple[tuple[str, ActionMode], ...] = ()
    """Per job, overriding ``mode``."""
    act_after_s: float = 30.0
    """A straggler acted on has been one for this long since its detection."""
    interval_s: float = 60.0
    """At most one action per job per this long (the controller's resize interval)."""
    _by_job: dict[str, ActionMode] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in ACTION_MODES:
            raise ValueError(f"straggler action {self.mode!r}: one of {', '.join(ACTION_MODES)}")
        if self.act_after_s < 0 or self.interval_s < 0:
            raise ValueError("straggler action times must be at least 0")
        object.__setattr__(self, "_by_job", dict(self.jobs))

    def mode_of(self, job: str) -> ActionMode:
        return self._by_job.get(job, self.mode)

    @property
    def ever_acts(self) -> bool:
        return self.mode != "report" or any(m != "report" for _, m in self.jobs)


class JobRoom(NamedTuple):
    """What a job can give up now (from its ``JobInfo``; None for a job whose ranks the
    controller does not assign)."""

    members: int  # nodes in the membership in force (0: forming or held)
    min_nodes: int
    spares: int  # free spares it may draw: its own and its pool's
    resizing: str  # a resize under way ("" when none)
    last_resize_at: float  # its last membership change (0: none known)


class Straggler(NamedTuple):
    key: RankKey
    section: str
    since: float  # when it was detected
    relative: float
    devices: tuple[str, ...]


@dataclass(frozen=True)
class Verdict:
    """Act on ``key`` (drain ``devices``: a spare takes its ranks, or the job shrinks), or
    (``act`` False) why not."""

    key: RankKey
    section: str
    act: bool
    devices: tuple[str, ...] = ()
    how: Literal["spare", "shrink", ""] = ""
    why: str = ""


class StragglerActions:
    """The damping's memory: when this controller last acted on each job, and which reasons it
    has given for which straggler episodes (so each is said once)."""

    def __init__(self, config: ActionConfig | None = None) -> None:
        self.config = config or ActionConfig()
        self._acted: dict[str, float] = {}
        self._said: set[tuple[RankKey, str, float, str]] = set()
        # Episodes acted on: the drained rank reports on until its trainer stops, and is not
        # a new case (nor a reason to say "waiting").
        self._done: set[tuple[RankKey, str, float]] = set()

    def decide(
        self,
        stragglers: Iterable[Straggler],
        rooms: Mapping[str, JobRoom | None],
        now: float,
    ) -> list[Verdict]:
        """The stragglers now, the jobs' room (every straggler's job is a key; None: not a
        ``--nnodes`` job): at most one action per job, and the reasons not yet said."""
        c = self.config
        by_job: dict[str, list[Straggler]] = {}
        live: set[tuple[RankKey, str, float]] = set()
        for s in stragglers:
            live.add((s.key, s.section, s.since))
            if c.mode_of(s.key.job) != "report" and (s.key, s.section, s.since) not in self._done:
                by_job.setdefault(s.key.job, []).append(s)
        out: list[Verdict] = []
        for job in sorted(by_job):
            ranked = sorted(by_job[job], key=lambda s: (s.relative, s.key, s.section))
            ready = [s for s in ranked if now - s.since >= c.act_after_s]
            if not ready:
                continue
            worst = ready[0]
            verdict = self._judge(worst, c.mode_of(job), rooms.get(job), now)
            if verdict.act:
                self._acted[job] = now
                # Its node is out: every section it straggles on is this episode.
                self._done |= {(x.key, x.section, x.since) for x in ranked if x.key == worst.key}
                out.append(verdict)
                continue
            said = (worst.key, worst.section, worst.since, verdict.why)
            if said not in self._said:
                self._said.add(said)
                out.append(verdict)
        # Episodes that ended are forgotten (a new detection is a new episode).
        self._said = {s for s in self._said if (s[0], s[1], s[2]) in live}
        self._done &= live
        return out

    def _judge(self, s: Straggler, mode: ActionMode, room: JobRoom | None, now: float) -> Verdict:
        def no(why: str) -> Verdict:
            return Verdict(s.key, s.section, False, s.devices, "", why)

        if room is None:
            return no("not a --nnodes job: nothing can take its ranks; reported only")
        if room.members == 0:
            return no("the job has no membership in force (forming or held); reported only")
        if room.resizing:
            return no(f"a resize of the job is under way ({room.resizing}); waiting")
        if not s.devices:
            return no("its devices are not known; reported only")
        last = max(self._acted.get(s.key.job, 0.0), room.last_resize_at)
        if last and now - last < self.config.interval_s:
            return no(
                f"at most one action per job per {self.config.interval_s:g} s (the resize "
                "interval); waiting"
            )
        if room.spares > 0:
            return Verdict(s.key, s.section, True, s.devices, "spare", "a spare takes its ranks")
        if mode != "shrink":
            return no("the job has no free spare (--straggler-action shrink would shrink it)")
        if room.members <= room.min_nodes:
            return no(f"no free spare and the job is at MIN ({room.min_nodes} nodes)")
        return Verdict(s.key, s.section, True, s.devices, "shrink", "the job shrinks without it")

    def forget_job(self, job: str) -> None:
        self._acted.pop(job, None)
