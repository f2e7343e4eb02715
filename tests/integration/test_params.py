"""Live parameters on a real nats-server (decisions.md #20): `marduk monitor set` reaches every
trainer, a restarted trainer starts with the values, a new leader delivers a set its
predecessor stored but never sent, only admins may set, bad input is one clear line."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

import agent
from agent.library.client import AsyncClient
from agent.library.params import ParamsView
from marduk.controller import Controller, ControllerSettings
from marduk.errors import NoControllerError, PermissionDeniedError, RequestRejected
from marduk.transport import auth, bus
from marduk.transport.credentials import Credentials
from marduk.wire.params import ParamsQuery, ParamsQueryReply, ParamsSet, ParamsSetReply
from marduk.wire.subjects import Subjects
from monitor_cli import params_cli
from tests.conftest import NatsServer, controller_settings, eventually, marduk_cli, start_serving
from tests.processes import Proc

S = Subjects()


def trainer(env: dict[str, str], replica: str) -> Proc:
    p = Proc([sys.executable, "tests/trainers/params_trainer.py", "--replica", replica], env)
    return p


def test_set_reaches_every_trainer_and_a_restart_starts_with_it(
    controller_env: dict[str, str],
) -> None:
    env = controller_env
    r0, r1 = trainer(env, "r0"), trainer(env, "r1")
    r0.expect("START version=0 lr=0.1")
    r1.expect("START version=0 lr=0.1")
    out = marduk_cli("monitor", "set", "params", "lr=0.01", "log_every=5", env=env)
    assert out.returncode == 0, out.stderr
    assert "job params: version 1: log_every=5, lr=0.01" in out.stdout
    r0.expect("PARAMS version=1 lr=0.01")
    r1.expect("PARAMS version=1 lr=0.01")

    def shown() -> dict:  # type: ignore[type-arg]
        r = marduk_cli("monitor", "params", "params", "--json", env=env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)  # type: ignore[no-any-return]

    doc = shown()
    assert doc["params"]["values"] == {"lr": 0.01, "log_every": 5}
    assert doc["params"]["set_by"]
    assert sorted((w["replica"], w["version"], w["state"]) for w in doc["workers"]) == [
        ("r0", 1, "applied"),
        ("r1", 1, "applied"),
    ]
    # A trainer restarted afterwards starts with the value, not its command line's.
    r1.stop()
    r1 = trainer(env, "r1")
    r1.expect("START version=1 lr=0.01")
    # One replica's own value; refused by that trainer, with why; the other is not told.
    out = marduk_cli("monitor", "set", "params", "lr=2.0", "--replica", "r0", env=env)
    assert out.returncode == 0, out.stderr
    r0.expect("REJECTED version=2 lr=2.0")
    text = ""
    for _ in range(100):
        r = marduk_cli("monitor", "params", "params", env=env)
        text = r.stdout
        if "r0/0: version 2 rejected; lr refused: 2.0 is above 1.0" in text:
            break
    assert "r0/0: version 2 rejected; lr refused: 2.0 is above 1.0" in text, text
    assert "lr = 2.0   (replica r0)" in text
    assert not any("version=2" in line for line in r1.all)


def test_bad_input_is_a_usage_error_before_anything_is_sent(
    controller_env: dict[str, str],
) -> None:
    env = controller_env
    for args, why in (
        (["1lr=3"], "invalid parameter name '1lr'"),
        (["lr"], "'lr' is not KEY=VALUE"),
        (["s=" + "x" * 300], "a string of 300 characters (at most 256)"),
        (['o={"a": 1}'], "objects are not parameters"),
    ):
        r = marduk_cli("monitor", "set", "params", *args, env=env)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = marduk_cli("monitor", "set", "nosuchjob", "lr=1", env=env)
    assert r.returncode == 1
    assert r.stderr.strip().endswith(
        "no job 'nosuchjob' is registered (marduk monitor status lists them)"
    ), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


async def lib(
    server: NatsServer, replica: str, seen: list[ParamsView], **kw: object
) -> AsyncClient:
    return await agent.connect_async(
        replica,
        [f"{replica}-gpu"],
        job="j",
        addr=server.url,
        timeout=5,
        on_params=seen.append,
        **kw,  # type: ignore[arg-type]
    )


async def test_a_set_stored_by_a_leader_that_died_before_sending_it_is_delivered(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    settings = controller_settings(nats_server, tmp_path)
    settings.lease_ttl = 2.0
    leader = await start_serving(Controller(settings))
    standby = Controller(controller_settings(nats_server, tmp_path / "b"))
    standby.settings.lease_ttl = 2.0
    await standby.start()
    seen0: list[ParamsView] = []
    seen1: list[ParamsView] = []
    a = await lib(nats_server, "r0", seen0)
    b = await lib(nats_server, "r1", seen1)
    died = asyncio.Event()

    async def dies_here(job: str) -> None:  # the seam: stored, then the process is gone
        died.set()
        await asyncio.Event().wait()

    leader.params._publish = dies_here  # type: ignore[method-assign]
    nc = await bus.connect(nats_server.url, name="test")
    try:
        asked = asyncio.create_task(
            bus.request(
                nc,
                S.params_set,
                ParamsSet(job="j", values={"lr": 0.5}, by="t"),
                ParamsSetReply,
                timeout=2.0,
            )
        )
        await asyncio.wait_for(died.wait(), 5)
        stored = await leader.params_store.get("j")  # type: ignore[union-attr]
        assert stored is not None and stored[0].version == 1  # written before any trainer heard
        assert not seen0 and not seen1
        await leader.stop()
        with pytest.raises(NoControllerError):
            await asyncio.wait_for(asked, 5)  # never answered: the leader is gone
        await asyncio.wait_for(standby.serving.wait(), 15)
        await eventually(lambda: bool(seen0) and bool(seen1), timeout=15)
        assert (seen0[-1].version, dict(seen0[-1])) == (1, {"lr": 0.5})
        assert (seen1[-1].version, dict(seen1[-1])) == (1, {"lr": 0.5})
        # Without a callback acknowledgement is the trainer's: it says so, status shows it.
        await a.params_applied(1)
        await b.params_applied(1)
        reply = await bus.request(
            nc, S.params_get, ParamsQuery(job="j"), ParamsQueryReply, timeout=5.0
        )
        assert [w.state for w in reply.workers] == ["applied", "applied"]
    finally:
        await nc.close()
        await a.close()
        await b.close()
        await standby.stop()


async def test_concurrent_sets_lose_no_update(nats_server: NatsServer, tmp_path: Path) -> None:
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    seen: list[ParamsView] = []
    a = await lib(nats_server, "r0", seen)
    nc = await bus.connect(nats_server.url, name="test")
    try:
        replies = await asyncio.gather(
            *(
                bus.request(
                    nc,
                    S.params_set,
                    ParamsSet(job="j", values={f"k{i}": i}),
                    ParamsSetReply,
                    timeout=5.0,
                )
                for i in range(20)
            )
        )
        final = await bus.request(
            nc, S.params_get, ParamsQuery(job="j"), ParamsQueryReply, timeout=5.0
        )
        assert final.params.values == {f"k{i}": i for i in range(20)}  # none lost
        # A storm is rate limited: the sets that came while one was stored went into the next
        # write, one version each write (the first took the job's lock, the others queued).
        v = final.params.version
        assert c.stats["params.coalesced"] >= 1 and v == 20 - c.stats["params.coalesced"]
        assert all(r.params.version <= v and r.changed for r in replies)
        await eventually(lambda: bool(seen) and seen[-1].version == v)
        # The last value wins, in the order the sets came.
        for r in await asyncio.gather(
            *(
                bus.request(
                    nc,
                    S.params_set,
                    ParamsSet(job="j", values={"lr": i}),
                    ParamsSetReply,
                    timeout=5.0,
                )
                for i in range(10)
            )
        ):
            v = max(v, r.params.version)
        final = await bus.request(
            nc, S.params_get, ParamsQuery(job="j"), ParamsQueryReply, timeout=5.0
        )
        assert final.params.values["lr"] == 9 and final.params.version == v
        # Compare-and-set from the client: a stale version is refused, one line. (Not a fixed
        # number: set storms are coalesced, so under load the sets above may end at any v >= 2.)
        stale = v - 1
        assert stale >= 1
        with pytest.raises(RequestRejected, match=f"at version {v}, not {stale}"):
            await bus.request(
                nc,
                S.params_set,
                ParamsSet(job="j", values={"k0": 9}, if_version=stale),
                ParamsSetReply,
                timeout=5.0,
            )
        # Another controller's write (a lapsed leader's, landing late) is read, not overwritten.
        store = c.params_store
        assert store is not None
        doc, rev = await store.get("j")  # type: ignore[misc]
        import msgspec

        await store.put(
            msgspec.structs.replace(doc, version=v + 1, values={**doc.values, "x": 1}), rev
        )
        r = await bus.request(
            nc, S.params_set, ParamsSet(job="j", values={"y": 2}), ParamsSetReply, timeout=5.0
        )
        assert r.params.version == v + 2 and r.params.values["x"] == 1
        assert r.params.values["y"] == 2 and c.stats["params.cas_retries"] == 1
        # A client that read a version this controller has not seen yet is judged on the store.
        doc, rev = await store.get("j")  # type: ignore[misc]
        await store.put(msgspec.structs.replace(doc, version=v + 3), rev)
        r = await bus.request(
            nc,
            S.params_set,
            ParamsSet(job="j", values={"z": 3}, if_version=v + 3),
            ParamsSetReply,
            timeout=5.0,
        )
        assert r.params.version == v + 4
    finally:
        await nc.close()
        await a.close()
        await c.stop()


@pytest.fixture
def auth_dir(tmp_path: Path) -> Path:
    d = tmp_path / "auth"
    auth.init(d)
    return d


async def test_only_the_admin_credential_may_set(tmp_path: Path, auth_dir: Path) -> None:
    server = NatsServer(tmp_path / "js", args=["-c", str(auth_dir / auth.CONFIG_FILE)]).start()
    settings = ControllerSettings(
        addr=server.url,
        embedded=False,
        state_dir=tmp_path / "state",
        credentials=Credentials(nkey=auth_dir / "controller.nk"),
    )
    c = await start_serving(Controller(settings))
    seen: list[ParamsView] = []
    a = await agent.connect_async(
        "r0",
        ["r0-gpu"],
        job="j",
        addr=server.url,
        timeout=5,
        credentials=Credentials(nkey=auth_dir / "agent.nk"),
        on_params=seen.append,
    )
    try:
        for name in ("agent", "monitor"):
            bus.set_default_credentials(Credentials(nkey=auth_dir / f"{name}.nk"))
            try:
                with pytest.raises(PermissionDeniedError, match=f"the {name} credential may not"):
                    await params_cli.set_params(server.url, "marduk", "j", {"lr": 9.0}, timeout=1)
            finally:
                bus.set_default_credentials(Credentials())
        assert not seen
        bus.set_default_credentials(Credentials(nkey=auth_dir / "admin.nk"))
        try:
            reply = await params_cli.set_params(server.url, "marduk", "j", {"lr": 0.3})
            got = await params_cli.get_params(server.url, "marduk", "j")
        finally:
            bus.set_default_credentials(Credentials())
        assert reply.params.version == 1
        # Signed by the controller and verified by the agent (it has controller.pub).
        await eventually(lambda: bool(seen) and seen[-1]["lr"] == 0.3)
        # The agent's credential may acknowledge on its job's subject.
        assert await a.params_applied(1)
        assert c.stats["params.applied"] == 1
        assert got.params.values == {"lr": 0.3}
    finally:
        await a.close()
        await c.stop()
        server.stop()


def test_under_agent_run_the_supervisor_forwards_and_acknowledges(
    controller_env: dict[str, str],
) -> None:
    """The trainer talks to its supervisor (`marduk agent run`), not the controller: the
    supervisor hands it the values at its welcome, forwards a set, and says what it applied."""
    from tests.processes import agent_run

    env = controller_env
    out = marduk_cli("monitor", "set", "params", "lr=0.2", env=env)
    assert out.returncode == 1 and "no job 'params' is registered" in out.stderr
    cmd = [sys.executable, "tests/trainers/params_trainer.py", "--replica", "s0"]
    sup = agent_run(env, "--job", "params", "--replica", "s0", "--devices", "s0-gpu0", cmd=cmd)
    sup.expect("START version=0 lr=0.1", timeout=30)
    out = marduk_cli("monitor", "set", "params", "lr=0.2", env=env)
    assert out.returncode == 0, out.stderr
    sup.expect("PARAMS version=1 lr=0.2")
    text = ""
    for _ in range(50):
        text = marduk_cli("monitor", "params", "params", env=env).stdout
        if "s0/0: version 1 applied" in text:
            break
    assert "s0/0: version 1 applied" in text, text
    # A restart of the trainer (its supervisor stays): the new incarnation starts with it.
    r = marduk_cli("monitor", "inject-failure", "s0-gpu0", env=env)
    assert r.returncode == 0, r.stderr
    sup.expect("START version=1 lr=0.2", timeout=30)


def test_a_supervisor_of_two_ranks_acknowledges_each_ranks_word(
    controller_env: dict[str, str],
) -> None:
    """Two local ranks under one `marduk agent run`: `params` lists each rank's version under
    the worker, and the worker runs the lowest (not the last rank's word)."""
    from tests.processes import agent_run

    env = controller_env
    cmd = [sys.executable, "tests/trainers/params_trainer.py", "--replica", "s1"]
    sup = agent_run(
        env,
        *("--job", "params", "--replica", "s1", "--devices", "s1-gpu0,s1-gpu1"),
        *("--nproc-per-node", "2"),
        cmd=cmd,
    )
    for _ in range(2):
        sup.expect("START version=0 lr=0.1", timeout=30)
    out = marduk_cli("monitor", "set", "params", "lr=0.2", env=env)
    assert out.returncode == 0, out.stderr
    for _ in range(2):
        sup.expect("PARAMS version=1 lr=0.2")
    want = ["s1/0: version 1 applied", "rank 0: version 1 applied", "rank 1: version 1 applied"]
    text = ""
    for _ in range(50):
        text = marduk_cli("monitor", "params", "params", env=env).stdout
        if all(w in text for w in want):
            break
    assert all(w in text for w in want), text


async def test_every_change_is_an_event_and_a_worker_behind_is_told_again(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    from marduk.wire.protocol import ControllerEvent, decode

    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    seen: list[ParamsView] = []
    a = await lib(nats_server, "r0", seen)  # a callback: the trainer acknowledges, later
    nc = await bus.connect(nats_server.url, name="test")
    events: list[ControllerEvent] = []

    async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
        events.append(decode(msg.data, ControllerEvent))

    await nc.subscribe(S.events("j"), cb=on_event)
    await nc.flush()
    try:
        for values in ({"lr": 0.5}, {"lr": 0.25, "tags": ["a", 1]}):
            await bus.request(
                nc,
                S.params_set,
                ParamsSet(job="j", values=values, by="ann@h"),  # type: ignore[arg-type]
                ParamsSetReply,
                timeout=5.0,
            )
        await eventually(lambda: len([e for e in events if e.kind == "params_set"]) == 2)
        details = [e.detail for e in events if e.kind == "params_set"]
        assert details == [
            "by ann@h: version 1: lr: unset -> 0.5",
            'by ann@h: version 2: lr: 0.5 -> 0.25, tags: unset -> ["a", 1]',
        ]
        await eventually(lambda: bool(seen) and seen[-1].version == 2)
        # Not acknowledged: told again (level-triggered), until it says it runs version 2.
        await eventually(lambda: c.stats["params.resent"] >= 1, timeout=5)
        await a.params_applied(2, {"tags": "not used here"})
        await eventually(lambda: any(e.kind == "params_rejected" for e in events))
        resent = c.stats["params.resent"]
        await asyncio.sleep(2.5)
        assert c.stats["params.resent"] == resent
        reply = await bus.request(
            nc, S.params_get, ParamsQuery(job="j"), ParamsQueryReply, timeout=5.0
        )
        assert [(w.version, w.state, w.rejected) for w in reply.workers] == [
            (2, "rejected", {"tags": "not used here"})
        ]
    finally:
        await nc.close()
        await a.close()
        await c.stop()
