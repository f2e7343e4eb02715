"""agent.torchft's Guard against a quorum answered with a group told failed (issue 19): the
lighthouse can issue a quorum with a group just before that group dies, and the notice reach a
healthy group while its quorum call is in flight. That answer must not be configured (the
configure would wait for the dead group's store key until its timeout): the Guard reports the
error and its process group refuses that quorum id. Fakes stand in for torchft's Manager, its
quorum client and process group; ``quorum_step`` replays what torchft 0.2.0's
``Manager._async_quorum`` does with them (the real one: tests/integration/test_torchft_guard.py).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest

from agent.library.command import Command, PeerFailure
from agent.torchft import Guard, PeerFailedError, _watch_quorums


class _Future:
    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


class _Pg:
    def __init__(self) -> None:
        self.configured: list[int] = []
        self.aborts = 0

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int, *rest: object) -> None:  # fmt: skip
        self.configured.append(quorum_id)

    def abort(self) -> None:
        self.aborts += 1


class _Client:
    """The quorum client: answers ``answers`` in turn; ``during`` runs while a call is in
    flight (a notice coming then)."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, list[str]]] = []
        self.during: Callable[[], None] = lambda: None

    def _quorum(self, **kwargs: object) -> object:
        self.during()
        self.during = lambda: None
        quorum_id, ids = self.answers.pop(0)
        return types.SimpleNamespace(quorum_id=quorum_id, replica_ids=ids)


class _Manager:
    def __init__(self) -> None:
        self._client: object = _Client()
        self._pg = _Pg()
        self._quorum_future: _Future | None = None
        self._quorum_id = -1
        self.errors: list[Exception] = []

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)

    def current_step(self) -> int:
        return 5


def quorum_step(m: _Manager) -> None:
    """torchft 0.2.0's ``start_quorum`` + ``_async_quorum`` as far as the Guard meets them:
    the error is cleared, the quorum asked for, and the process group configured when the
    quorum id changed; a configure that raises is reported and ends the quorum step."""
    m.errors.clear()
    m._quorum_future = future = _Future()
    q = m._client._quorum(group_rank=0, step=5)  # type: ignore[attr-defined]
    if q.quorum_id != m._quorum_id:
        m._quorum_id = q.quorum_id
        try:
            m._pg.configure("store/torchft/q/0", "g1", 0, len(q.replica_ids), q.quorum_id, 0, 1)
        except Exception as e:
            m.report_error(e)
    future.finished = True


def notice(*replicas: str) -> Command:
    return Command(
        kind="peer_failed",
        epoch=0,
        reason="",
        devices=(),
        job="j",
        replica="g1",
        scope="replica",
        command_id="n",
        issued_at=0.0,
        received_at=0.0,
        peers=tuple(PeerFailure(r, 1, "restart") for r in replicas),
    )


@pytest.fixture
def setup() -> tuple[_Manager, _Client, Guard]:
    m = _Manager()
    client = m._client
    assert isinstance(client, _Client)
    guard = Guard(m, m._pg)
    _watch_quorums(m, guard)
    client.answers.append((1, ["g1:a", "g2:b", "g3:c"]))
    quorum_step(m)
    assert m._pg.configured == [1]
    return m, client, guard


def test_an_answer_with_a_group_told_failed_while_asking_is_not_configured(
    setup: tuple[_Manager, _Client, Guard],
) -> None:
    """The race of issue 19: the quorum was issued with g3 just before g3 died; the notice
    came while the call was in flight. That quorum is refused (the error reported, the
    process group not configured), and the next one, without g3, is configured."""
    m, client, guard = setup
    client.answers += [(2, ["g1:a", "g2:b", "g3:c", "g4:d"]), (3, ["g1:a", "g2:b", "g4:d"])]
    client.during = lambda: guard.on_command(notice("g3"))
    quorum_step(m)
    assert m._pg.configured == [1]  # not 2
    assert [type(e) for e in m.errors] == [PeerFailedError, PeerFailedError]  # ours, torchft's
    assert "g3:c" in str(m.errors[0])
    assert (guard.refused, guard.abandoned, m._pg.aborts) == (1, 1, 0)
    quorum_step(m)
    assert m._pg.configured == [1, 3]
    assert m.errors == []


def test_a_restarted_groups_new_incarnation_is_not_refused(
    setup: tuple[_Manager, _Client, Guard],
) -> None:
    """Only the incarnation in our last quorum is told failed (torchft ids are name:uuid,
    fresh per incarnation): the same group back under a new uuid is configured."""
    m, client, guard = setup
    client.answers += [(2, ["g1:a", "g2:b", "g3:NEW"])]
    client.during = lambda: guard.on_command(notice("g3"))
    quorum_step(m)
    assert m._pg.configured == [1, 2]
    assert (m.errors, guard.refused, guard.abandoned) == ([], 0, 0)


