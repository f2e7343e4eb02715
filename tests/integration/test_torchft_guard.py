"""agent.torchft without a lighthouse: what it refuses, with one clear line each, and its
heartbeats while the Manager waits for a quorum. The behaviour with real torchft groups is
tests/e2e/test_torchft.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.errors import AgentError
from agent.torchft import (
    LIGHTHOUSE_FLAGS,
    Guard,
    _watch_quorums,
    attach,
    lighthouse_command,
    replica_id,
)


def test_the_replica_id_is_marduks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARDUK_REPLICA_ID", "g7")
    assert replica_id() == "g7"
    assert replica_id(default="other") == "g7"  # the agent's --replica wins
    monkeypatch.delenv("MARDUK_REPLICA_ID")
    assert replica_id(default="g1") == "g1"
    with pytest.raises(AgentError, match="no replica id: set MARDUK_REPLICA_ID"):
        replica_id()


def test_attach_wants_a_manager() -> None:
    with pytest.raises(AgentError, match="wants a torchft Manager, not dict"):
        attach({})  # type: ignore[arg-type]


def test_importing_it_imports_neither_torch_nor_torchft() -> None:
    code = "import sys, agent.torchft; print([m for m in ('torch', 'torchft') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_lighthouse_flags_are_torchft_lighthouses() -> None:
    """The timers Marduk recommends are options of the torchft_lighthouse installed (a torchft
    that renames one fails here, not in a user's job)."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[dev]'")
    binary = str(Path(sys.executable).parent / "torchft_lighthouse")
    cmd = lighthouse_command(2, "127.0.0.1:0", binary=binary)
    assert cmd[:5] == [binary, "--min_replicas", "2", "--bind", "127.0.0.1:0"]
    assert cmd[5:] == list(LIGHTHOUSE_FLAGS)
    usage = subprocess.run([binary, "--help"], capture_output=True, text=True, check=True).stdout
    for flag in LIGHTHOUSE_FLAGS[::2]:
        assert flag + " " in usage, (flag, usage)


class _Client:
    def __init__(self) -> None:
        self.beats = 0

    def heartbeat(self) -> None:
        self.beats += 1

    def step(self, step: int) -> None:
        pass


class _Inner:
    """A Manager's quorum client whose ``_quorum`` waits until released (the lighthouse waits
    for a dead or hung group to time out)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def _quorum(self, *args: object, **kwargs: object) -> object:
        self.release.wait(10)
        return types.SimpleNamespace(replica_ids=["g1:a", "g3:b"])


class _Manager:
    def __init__(self) -> None:
        self._client = _Inner()

    def report_error(self, e: Exception) -> None:
        pass

    def current_step(self) -> int:
        return 7


def test_waiting_for_a_quorum_is_not_a_hang() -> None:
    """While the Manager's quorum call is in flight the Guard heartbeats (after the first step
    only: before it, the agent's startup timeout applies); a group stuck anywhere else does not
    (that is a hang for ``--hang-timeout``)."""
    manager = _Manager()
    inner = manager._client
    guard = Guard(manager, beat_every=0.01)
    _watch_quorums(manager, guard)
    client = _Client()
    guard.client = client  # type: ignore[assignment]
    guard.start_beats()

    def quorum() -> threading.Thread:
        t = threading.Thread(target=manager._client._quorum, args=(0, 7))
        t.start()
        return t

    waiting = quorum()  # the first quorum: startup, no heartbeat
    time.sleep(0.1)
    assert client.beats == 0
    inner.release.set()
    waiting.join()
    guard.step()
    inner.release.clear()
    time.sleep(0.1)
    assert client.beats == 0  # stepping, not waiting: steps are the progress
    waiting = quorum()
    deadline = time.monotonic() + 5
    while client.beats < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.beats >= 3
    inner.release.set()
    waiting.join()
    assert guard.quorum == frozenset({"g1", "g3"})
    beats = client.beats
    time.sleep(0.1)
    assert client.beats - beats <= 1  # at most one that was under way


class _Answers:
    """A Manager's quorum client answering from a list (no lighthouse): each answer is
    ``(quorum_id, replica_ids, world_size)``; ``during`` runs while a call is in flight."""

    def __init__(self, store_address: str, answers: list[tuple[int, list[str], int]]) -> None:
        self.store_address = store_address
        self.answers = answers
        self.during: Callable[[], None] = lambda: None
        self.asked: list[dict[str, object]] = []

    def _quorum(self, **kwargs: object) -> object:
        self.asked.append(kwargs)
        self.during()
        self.during = lambda: None
        quorum_id, ids, world_size = self.answers.pop(0)
        return types.SimpleNamespace(
            quorum_id=quorum_id,
            replica_ids=ids,
            replica_rank=0,
            replica_world_size=world_size,
            recover_src_manager_address="",
            recover_src_replica_rank=None,
            recover_dst_replica_ranks=[],
            store_address=self.store_address,
            max_step=kwargs["step"],
            max_replica_rank=0,
            max_world_size=world_size,
            heal=False,
            commit_failures=0,
        )

    def should_commit(self, group_rank: int, step: int, should_commit: bool, **_: object) -> bool:
        return should_commit


def _manager(lighthouse: Any, store: Any, rank: int = 0, world_size: int = 1) -> tuple[Any, Any]:
    """torchft's Manager for replica group g1 (and its process group), on a lighthouse and a
    store made in the test; the lighthouse is asked for quorums only where the test's client
    does not answer them."""
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=lambda _: None,
        state_dict=lambda: {},
        replica_id="g1",
        lighthouse_addr=lighthouse.address(),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=rank,
        world_size=world_size,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=5),
        connect_timeout=timedelta(seconds=5),
    )
    return manager, pg


@pytest.mark.serial  # an upper bound on time: the machine to itself
def test_torchfts_manager_skips_a_refused_quorum_at_once_and_configures_the_next() -> None:
    """torchft 0.2.0's own ``Manager`` (its quorum client answering from a list): the notice
    about g3 comes while the quorum call is in flight, and the answer still holds g3's
    incarnation. The Manager does not configure its process group with it (which would wait
    the process group's timeout for g3's store key): the quorum step ends at once with the
    error reported, the step does not commit, and the next quorum (asked with the failed
    commit, so the lighthouse would bump its id) configures a process group without g3."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[dev]'")
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    from agent.library.command import Command, PeerFailure
    from agent.torchft import PeerFailedError

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)  # never asked for a quorum
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager, pg = _manager(lighthouse, store)
    try:
        me = store.get("replica_id").decode()  # g1:uuid
        # The first answer has g3 in it but a world of one: configured without a second process.
        client = _Answers(
            f"127.0.0.1:{store.port}",
            [(1, [me, "g3:c"], 1), (2, [me, "g3:c"], 2), (3, [me], 1)],
        )
        manager._client = client  # type: ignore[assignment]
        guard = Guard(manager, pg)
        _watch_quorums(manager, guard)

        manager.start_quorum()
        manager.wait_quorum()
        assert (pg._quorum_id, manager.errored()) == (1, None)
        assert manager.should_commit()

        peer = PeerFailure("g3", 1, "restart")
        told = Command("peer_failed", 0, "", (), "ft", "g1", "replica", "n", 0.0, 0.0, (peer,))
        client.during = lambda: guard.on_command(told)
        t0 = time.monotonic()
        manager.start_quorum()
        manager.wait_quorum()  # returns: the refusal does not reach the training loop
        took = time.monotonic() - t0
        assert took < 2, took  # not the process group's 5 s for g3's store key
        assert pg._quorum_id == 1  # not configured for quorum 2
        error = manager.errored()
        assert error is not None and isinstance(error.original_exception, PeerFailedError)
        assert not manager.should_commit()
        assert guard.refused == 1

        manager.start_quorum()
        manager.wait_quorum()
        assert client.asked[-1]["commit_failures"] == 1
        assert (pg._quorum_id, manager.errored()) == (3, None)
        assert manager.should_commit()
    finally:
        manager.shutdown(wait=False)
        lighthouse.shutdown()


