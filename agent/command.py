"""A command as the trainer sees it (``agent.Command``), converted at the edge from the wire's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from marduk import protocol as wire


@dataclass(frozen=True, slots=True)
class Command:
    """A command for this replica, as the trainer sees it."""

    kind: Literal["restart", "fail", "stop", "checkpoint"]
    epoch: int
    reason: str
    devices: tuple[str, ...]
    job: str
    replica: str | None  # None: sent to every replica of the job (scope "job")
    scope: Literal["replica", "job"]
    command_id: str
    issued_at: float
    received_at: float = field(compare=False)

    @property
    def is_failure(self) -> bool:
        return self.kind in ("restart", "fail")

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
        )


OnCommand = Callable[[Command], Any]
