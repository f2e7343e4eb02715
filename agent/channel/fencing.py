"""Epoch fencing: which commands an agent acts on. Pure: no I/O, no clock, no asyncio.

The controller gives every restart of a scope a new, higher epoch and resends a command until
its workers confirm it (docs/decisions.md #3). An agent acts on each epoch once:

* a command above the last epoch received is **new**: act on it;
* one at that epoch naming devices not seen for it is an **update** (another device failed
  and joined the restart in flight): deliver it again, unless the epoch was already acted on
  (acked), when it changes nothing;
* one at an epoch held without knowing its command (the process was started at it, or adopted
  it from the controller) is **known**: its devices are learnt, nothing is delivered;
* anything else is **stale** (an older epoch, a resend): dropped;
* one more than ``MAX_EPOCH_JUMP`` above the last epoch received is **implausible** unless the
  controller confirmed it (a registration reply): dropped, and the agent asks the controller.

``Fence`` holds what the rule needs (the epoch received, its devices, the epoch acked) and
returns a new one with each verdict; the library's ``CommandInbox`` keeps one, the supervisor
asks ``supersedes`` before it restarts a trainer for a command.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final, Protocol

# A command more than this many epochs above the last one received is not believed until the
# controller confirms it (a re-registration): real jumps (a restarted controller issuing above
# its reserved block) are far smaller, and a forged huge epoch would fence out every real one.
MAX_EPOCH_JUMP: Final = 10_000


class Verdict(enum.Enum):
    NEW = "new"
    UPDATE = "update"
    KNOWN = "known"
    STALE = "stale"
    IMPLAUSIBLE = "implausible"

    @property
    def delivers(self) -> bool:
        """The command goes to the trainer."""
        return self in (Verdict.NEW, Verdict.UPDATE)


class Sighting(Protocol):
    """What the rule reads of a command (``marduk.wire.protocol.Command`` has it)."""

    @property
    def epoch(self) -> int: ...
    @property
    def devices(self) -> Sequence[str]: ...


@dataclass(frozen=True, slots=True)
class Fence:
    """The last epoch received, the devices of its command (empty: not known) and the last
    epoch acted on (acked)."""

    received: int = 0
    devices: frozenset[str] = frozenset()
    acked: int = 0

    @classmethod
    def started_at(cls, epoch: int) -> Fence:
        """A process started for ``epoch`` (MARDUK_EPOCH): it acts on nothing up to it."""
        return cls(received=epoch, acked=epoch)

    def is_update(self, epoch: int, devices: Iterable[str]) -> bool:
        """Same epoch as the last one received, naming devices not seen for it."""
        return epoch == self.received and not set(devices) <= self.devices

    def admit(
        self, epoch: int, devices: Iterable[str], *, confirmed: bool = False
    ) -> tuple[Verdict, Fence]:
        """The verdict on a command, and the fence after it. ``confirmed``: the controller's
        registration reply carried it (no jump is implausible then)."""
        seen = frozenset(devices)
        if not confirmed and epoch > self.received + MAX_EPOCH_JUMP:
            return Verdict.IMPLAUSIBLE, self
        if epoch == self.received and not self.devices:
            # We hold this epoch without knowing its devices (started at it, or adopted it from
            # a registration reply): its command is the one we already act on, not news.
            return Verdict.KNOWN, replace(self, devices=seen)
        update = self.is_update(epoch, seen)
        if epoch < self.received or (epoch == self.received and not update):
            return Verdict.STALE, self
        if update and epoch <= self.acked:
            # Acted on already: more failed devices of the same restart change nothing; the
            # controller starts a new epoch for a worker on a failed device that has restarted.
            return Verdict.STALE, replace(self, devices=self.devices | seen)
        if update:
            return Verdict.UPDATE, replace(self, devices=self.devices | seen)
        return Verdict.NEW, Fence(received=epoch, devices=seen, acked=self.acked)

    def ack(self, epoch: int) -> Fence:
        """The trainer acted on ``epoch``."""
        return replace(self, acked=max(self.acked, epoch))

    def adopt(self, epoch: int) -> Fence:
        """The controller (or the local agent) says the scope is at ``epoch``: commands up to
        it are not news. A higher epoch is held without knowing its command's devices."""
        if epoch <= self.received:
            return self
        return replace(self, received=epoch, devices=frozenset())

    def registered(
        self, epoch: int, command: Sighting | None, *, fresh: bool
    ) -> tuple[Verdict, Fence]:
        """A registration reply: the scope's ``epoch`` and the ``command`` that set it (if any).

        ``fresh``: the first registration of a process not started at an epoch; it starts
        after every restart commanded so far, so it adopts the epoch as acted on (KNOWN).
        Otherwise a command it has not seen (one it missed while disconnected) is admitted as
        confirmed (NEW or UPDATE: deliver it), and else the epoch is adopted (KNOWN).
        """
        if fresh:
            at = max(self.acked, epoch)
            held = self.adopt(at)
            if command is not None and command.epoch == held.received:
                # Resends of that command (to workers yet to confirm) are not news to us.
                held = replace(held, devices=held.devices | frozenset(command.devices))
            return Verdict.KNOWN, replace(held, acked=at)
        if command is not None and (
            command.epoch > self.received
            or (bool(self.devices) and self.is_update(command.epoch, command.devices))
        ):
            return self.admit(command.epoch, command.devices, confirmed=True)
        return Verdict.KNOWN, self.adopt(epoch)


def supersedes(epoch: int, running: int) -> bool:
    """A restart command at ``epoch`` stops a trainer started at epoch ``running`` only when it
    is above it: a supervisor may start the trainer at an epoch (from the controller's answer
    to its crash report) before the command that announces that epoch arrives."""
    return epoch > running
