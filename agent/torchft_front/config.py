"""What ``marduk torchft-lighthouse`` is set with, defined once (the CLI takes its defaults
from here), and how the supervisor hands it to the front's process (JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Final

# torchft 0.2.0's Manager heartbeats every 100 ms (its ``heartbeat_interval``).
MANAGER_BEAT_S: Final = 0.1


@dataclass(frozen=True)
class FrontConfig:
    job: str
    bind: str = "[::]:29510"  # where the Managers connect (TORCHFT_LIGHTHOUSE), as torchft's
    lighthouse: str = ""  # torchft's real lighthouse, host:port (the supervisor fills it)
    addr: str = ""  # NATS
    prefix: str = "marduk"
    # The front's own timeout: a Manager silent this long leaves the healthy set (torchft's
    # --heartbeat_timeout_ms; agent.torchft.LIGHTHOUSE_FLAGS' value).
    heartbeat_timeout_s: float = 1.0
    # The real lighthouse's --heartbeat_timeout_ms: how long an incarnation Marduk dropped
    # still counts there. Over loopback, beaten every ``beat_every_s``.
    inner_timeout_s: float = 0.1
    beat_every_s: float = 0.02
    # After a start, Quorum calls wait this long (and heartbeats are not forwarded) so that
    # every live Manager is heard from first: a restarted front's table is rebuilt before the
    # lighthouse sees anyone (else it could issue a quorum of the first ones back).
    rebuild_s: float = 1.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FrontConfig:
        return cls(**json.loads(text))
