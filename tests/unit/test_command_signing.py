"""Command signatures: the controller's signer, made once per seed, signs as ``auth.sign``
does, and a new seed is signed with at once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from marduk.controller.outbox import Outbox
from marduk.transport import auth


def test_a_signer_signs_as_sign_does_and_agents_verify_it() -> None:
    seed, other = auth.new_user_seed(), auth.new_user_seed()
    signer = auth.Signer(seed)
    for data in (b"", b"a command", bytes(range(256)) * 4):
        signature = signer.sign(data)
        assert signature == auth.sign(seed, data)  # ed25519 is deterministic
        assert auth.verify([auth.public_key_of(seed)], data, signature)
        assert not auth.verify([auth.public_key_of(other)], data, signature)
        assert not auth.verify([auth.public_key_of(seed)], data + b"x", signature)


def test_the_outbox_signs_with_the_controllers_seed_of_the_moment() -> None:
    ctl: Any = SimpleNamespace(signing_seed=None)
    outbox = Outbox(ctl)
    assert outbox.signature(b"cmd") is None  # unsigned
    first, second = auth.new_user_seed(), auth.new_user_seed()
    for seed in (first, second, first):
        ctl.signing_seed = seed
        signature = outbox.signature(b"cmd")
        assert auth.verify([auth.public_key_of(seed)], b"cmd", signature)
        assert outbox.signature(b"cmd") == signature
    ctl.signing_seed = None
    assert outbox.signature(b"cmd") is None
