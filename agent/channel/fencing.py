"""Epoch fencing: which commands an agent acts on. Pure: no I/O, no clock, no asyncio.

The controller gives every restart of a scope a new, higher epoch and resends a command until
its workers confirm it (docs/decisions.md #3). An agent acts on each epoch once:

* a command above the last epoch received is **new**: act on it;
* one at that epoch at a higher revision, or naming devices not seen for it, is an **update**
  (another failure joined the restart in flight): deliver it again if it names a device not
  seen (a repeat of a failure it names is only learnt: the trainer has that command; each
  delivery of an epoch names more devices than the last), unless the epoch was already acted
  on (acked), when it changes nothing here: the ack said the revision the incarnation started
  with, and the controller restarts the scope again for a failure merged after it (a failure
  is covered by a restart only if the restart's incarnation starts after it);
* one at an epoch held without knowing its command (the process was started at it, or adopted
  it from the controller) is **known**: its devices are learnt, nothing is delivered;
* anything else is **stale** (an older epoch, a resend): dropped;
* one more than ``MAX_EPOCH_JUMP`` above the last epoch received is **implausible** unless the
  controller confirmed it (a registration reply): dropped, and the agent asks the controller.

``Fence`` holds what the rule needs (the epoch received, its devices and revision, the epoch
acked and the revision it was acked at) and returns a new one with each verdict; the library's
``CommandInbox`` keeps one, the supervisor asks ``supersedes`` before it restarts a trainer for
a command.
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
    @property
    def revision(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Fence:
    """The last epoch received, the devices of its command (empty: not known) and the highest
    revision of it seen; the last epoch acted on (acked) and the revision of its command known
    then: what the incarnation that acted on it started with."""

    received: int = 0
    devices: frozenset[str] = frozenset()
    acked: int = 0
    revision: int = 0
    acked_revision: int = 0

    @classmethod
    def started_at(cls, epoch: int) -> Fence:
        """A process started for ``epoch`` (MARDUK_EPOCH): it acts on nothing up to it."""
        return cls(received=epoch, acked=epoch)

    def is_update(self, epoch: int, devices: Iterable[str], revision: int = 0) -> bool:
        """Same epoch as the last one received, at a higher revision or naming devices not
        seen for it (a controller older than revisions sends only the devices)."""
        return epoch == self.received and (
            revision > self.revision or not set(devices) <= self.devices
        )

    def admit(
        self, epoch: int, devices: Iterable[str], revision: int = 0, *, confirmed: bool = False
    ) -> tuple[Verdict, Fence]:
        """The verdict on a command, and the fence after it. ``confirmed``: the controller's
        registration reply carried it (no jump is implausible then)."""
        seen = frozenset(devices)
        if not confirmed and epoch > self.received + MAX_EPOCH_JUMP:
            return Verdict.IMPLAUSIBLE, self
        if epoch == self.received and not self.devices:
            # We hold this epoch without knowing its devices (started at it, or adopted it from
            # a registration reply): its command is the one we already act on, not news.
            return Verdict.KNOWN, replace(self, devices=seen, revision=max(self.revision, revision))
        update = self.is_update(epoch, seen, revision)
        if epoch < self.received or (epoch == self.received and not update):
            return Verdict.STALE, self
        learnt = replace(self, devices=self.devices | seen, revision=max(self.revision, revision))
        if update and epoch <= self.acked:
            # Acted on already: the incarnation started before this failure joined, so it
            # changes nothing here; the ack said the revision it started with, and the
            # controller starts a new epoch for a failure merged after that.
            return Verdict.STALE, learnt
        if update and seen <= self.devices:
            # A repeat of a failure the command already names (only its revision moved): the
            # trainer has this command, so nothing is delivered again; the revision is learnt,
            # and the ack says it, since the incarnation has not started yet.
            return Verdict.KNOWN, learnt
        if update:
            return Verdict.UPDATE, learnt
        return Verdict.NEW, Fence(
            received=epoch,
            devices=seen,
            acked=self.acked,
            revision=revision,
            acked_revision=self.acked_revision,
        )

    def ack(self, epoch: int) -> Fence:
        """The trainer acted on ``epoch``, knowing the revision of it received so far (of an
        epoch below the one received, no revision is known: 0)."""
        if epoch <= self.acked:
            return self
        at = self.revision if epoch == self.received else 0
        return replace(self, acked=epoch, acked_revision=at)

    def adopt(self, epoch: int) -> Fence:
        """The controller (or the local agent) says the scope is at ``epoch``: commands up to
        it are not news. A higher epoch is held without knowing its command's devices."""
        if epoch <= self.received:
            return self
        return replace(self, received=epoch, devices=frozenset(), revision=0)

    def registered(
        self, epoch: int, command: Sighting | None, *, fresh: bool
    ) -> tuple[Verdict, Fence]:
        """A registration reply: the scope's ``epoch`` and the ``command`` that set it (if any).

        ``fresh``: the first registration of a process not started at an epoch; it starts
        after every restart commanded so far, so it adopts the epoch as acted on (KNOWN), at
        the command's revision. Otherwise a command it has not seen (one it missed while
        disconnected) is admitted as confirmed (NEW or UPDATE: deliver it), and else the epoch
        is adopted (KNOWN).
        """
        if fresh:
            at = max(self.acked, epoch)
            held = self.adopt(at)
            if command is not None and command.epoch == held.received:
                # Resends of that command (to workers yet to confirm) are not news to us.
                held = replace(
                    held,
                    devices=held.devices | frozenset(command.devices),
                    revision=max(held.revision, command.revision),
                )
            started = held.revision if at == held.received else 0
            return Verdict.KNOWN, replace(held, acked=at, acked_revision=started)
        if command is not None and (
            command.epoch > self.received
            or (
                bool(self.devices)
                and self.is_update(command.epoch, command.devices, command.revision)
            )
        ):
            return self.admit(command.epoch, command.devices, command.revision, confirmed=True)
        return Verdict.KNOWN, self.adopt(epoch)


def supersedes(epoch: int, running: int) -> bool:
    """A restart command at ``epoch`` stops a trainer started at epoch ``running`` only when it
    is above it: a supervisor may start the trainer at an epoch (from the controller's answer
    to its crash report) before the command that announces that epoch arrives."""
    return epoch > running
