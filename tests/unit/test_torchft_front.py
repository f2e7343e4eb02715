"""The torchft front's pure parts: the heartbeat table (drops, resends, ageing, bounds) and the
one field of torchft's heartbeat it reads (agent/torchft_front/heartbeats.py, wire.py)."""

from __future__ import annotations

import pytest

from agent.torchft_front import heartbeats as hb
from agent.torchft_front.heartbeats import Heartbeats, group_of
from agent.torchft_front.wire import MalformedMessage, heartbeat_replica_id, heartbeat_request

G2_OLD = "g2:0f75d9ae-7516-4c73-8c95-76e179b9178e"
G2_NEW = "g2:39592a2b-dacf-4670-a460-9492d73e3f87"


def table(*ids: str, now: float = 0.0) -> Heartbeats:
    t = Heartbeats(timeout_s=1.0)
    for i in ids:
        assert t.beat(i, now)
    return t


def test_an_order_drops_every_incarnation_of_the_group_and_refuses_their_later_beats() -> None:
    t = table("g1:a", G2_OLD, "g3:c")
    assert t.order("g2", epoch=1, now=0.5) == [G2_OLD]
    assert sorted(t.ids()) == ["g1:a", "g3:c"]
    assert not t.beat(G2_OLD, 0.6)  # the process told to exit still beats for a moment
    assert t.counts["refused_dropped"] == 1
    assert G2_OLD not in t.ids()
    # Its next incarnation is a new id: taken in.
    assert t.beat(G2_NEW, 0.7)
    assert t.is_new(G2_NEW)
    assert sorted(t.ids()) == ["g1:a", G2_NEW, "g3:c"]


def test_a_resent_order_drops_nothing_so_the_restarted_incarnation_stays() -> None:
    t = table("g1:a", G2_OLD)
    assert t.order("g2", 3, 0.0) == [G2_OLD]
    assert t.beat(G2_NEW, 0.5)
    # The controller resends the epoch's command about once a second until it is confirmed.
    assert t.order("g2", 3, 1.0) == []
    assert t.order("g2", 2, 1.1) == []  # an older epoch: stale
    assert t.counts["orders_resent"] == 2
    assert G2_NEW in t.ids()
    # The group's next failure is a new epoch: that drops the new incarnation.
    assert t.order("g2", 4, 2.0) == [G2_NEW]


def test_an_order_for_another_group_or_with_a_prefix_of_the_name_drops_nothing_else() -> None:
    t = table("g1:a", "g10:b", "g1")
    assert t.order("g1", 1, 0.0) == ["g1", "g1:a"]
    assert t.ids() == ["g10:b"]
    assert group_of("g10:b:c") == "g10"


def test_a_job_wide_order_drops_every_group_and_has_its_own_epochs() -> None:
    t = table("g1:a", "g2:b")
    t.order("g1", 5, 0.0)
    assert t.beat("g1:c", 0.1)
    assert t.order(None, 1, 0.2) == ["g1:c", "g2:b"]  # job scope: epoch 1 is new there
    assert t.ids() == []
    assert t.order(None, 1, 0.3) == []


def test_a_silent_incarnation_ages_out_after_the_timeout_and_a_beating_one_does_not() -> None:
    t = table("g1:a", "g2:b", now=0.0)
    assert t.beat("g1:a", 0.9)
    assert t.expire(0.99) == []
    assert t.expire(1.0) == ["g2:b"]
    assert t.ids() == ["g1:a"]
    assert t.counts["aged_out"] == 1
    # An aged-out id that beats again is live again (a partition that healed).
    assert t.beat("g2:b", 1.2)
    assert sorted(t.ids()) == ["g1:a", "g2:b"]


def test_drops_are_forgotten_after_a_while_and_bounded() -> None:
    t = table(G2_OLD)
    t.forget_after_s = 10.0
    t.order("g2", 1, 0.0)
    t.expire(9.0)
    assert not t.beat(G2_OLD, 9.0)
    t.expire(10.0)
    assert t.beat(G2_OLD, 10.5)  # long forgotten: a process that exited long ago
    many = Heartbeats(timeout_s=1.0)
    for i in range(hb.MAX_DROPPED + 5):
        many.dropped[f"x:{i}"] = 100.0
    many.expire(100.0)
    assert len(many.dropped) == hb.MAX_DROPPED
    assert "x:0" not in many.dropped


def test_unusable_ids_and_a_full_table_are_refused_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = Heartbeats(timeout_s=1.0)
    assert not t.beat("", 0.0)
    assert not t.beat("x" * (hb.MAX_ID_CHARS + 1), 0.0)
    assert t.counts["refused_id"] == 2
    monkeypatch.setattr(hb, "MAX_LIVE", 2)
    assert t.beat("a", 0.0) and t.beat("b", 0.0)
    assert not t.beat("c", 0.0)
    assert t.beat("a", 0.1)  # a known one still counts
    assert t.counts["refused_full"] == 1


@pytest.mark.parametrize("ft_id", ["g1:abc", "x" * 200, "grüppe:ü"])
def test_the_heartbeat_replica_id_round_trips(ft_id: str) -> None:
    assert heartbeat_replica_id(heartbeat_request(ft_id)) == ft_id


def test_the_heartbeat_is_read_as_protobuf_reads_it() -> None:
    # field 1 (0x0a) "g1", then unknown fields: varint 2, fixed64 3, bytes 4, fixed32 5
    data = (
        b"\x0a\x02g1" + b"\x10\x96\x01" + b"\x19" + b"\0" * 8 + b"\x22\x01z" + b"\x2d" + b"\0" * 4
    )
    assert heartbeat_replica_id(data) == "g1"
    assert heartbeat_replica_id(b"\x0a\x01a\x0a\x01b") == "b"  # the last one wins


@pytest.mark.parametrize(
    "data",
    [
        b"",  # no replica_id
        b"\x0a\x05ab",  # truncated
        b"\x0a",  # no length
        b"\x0a\x02\xff\xfe",  # not UTF-8
        b"\x0b",  # wire type 3 (groups): torchft never sends one
        b"\x00\x00",  # field 0
        b"\x0a" + b"\xff" * 11,  # a varint past 64 bits
        b"\x19\0",  # a truncated fixed64
        b"\x0a\x01a" + b"\x10" * 5000,  # oversized
    ],
)
def test_a_malformed_heartbeat_is_a_clear_error(data: bytes) -> None:
    with pytest.raises(MalformedMessage):
        heartbeat_replica_id(data)
