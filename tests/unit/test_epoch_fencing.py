"""The epoch-fencing rule (agent/channel/fencing.py), pure: every verdict, and its invariants."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from agent.channel.fencing import MAX_EPOCH_JUMP, Fence, Verdict, supersedes


@dataclass
class Seen:
    epoch: int
    devices: list[str]
    revision: int = 0


def test_a_newer_epoch_is_new_and_an_older_or_repeated_one_stale() -> None:
    fence = Fence()
    verdict, fence = fence.admit(2, ["a"])
    assert verdict is Verdict.NEW and fence == Fence(received=2, devices=frozenset("a"))
    for epoch, devices in ((2, ["a"]), (1, ["b"]), (0, [])):
        again, after = fence.admit(epoch, devices)
        assert again is Verdict.STALE and after == fence


def test_more_devices_at_the_same_epoch_are_an_update_until_it_is_acked() -> None:
    _, fence = Fence().admit(1, ["a"])
    verdict, fence = fence.admit(1, ["a", "b"])
    assert verdict is Verdict.UPDATE and fence.devices == {"a", "b"}
    assert fence.admit(1, ["b"])[0] is Verdict.STALE  # nothing new in it
    fence = fence.ack(1)
    verdict, after = fence.admit(1, ["c"])
    assert verdict is Verdict.STALE and after.devices == {"a", "b", "c"}  # learnt, not delivered


def test_a_higher_revision_is_taken_in_until_the_ack_then_not() -> None:
    """A repeat of a device already listed moves the revision only: taken in before the ack
    (the new trainer has not started: it is covered) but not delivered again (the trainer has
    that command: each delivery of an epoch names more devices than the last, as the chaos
    soak checks), learnt and not counted after it; the ack keeps the revision its incarnation
    started with, for the controller to check."""
    _, fence = Fence().admit(1, ["a"])
    verdict, fence = fence.admit(1, ["a"], 1)
    assert verdict is Verdict.KNOWN and fence.revision == 1
    verdict, grown = fence.admit(1, ["a", "b"], 2)  # a new device: delivered
    assert verdict is Verdict.UPDATE and grown.revision == 2
    assert fence.admit(1, ["a"], 1)[0] is Verdict.STALE  # a resend of it
    fence = fence.ack(1)
    assert (fence.acked, fence.acked_revision) == (1, 1)
    verdict, after = fence.admit(1, ["a"], 2)
    assert verdict is Verdict.STALE and after.revision == 2 and after.acked_revision == 1
    assert after.ack(1).acked_revision == 1  # acked once: what it started with stays
    # The next epoch starts over at its own revision; the acked one's stays until acked.
    verdict, nxt = after.admit(2, ["a"], 0)
    assert verdict is Verdict.NEW and (nxt.revision, nxt.acked_revision) == (0, 1)
    assert nxt.ack(2).acked_revision == 0


def test_a_fresh_process_started_after_every_revision_so_far() -> None:
    verdict, fence = Fence().registered(7, Seen(7, ["a"], 3), fresh=True)
    assert verdict is Verdict.KNOWN and (fence.acked, fence.acked_revision) == (7, 3)
    assert fence.admit(7, ["a"], 3)[0] is Verdict.STALE
    # Not fresh: a revision it missed is taken in (converged); delivered if it names more.
    _, fence = Fence().admit(7, ["a"])
    verdict, after = fence.registered(7, Seen(7, ["a"], 1), fresh=False)
    assert verdict is Verdict.KNOWN and after.revision == 1 and after.ack(7).acked_revision == 1
    assert fence.registered(7, Seen(7, ["a", "b"], 1), fresh=False)[0] is Verdict.UPDATE


def test_the_epoch_a_process_was_started_at_is_known_not_news() -> None:
    fence = Fence.started_at(3)
    verdict, fence = fence.admit(3, ["a"])
    assert verdict is Verdict.KNOWN and fence.devices == {"a"}
    assert fence.admit(3, ["a"])[0] is Verdict.STALE
    assert fence.admit(3, ["a", "b"])[0] is Verdict.STALE  # acked at 3: acted on already
    assert fence.admit(4, ["b"])[0] is Verdict.NEW


def test_a_huge_jump_is_believed_only_when_the_controller_confirms_it() -> None:
    fence = Fence(received=5)
    far = 5 + MAX_EPOCH_JUMP + 1
    verdict, after = fence.admit(far, ["a"])
    assert verdict is Verdict.IMPLAUSIBLE and after == fence
    assert fence.admit(5 + MAX_EPOCH_JUMP, ["a"])[0] is Verdict.NEW
    assert fence.admit(far, ["a"], confirmed=True)[0] is Verdict.NEW


def test_ack_and_adopt_never_move_back() -> None:
    fence = Fence(received=4, devices=frozenset("a"), acked=4)
    assert fence.ack(2).acked == 4 and fence.adopt(3) == fence and fence.adopt(4) == fence
    moved = fence.adopt(6)
    # A higher epoch adopted is held without its devices: its command, when it comes, is known.
    assert moved == Fence(received=6, devices=frozenset(), acked=4)
    assert moved.admit(6, ["z"])[0] is Verdict.KNOWN


def test_a_fresh_process_starts_after_every_restart_so_far() -> None:
    verdict, fence = Fence().registered(7, Seen(7, ["a"]), fresh=True)
    assert verdict is Verdict.KNOWN and fence == Fence(7, frozenset("a"), 7)
    assert fence.admit(7, ["a"])[0] is Verdict.STALE  # the resends to other workers
    # No command in the reply: the next one at that epoch is known, not news.
    _, fence = Fence().registered(7, None, fresh=True)
    assert fence.admit(7, ["a"])[0] is Verdict.KNOWN


def test_a_fresh_registration_does_not_forget_a_command_that_came_first() -> None:
    _, fence = Fence().admit(2, ["a"])  # delivered before the registration reply
    verdict, after = fence.registered(1, None, fresh=True)
    assert verdict is Verdict.KNOWN and after.received == 2 and after.devices == {"a"}
    assert after.admit(2, ["a"])[0] is Verdict.STALE  # its resend is not delivered twice


def test_a_re_registration_delivers_what_was_missed() -> None:
    fence = Fence(received=1, devices=frozenset("a"), acked=1)
    verdict, after = fence.registered(3, Seen(3, ["b"]), fresh=False)
    assert verdict is Verdict.NEW and after.received == 3
    # An update missed while disconnected, before the ack: delivered.
    fence = Fence(received=3, devices=frozenset("b"), acked=1)
    assert fence.registered(3, Seen(3, ["b", "c"]), fresh=False)[0] is Verdict.UPDATE
    # Nothing missed: the epoch is adopted.
    verdict, after = fence.registered(4, None, fresh=False)
    assert verdict is Verdict.KNOWN and after.received == 4
    assert fence.registered(3, Seen(3, ["b"]), fresh=False) == (Verdict.KNOWN, fence)


def test_a_restart_command_stops_only_a_trainer_started_below_its_epoch() -> None:
    assert supersedes(3, 2)
    assert not supersedes(3, 3) and not supersedes(2, 3)


commands = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "admit", "ack", "adopt", "register"]),
        st.integers(0, 6),
        st.frozensets(st.sampled_from("abc"), max_size=3),
    ),
    max_size=40,
)


@given(commands, st.integers(0, 3))
def test_each_epoch_is_acted_on_once_and_the_fence_only_moves_up(
    ops: list[tuple[str, int, frozenset[str]]], start: int
) -> None:
    fence = Fence.started_at(start)
    news: list[int] = []
    for op, epoch, devices in ops:
        before = fence
        if op == "admit":
            verdict, fence = fence.admit(epoch, devices)
        elif op == "ack":
            verdict, fence = Verdict.KNOWN, fence.ack(epoch)
        elif op == "adopt":
            verdict, fence = Verdict.KNOWN, fence.adopt(epoch)
        else:
            verdict, fence = fence.registered(epoch, Seen(epoch, sorted(devices)), fresh=False)
        assert fence.received >= before.received and fence.acked >= before.acked
        if verdict is Verdict.NEW:
            assert epoch > before.received and fence.received == epoch
            news.append(epoch)
        if verdict is Verdict.UPDATE:
            assert epoch == before.received > before.acked
        if verdict.delivers:
            assert epoch > start  # a process never re-does the restart it was started for
    assert news == sorted(set(news))  # strictly increasing: no epoch acted on twice
