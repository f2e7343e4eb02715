"""The agent's epoch fencing, without a server: what is delivered, what re-arms ``failed``."""

from __future__ import annotations

from agent.library.client import Command, CommandInbox, Options
from marduk.wire import protocol as wire


def inbox(epoch: int = 0) -> tuple[CommandInbox, list[Command]]:
    got: list[Command] = []
    opts = Options(
        job="j", replica="r1", worker=0, devices=["a", "b"], addr="", prefix="marduk",
        scope="replica", timeout=1, incarnation=0, epoch=epoch,
    )  # fmt: skip
    return CommandInbox(opts, None, got.append), got


def cmd(epoch: int, *devices: str, kind: str = "restart") -> wire.Command:
    return wire.Command(
        command_id=f"c{epoch}",
        job="j",
        replica="r1",
        kind=kind,
        epoch=epoch,
        devices=list(devices),  # type: ignore[arg-type]
    )


def test_an_update_before_the_ack_is_delivered_and_keeps_failed() -> None:
    box, got = inbox()
    box._accept(cmd(1, "a"))
    box._accept(cmd(1, "a", "b"))  # b joined the restart in flight
    assert [(c.epoch, c.devices) for c in got] == [(1, ("a",)), (1, ("a", "b"))]
    assert box.failed and box.last_failure is not None and box.last_failure.devices == ("a", "b")
    assert box.stats["updates"] == 1


def test_an_update_after_the_ack_re_arms_nothing() -> None:
    """Review S2: a trainer that acked epoch 1 must not be told to restart again by a resend
    of epoch 1 with a merged device (the documented loop would act twice)."""
    box, got = inbox()
    box._accept(cmd(1, "a"))
    box._clear_failure(None)  # the trainer acts and acks
    assert not box.failed
    box._accept(cmd(1, "a", "b"))
    assert len(got) == 1 and not box.failed and box.stats["dropped_stale"] == 1


def test_a_process_started_at_an_epoch_takes_its_command_as_known_not_as_an_update() -> None:
    """Restarted by its supervisor with MARDUK_EPOCH=3: the epoch-3 command (a resend, or the
    registration reply's) is the one it was started for."""
    box, got = inbox(epoch=3)
    box._accept(cmd(3, "a"))
    assert not got and not box.failed
    box._accept(cmd(3, "a"))  # its resends too
    assert not got
    box._accept(cmd(4, "b"))
    assert [c.epoch for c in got] == [4]


def test_duplicates_and_stale_epochs_are_dropped() -> None:
    box, got = inbox()
    for e in (2, 2, 1, 3, 3):
        box._accept(cmd(e, "a"))
    assert [c.epoch for c in got] == [2, 3] and box.stats["dropped_stale"] == 3
