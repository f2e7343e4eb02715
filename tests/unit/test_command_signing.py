"""Command signatures: the controller's signer, made once per seed, signs as ``auth.sign``
does, and a new seed is signed with at once."""

from __future__ import annotations

from types import SimpleNamespace

from marduk.controller.outbox import Outbox
from marduk.transport import auth
from tests.parts import Shell


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
    seed: bytes | None = None
    outbox = Outbox(Shell().context(), store=lambda: None, signing_seed=lambda: seed)
    assert outbox.signature(b"cmd") is None  # unsigned
    first, second = auth.new_user_seed(), auth.new_user_seed()
    for seed in (first, second, first):
        signature = outbox.signature(b"cmd")
        assert signature is not None
        assert auth.verify([auth.public_key_of(seed)], b"cmd", signature)
        assert outbox.signature(b"cmd") == signature
    seed = None
    assert outbox.signature(b"cmd") is None


def test_verify_makes_each_verify_key_once_and_picks_up_a_changed_key() -> None:
    first, second = auth.new_user_seed(), auth.new_user_seed()
    key1, key2 = auth.public_key_of(first), auth.public_key_of(second)
    auth._verify_key.cache_clear()
    for n in range(3):
        data = b"command %d" % n
        assert auth.verify([key1], data, auth.sign(first, data))
        assert not auth.verify([key1], data, auth.sign(second, data))
    assert auth._verify_key.cache_info().misses == 1  # one key, made once
    # The controller's key changed: the new one verifies at once, the old one's signatures
    # are refused under the new key, and both verify while both are given (a rotation).
    assert auth.verify([key2], b"c", auth.sign(second, b"c"))
    assert not auth.verify([key2], b"c", auth.sign(first, b"c"))
    assert auth.verify([key1, key2], b"c", auth.sign(second, b"c"))
    assert auth._verify_key.cache_info().misses == 2
    assert not auth.verify(["not a key", "U" + "A" * 55], b"c", auth.sign(first, b"c"))


async def test_the_agent_accepts_signed_commands_and_follows_a_changed_controller_key() -> None:
    from agent.library.client import AsyncClient, Options
    from marduk.wire import protocol as wire

    old, new = auth.new_user_seed(), auth.new_user_seed()
    opts = Options(
        job="j", replica="r1", worker=0, devices=["a"], addr="", prefix="marduk",
        scope="replica", timeout=1, incarnation=0, epoch=0,
        controller_keys=[auth.public_key_of(old)],
    )  # fmt: skip
    client = AsyncClient(opts)

    async def send(seed: bytes, epoch: int) -> None:
        data = wire.encode(
            wire.Command(command_id=f"c{epoch}", job="j", replica="r1", kind="restart", epoch=epoch)
        )
        headers = {auth.SIG_HEADER: auth.sign(seed, data)}
        msg = SimpleNamespace(data=data, headers=headers, subject="marduk.j.cmd.replica.r1")
        await client._on_msg(msg)  # type: ignore[arg-type]

    await send(old, 1)
    await send(old, 2)
    assert client.epoch == 2 and client.stats["dropped_forged"] == 0
    await send(new, 3)  # not the controller's key (yet)
    assert client.epoch == 2 and client.stats["dropped_forged"] == 1
    opts.controller_keys = [auth.public_key_of(new)]  # the key changed
    await send(new, 3)
    await send(old, 4)
    assert client.epoch == 3 and client.stats["dropped_forged"] == 2
