"""A command as the trainer sees it (``agent.Command``), converted at the edge from the wire's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from marduk.wire import protocol as wire


@dataclass(frozen=True, slots=True)
class PeerFailure:
    """Another replica of the job that restarts or fails (a ``peer_failed`` notice names it)."""

    replica: str
    epoch: int  # the epoch of the command that replica was sent (not ours)
    kind: Literal["restart", "fail"]
    devices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Command:
    """A command for this replica, as the trainer sees it.

    ``peer_failed`` is a notice, not a command to act on: other replicas of the job (``peers``)
    restart or fail, so a collective step with them will not complete; keep training (a torchft
    group abandons the step in flight and goes on to the next quorum). Only a client that asked
    (``connect(peer_notices=True)``) gets it; its ``epoch`` is 0 and it sets no ``failed``.
    """

    kind: Literal["restart", "fail", "stop", "checkpoint", "peer_failed"]
    epoch: int
    reason: str
    devices: tuple[str, ...]
    job: str
    replica: str | None  # None: sent to every replica of the job (scope "job")
    scope: Literal["replica", "job"]
    command_id: str
    issued_at: float
    received_at: float = field(compare=False)
    peers: tuple[PeerFailure, ...] = ()

    @property
    def is_failure(self) -> bool:
        return self.kind in ("restart", "fail")

    @property
    def is_notice(self) -> bool:
        """Other replicas fail (``peer_failed``); nothing to restart here."""
        return self.kind == "peer_failed"

    def to_wire(self) -> wire.Command:
        return wire.Command(
            command_id=self.command_id,
            job=self.job,
            replica=self.replica,
            scope=self.scope,
            kind=self.kind,
            epoch=self.epoch,
            reason=self.reason,
            devices=list(self.devices),
            issued_at=self.issued_at,
            peers=[
                wire.PeerFailure(
                    replica=p.replica, epoch=p.epoch, kind=p.kind, devices=list(p.devices)
                )
                for p in self.peers
            ],
        )

    @classmethod
    def from_wire(cls, c: wire.Command, received_at: float) -> Command:
        return cls(
            kind=c.kind,
            epoch=c.epoch,
            reason=c.reason,
            devices=tuple(c.devices),
            job=c.job,
            replica=c.replica,
            scope=c.scope,
            command_id=c.command_id,
            issued_at=c.issued_at,
            received_at=received_at,
            peers=tuple(PeerFailure(p.replica, p.epoch, p.kind, tuple(p.devices)) for p in c.peers),
        )


OnCommand = Callable[[Command], Any]