@pytest.mark.serial  # an upper bound on time: the machine to itself
def test_the_ranks_of_a_group_may_refuse_differently_and_still_agree() -> None:
    """One replica group of two ranks, torchft's own Managers and Manager server, a real
    lighthouse. A notice reaches the ranks at different times, so rank 0 refuses a quorum
    (here: it is told the group's own incarnation failed) and rank 1 configures it. Nothing
    waits for the other: each rank makes its one quorum request per step and configures its
    own process group, and torchft's should_commit (all ranks of the group) gives both the same
    answer, False; the next quorum (its id bumped by the failed commit) is configured by both
    and commits."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[dev]'")
    from concurrent.futures import ThreadPoolExecutor

    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # Rank 0 first: it starts the group's Manager server.
    made = [_manager(lighthouse, store, rank, world_size=2) for rank in range(2)]
    managers, pgs = [m for m, _ in made], [pg for _, pg in made]
    guards = [Guard(m, pg) for m, pg in made]
    for m, g in zip(managers, guards, strict=True):
        _watch_quorums(m, g)
    both = ThreadPoolExecutor(2)

    def step(fail: bool = False) -> list[bool]:
        for m in managers:
            m.start_quorum()
        for m in managers:
            m.wait_quorum()
            if fail:
                m.report_error(RuntimeError("a step that does not commit"))
        return list(both.map(lambda m: m.should_commit(), managers))

    try:
        assert step() == [True, True]
        assert step(fail=True) == [False, False]  # the next quorum gets a new id: configured
        before = pgs[0]._quorum_id
        me = store.get("replica_id").decode()
        guards[0]._dead.add(me)  # rank 0 told, rank 1 not yet
        t0 = time.monotonic()
        assert step() == [False, False]
        assert time.monotonic() - t0 < 3  # nobody waited for the other
        assert (guards[0].refused, guards[1].refused) == (1, 0)
        assert pgs[0]._quorum_id == before  # refused
        assert pgs[1]._quorum_id == guards[1].quorum_id != before  # configured
        assert step() == [True, True]
        assert pgs[0]._quorum_id == pgs[1]._quorum_id == guards[0].quorum_id
    finally:
        both.shutdown()
        for m in managers:
            m.shutdown(wait=False)
        lighthouse.shutdown()


HELD_WORK = Path(__file__).resolve().parents[1] / "trainers" / "torchft_held_work.py"


@pytest.mark.serial  # an upper bound on time: the machine to itself
@pytest.mark.parametrize("mode", ["released", "held"])
def test_a_peers_abort_ends_a_recv_only_once_the_peer_holds_no_work(mode: str) -> None:
    """What the Guard's abort frees: torchft 0.2.0's ``ProcessGroupWrapper.abort`` closes gloo's
    connections only when the last reference to the process group goes, and a Work holds one.
    The example's ``average_gradients`` keeps none, so a peer waiting in a recv from this group
    fails as soon as it aborts; a Work kept (a loop variable, as the example had) keeps the
    connections open and the peer waits the 3 s timeout: the benchmark's 3 s crash stalls."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[dev]'")
    out = subprocess.run(
        [sys.executable, str(HELD_WORK), mode], capture_output=True, text=True, timeout=60
    )
    said = [line for line in out.stdout.splitlines() if line.startswith("recv ended after ")]
    assert len(said) == 1, (out.stdout, out.stderr[-2000:])
    seconds = float(said[0].split()[3])
    if mode == "released":
        assert seconds < 2.0 and "Connection closed by peer" in said[0], said
    else:
        assert seconds >= 2.9 and "Timed out" in said[0], said
