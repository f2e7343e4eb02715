"""Issue 16 on a real nats-server with the configuration `marduk auth` generates: revocation on
the embedded server, writes through JetStream acknowledgements, device claims across jobs,
commands moved to another destination, and permission errors as one line."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import nats
import pytest

from marduk import auth, bus
from marduk.credentials import Credentials
from marduk.embedded import ServerKeeper
from tests.conftest import eventually, free_port


@pytest.fixture
def auth_dir(tmp_path: Path) -> Path:
    d = tmp_path / "auth"
    auth.init(d)
    auth.add_agent(d, "jobA")
    return d


def creds(auth_dir: Path, name: str) -> Credentials:
    return Credentials(nkey=auth_dir / f"{name}.nk")


async def test_revoked_identity_is_refused_and_its_open_connection_closed_within_a_second(
    tmp_path: Path, auth_dir: Path
) -> None:
    stats: Counter[str] = Counter()
    keeper = ServerKeeper(
        f"nats://127.0.0.1:{free_port()}",
        tmp_path / "state",
        embedded=True,
        auth_dir=auth_dir,
        insecure=False,
        stats=stats,
    )
    url = await keeper.ensure()
    watching = asyncio.create_task(keeper.watch(lambda: False))
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    kept = tmp_path / "agent-jobA-old.nk"
    kept.write_bytes((auth_dir / "agent-jobA.nk").read_bytes())
    nc = await bus.connect(
        url, name="victim", credentials=creds(auth_dir, "agent-jobA"), on_closed=on_closed
    )
    try:
        revoked_at = time.monotonic()
        auth.revoke(auth_dir, "agent-jobA")
        await asyncio.wait_for(closed.wait(), 3)
        assert time.monotonic() - revoked_at < 1.5
        await eventually(lambda: stats["auth.reloads"] == 1)
        assert stats["auth.reload_failures"] == 0
        with pytest.raises(Exception, match="authorization violation"):
            await bus.connect(url, name="revoked", credentials=Credentials(nkey=kept))
        # Addition takes effect too: a new job's agent connects at once.
        auth.add_agent(auth_dir, "jobB")
        await eventually(lambda: stats["auth.reloads"] == 2, timeout=3)
        nb = await bus.connect(url, name="new", credentials=creds(auth_dir, "agent-jobB"))
        await bus.close(nb, drain=False)
        # A configuration the server refuses is said so, not assumed applied.
        conf = auth_dir / auth.CONFIG_FILE
        conf.write_text(conf.read_text() + "\nauthorization { nonsense\n")
        await eventually(lambda: stats["auth.reload_failures"] == 1, timeout=5)
    finally:
        if not nc.is_closed:
            await nats.NATS.close(nc)
        watching.cancel()
        await keeper.stop()
