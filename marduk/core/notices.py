"""Peer notices: when replicas of a job restart or fail, the job's other replicas that asked
(``Registration.peer_notices``) are told at once, in a ``peer_failed`` command.

Pure (no I/O, ``now`` is an argument); ``marduk.core.policy`` calls it as it issues commands and
puts the notices in the ``Outcome``; the controller publishes them with the commands.

A notice is not a restart: it carries no epoch of the recipient's (``epoch`` 0) and names each
failed replica with the epoch of the command it was sent, by which agents drop a repeat. It
goes to each recipient replica's own subject, never to the job subject, so that only agents
that asked for notices receive the kind (an older agent in the same job never does), and never
to a replica that fails in the same decision (it restarts anyway). Notices are neither resent
nor acknowledged: a missed one costs what it costs without Marduk (torchft's own timeouts).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from marduk.wire.protocol import MAX_PEERS_PER_NOTICE, Command, PeerFailure

NOTICE_KIND: Final = "peer_failed"


def failed_peers(job: str, commands: Iterable[Command]) -> list[PeerFailure]:
    """The replicas of ``job`` that ``commands`` restart or fail, each at its latest epoch."""
    peers: dict[str, PeerFailure] = {}
    for c in commands:
        if c.job != job or c.replica is None or c.kind not in ("restart", "fail"):
            continue
        seen = peers.get(c.replica)
        if seen is None or c.epoch > seen.epoch:
            peers[c.replica] = PeerFailure(
                replica=c.replica, epoch=c.epoch, kind=c.kind, devices=list(c.devices)
            )
    return sorted(peers.values(), key=lambda p: p.replica)


def peer_notices(
    job: str, recipients: Iterable[str], peers: Sequence[PeerFailure], reason: str, now: float
) -> list[Command]:
    """One notice per recipient replica (several if ``peers`` is very long), none to a replica
    that is itself among ``peers``."""
    failing = {p.replica for p in peers}
    chunks = [
        list(peers[i : i + MAX_PEERS_PER_NOTICE])
        for i in range(0, len(peers), MAX_PEERS_PER_NOTICE)
    ]
    notices = []
    for replica in sorted(set(recipients) - failing):
        for chunk in chunks:
            first = chunk[0]
            notices.append(
                Command(
                    command_id=f"{NOTICE_KIND}/{replica}/{first.replica}/{first.epoch}"[:256],
                    job=job,
                    replica=replica,
                    scope="replica",
                    kind=NOTICE_KIND,
                    epoch=0,
                    reason=reason[:4096],
                    peers=chunk,
                    issued_at=now,
                )
            )
    return notices