def test_a_notice_for_a_group_not_in_the_last_quorum_changes_nothing(
    setup: tuple[_Manager, _Client, Guard],
) -> None:
    """g4 was not in our last quorum: its torchft id is unknown, nothing is abandoned, and a
    quorum with a g4 in it is configured."""
    m, client, guard = setup
    guard.on_command(notice("g4"))  # stepping
    client.answers += [(2, ["g1:a", "g4:x"])]
    client.during = lambda: guard.on_command(notice("g4"))  # asking
    quorum_step(m)
    assert m._pg.configured == [1, 2]
    assert (m.errors, guard.refused, guard.abandoned, m._pg.aborts) == ([], 0, 0, 0)


def test_a_group_left_out_of_our_last_quorum_is_refused_in_the_next(
    setup: tuple[_Manager, _Client, Guard],
) -> None:
    """g3 was left out of our last quorum (healing, or late to ask: quorums rotate with a
    short join timeout) and the lighthouse issues the next one with it just before it dies:
    nothing to abandon, but the incarnation we last saw is refused in that answer; a new
    incarnation is not."""
    m, client, guard = setup
    client.answers += [(2, ["g1:a", "g2:b"]), (3, ["g1:a", "g2:b", "g3:c"])]
    quorum_step(m)
    client.during = lambda: guard.on_command(notice("g3"))
    quorum_step(m)
    assert (m._pg.configured, guard.refused, guard.abandoned) == ([1, 2], 1, 1)
    client.answers += [(4, ["g1:a", "g2:b", "g3:NEW"])]
    quorum_step(m)
    assert (m._pg.configured, guard.refused, guard.abandoned) == ([1, 2, 4], 1, 1)


def test_a_notice_while_stepping_abandons_the_step_and_refuses_one_answer_with_it(
    setup: tuple[_Manager, _Client, Guard],
) -> None:
    """Mid-step: the step is abandoned and the process group aborted, as before. Should g3's
    request have reached the lighthouse before it died, the next answer holds it: refused.
    The one after is configured even with the same members (the lighthouse bumps the quorum
    id after a failed commit): a late notice costs at most one quorum."""
    m, client, guard = setup
    guard.on_command(notice("g3"))
    assert [type(e) for e in m.errors] == [PeerFailedError]
    assert (guard.abandoned, m._pg.aborts) == (1, 1)
    client.answers += [(2, ["g1:a", "g2:b", "g3:c"]), (3, ["g1:a", "g2:b", "g3:c"])]
    quorum_step(m)
    assert (m._pg.configured, guard.refused) == ([1], 1)
    quorum_step(m)
    assert (m._pg.configured, guard.refused, m.errors) == ([1, 3], 1, [])


def test_a_notice_after_the_answer_refuses_the_configure_not_yet_started(
    setup: tuple[_Manager, _Client, Guard],
) -> None:
    """The answer with g3 is read, torchft has yet to configure: the step is abandoned
    (without an abort, which would race the configure) and the configure refused."""
    m, client, guard = setup
    client.answers += [(2, ["g1:a", "g2:b", "g3:c"])]
    m._quorum_future = future = _Future()
    m._client._quorum()  # type: ignore[attr-defined]
    guard.on_command(notice("g3"))
    assert [type(e) for e in m.errors] == [PeerFailedError]
    assert (guard.abandoned, m._pg.aborts) == (1, 0)
    with pytest.raises(PeerFailedError, match="quorum 2"):
        m._pg.configure("store", "g1", 0, 3, 2, 0, 1)
    future.finished = True
    assert m._pg.configured == [1]


def test_without_a_readable_quorum_a_notice_only_reports() -> None:
    """A Manager whose quorum client cannot be wrapped: every notice may concern our quorum;
    the step is abandoned, nothing aborted (the next quorum may be the same), nothing refused."""
    m = _Manager()
    m._client = None
    guard = Guard(m, m._pg)
    _watch_quorums(m, guard)
    guard.on_command(notice("g3"))
    assert [type(e) for e in m.errors] == [PeerFailedError]
    assert (guard.abandoned, m._pg.aborts, guard.refuses(1)) == (1, 0, False)
    m._pg.configure("store", "g1", 0, 3, 1, 0, 1)
    assert m._pg.configured == [1]
