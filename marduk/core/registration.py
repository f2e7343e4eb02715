"""Who may register, and what a registration says: the checks a registration passes before it
changes anything (a refused one leaves no trace), whether it comes from a fresh process, and
the events it announces. Pure; ``Policy.register`` applies them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from marduk.core.decisions import PolicyConfig, PolicyError, event_at, worker_key
from marduk.core.drmap import WorkerKey
from marduk.core.records import EpochRecord, WorkerRecord
from marduk.wire.protocol import MAX_EPOCH, ControllerEvent, Registration, same_process

# An agent may have seen epochs a lost write never recorded; it may not claim more than this
# above what was reserved (the agents' own MAX_EPOCH_JUMP is the same bound).
MAX_ADOPTED_JUMP = 10_000


def check_adoptable(seen: int, state: EpochRecord | None, epoch_block: int) -> None:
    """Refuse an epoch no controller of ours could have issued."""
    reserved = max(state.ceiling, state.epoch) if state else epoch_block
    if seen > reserved + MAX_ADOPTED_JUMP:
        # A forged or corrupted claim that would push the scope's epochs towards 2**53.
        raise PolicyError(
            "invalid",
            f"epoch {seen} is far beyond this scope's (reserved up to {reserved}); "
            "refusing to adopt it",
        )
    if seen > MAX_EPOCH - epoch_block:
        # Adopting it would leave no epoch to issue that JSON peers can read.
        raise PolicyError(
            "invalid", f"epoch {seen} is beyond what this controller could have issued"
        )


def check_duplicate(
    key: WorkerKey,
    old: WorkerRecord,
    reg: Registration,
    silent_for: float,
    stale: bool,
    config: PolicyConfig,
) -> None:
    """Refuse a second live process claiming a worker identity another live process holds.

    Two live processes never share a host and pid, so the same (host, pid) takes over
    whatever its instance (the holder is gone: a container restarted as PID 1); a higher
    incarnation is a supervisor's next trainer. A holder silent for the worker TTL (or stale)
    is presumed dead and may be replaced.
    """
    prev = old.registration
    if (prev.host, prev.pid) == (reg.host, reg.pid) or reg.incarnation > prev.incarnation:
        return
    if stale or silent_for >= config.worker_ttl_s:
        return
    raise PolicyError(
        "duplicate_worker",
        f"worker {key} is held by pid {prev.pid} on {prev.host or '?'}, which renewed "
        f"{silent_for:.0f}s ago; pid {reg.pid} on {reg.host or '?'} "
        f"may take it over once that one deregisters or is silent for "
        f"{config.worker_ttl_s:g}s",
    )


def check_scope(reg: Registration, job_workers: Iterable[WorkerRecord]) -> None:
    """All workers of a job agree on its restart scope."""
    for rec in job_workers:
        if worker_key(rec.registration) == worker_key(reg):
            continue
        if rec.registration.scope != reg.scope:
            raise PolicyError(
                "scope_conflict",
                f"job {reg.job!r} is registered with scope {rec.registration.scope!r} "
                f"(worker {worker_key(rec.registration)}); this worker asked for {reg.scope!r}",
            )
        return


def is_fresh_process(old: Registration, reg: Registration) -> bool:
    """Another process (host, pid, instance) or its supervisor's next trainer: it starts after
    every restart commanded so far."""
    return not same_process(old, reg) or old.incarnation != reg.incarnation


def registration_events(
    reg: Registration,
    result: Literal["new", "updated", "unchanged"],
    was_stale: bool,
    epoch: int,
    now: float,
) -> list[ControllerEvent]:
    """What a registration announces: a new or changed worker, or one live again."""
    if result != "unchanged":
        detail = (
            f"{reg.role} pid {reg.pid} on {reg.host or '?'}: "
            f"{len(reg.devices)} device(s), scope {reg.scope}"
        )
        new = result == "new"
        return [
            event_at(reg, "registered" if new else "reregistered", now, epoch=epoch, detail=detail)
        ]
    if was_stale:
        return [event_at(reg, "worker_live", now, detail="renewed again after being stale")]
    return []
