"""The lease rule with a fake clock: who takes the lease, when, at which term."""

from __future__ import annotations

from marduk.core.lease import FENCE, Lease, Sighting, Take, campaign, serving, term_to_claim

TTL = 2.0


def lease(holder: str, term: int, ttl: float = TTL) -> Lease:
    return Lease(holder=holder, term=term, ttl=ttl)


def look(seen: Sighting, revision: int | None, value: Lease | None, now: float, term: int = 0):
    return campaign(seen, revision, value, me="me", my_term=term, ttl=TTL, now=now)


def test_an_absent_lease_is_created_above_every_term_seen() -> None:
    assert look(Sighting(), None, None, now=0) == (Sighting(), Take(0, 1))
    seen = Sighting(7, 0.0, lease("old", 4))
    assert look(seen, None, None, now=0, term=2)[1] == Take(0, 5)
    assert look(seen, None, None, now=0, term=9)[1] == Take(0, 10)


def test_a_holder_s_lease_is_taken_only_a_whole_ttl_after_its_revision_was_first_seen() -> None:
    held = lease("other", 3)
    seen, take = look(Sighting(), 5, held, now=10.0)
    assert take is None and seen == Sighting(5, 10.0, held)
    assert look(seen, 5, held, now=11.99)[1] is None
    assert look(seen, 5, held, now=12.0)[1] == Take(5, 4)  # compare-and-set on what we saw


def test_a_renewal_starts_the_wait_again() -> None:
    held = lease("other", 3)
    seen, _ = look(Sighting(), 5, held, now=10.0)
    seen, take = look(seen, 6, held, now=11.9)  # renewed: a new revision
    assert take is None and seen.since == 11.9
    assert look(seen, 6, held, now=13.0)[1] is None
    assert look(seen, 6, held, now=13.9)[1] == Take(6, 4)


def test_the_holder_s_own_ttl_decides_and_an_unreadable_lease_uses_ours() -> None:
    long = lease("other", 1, ttl=10.0)
    seen, _ = look(Sighting(), 2, long, now=0.0)
    assert look(seen, 2, long, now=9.0)[1] is None and look(seen, 2, long, now=10.0)[1]
    seen, _ = look(Sighting(), 2, None, now=0.0)
    assert look(seen, 2, None, now=TTL)[1] == Take(2, 1)


def test_our_own_lease_is_taken_back_at_once() -> None:
    mine = lease("me", 4)
    assert look(Sighting(), 8, mine, now=0.0)[1] == Take(8, 5)  # from before an outage
    assert look(Sighting(8, 0.0, mine), 8, mine, now=0.1)[1] == Take(8, 5)  # after stepping down


def test_the_term_claimed_is_above_the_store_s_floor() -> None:
    assert term_to_claim(3, 0) == 3 and term_to_claim(3, 7) == 8


def test_a_leader_serves_only_within_the_fence_of_its_last_renewal_sent() -> None:
    assert serving(True, 100.0, TTL, 100.0 + FENCE * TTL - 0.001)
    assert not serving(True, 100.0, TTL, 100.0 + FENCE * TTL)
    assert not serving(False, 100.0, TTL, 100.0)
    assert FENCE < 1  # the standby's clock starts after the renewal was stored
