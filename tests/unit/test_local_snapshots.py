"""The node-local snapshot store: the manifest's rules (pure), the store on disk (a temporary
directory: complete or not at all, two kept, the size bound), the snapshots a trainer takes and
restores (the agreement over ranks, the persistent fallback, refusals, the notice) and the
agent's side (where the store lives, when it goes, the persistent copies and their lag)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from agent.library import snapshot_format as fmt
from agent.library.local_store import LocalStore, StoreFull
from agent.library.snapshot_format import Identity, Manifest
from agent.library.snapshots import Snapshots
from agent.supervise.local_ckpt import LocalCkpt, Persister, parse_size, store_path

ME = Identity(job="j", lineage="run1", epoch=3, world_size=2, rank=1)


def manifest(**changes: object) -> Manifest:
    m = Manifest(
        v=fmt.FORMAT_VERSION,
        job="j",
        lineage="run1",
        epoch=3,
        world_size=2,
        rank=1,
        step=7,
        nbytes=64,
        crc32=0,
        created_at=0.0,
        buffers=[fmt.Buffer(offset=0, nbytes=64, dtype="uint8", shape=[64])],
        leaves=[fmt.Leaf("numpy", [64], [0])],
        tree={"a": 0},
    )
    return msgspec.structs.replace(m, **changes)


# --- the manifest's rules ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"job": "k"}, "of job 'k'"),
        ({"lineage": "run0"}, "of lineage 'run0'"),
        ({"world_size": 4}, "of world size 4, not 2 (not resharded)"),
        ({"rank": 0}, "of rank 0"),
        ({"epoch": 4}, "ahead of this one (3)"),
    ],
)
def test_a_snapshot_of_another_job_lineage_shape_rank_or_a_later_epoch_is_refused(
    changes: dict[str, object], why: str
) -> None:
    refusal = fmt.refusal(manifest(**changes), ME, 64)
    assert refusal is not None and why in refusal
    assert fmt.refusal(manifest(epoch=1), ME, 64) is None  # an earlier epoch of the run: fine


def test_a_snapshot_whose_data_is_not_the_size_its_manifest_says_is_torn() -> None:
    assert "torn" in (fmt.refusal(manifest(), ME, 63) or "")
    past = manifest(buffers=[fmt.Buffer(offset=32, nbytes=64, dtype="uint8", shape=[64])])
    assert "corrupt" in (fmt.refusal(past, ME, 64) or "")


def test_a_manifest_is_decoded_strictly() -> None:
    raw = fmt.encode_manifest(manifest())
    assert fmt.decode_manifest(raw) == manifest()
    for bad in (raw[:-5], b"{}", raw.replace(b'"v":1', b'"v":2')):
        with pytest.raises(ValueError):
            fmt.decode_manifest(bad)


def test_layout_aligns_every_buffer_and_prune_keeps_the_newest_two() -> None:
    assert fmt.layout([1, 64, 65, 0]) == ([0, 64, 128, 256], 256)
    assert fmt.to_prune([5, 9, 7, 8]) == [7, 5]
    assert fmt.step_of(fmt.step_name(42)) == 42
    assert fmt.step_of(fmt.tmp_name(42, 1)) is None


def test_the_job_restores_the_minimum_of_its_ranks_newest_steps() -> None:
    assert fmt.agreed_step(9, lambda s: min(s, 8)) == 8
    assert fmt.agreed_step(None, lambda s: min(s, 8)) is None  # this rank holds none
    assert fmt.agreed_step(9, lambda s: min(s, -1)) is None  # another holds none


def test_a_tree_of_dicts_lists_tuples_and_values_round_trips() -> None:
    state = {"m": {"w": np.ones(2)}, "opt": {"state": {0: {"step": 3}}, "groups": [(0.1, None)]}}
    enc = fmt.encode_tree(state, lambda x: isinstance(x, np.ndarray))
    assert enc is not None and len(enc.leaves) == 1
    back = fmt.decode_tree(msgspec.json.decode(msgspec.json.encode(enc.tree)), lambda i: "w")
    assert back == {"m": {"w": "w"}, "opt": {"state": {0: {"step": 3}}, "groups": [(0.1, None)]}}
    assert fmt.encode_tree({"x": object()}, lambda x: False) is None  # unknown: jax flattens


# --- the store on disk ---------------------------------------------------------------------------


def write(store: LocalStore, step: int, data: bytes = b"x" * 64) -> Manifest:
    return store.write(manifest(step=step, nbytes=len(data)), [memoryview(data)])


def test_the_store_keeps_two_snapshots_and_forgets_a_killed_writers_temporary(
    tmp_path: Path,
) -> None:
    store = LocalStore(tmp_path, rank=1).open()
    for step in (1, 2, 3):
        write(store, step)
    assert store.steps() == [3, 2]
    m, why = store.check(3, ME)
    assert why is None and m is not None and m.crc32 != 0
    torn = store.dir / fmt.tmp_name(4, 999)  # a writer SIGKILLed mid-snapshot
    torn.mkdir()
    (torn / fmt.DATA).write_bytes(b"half")
    assert store.steps() == [3, 2]  # never a candidate
    LocalStore(tmp_path, rank=1).open()  # the next incarnation
    assert not torn.exists()


def test_a_snapshot_past_the_bound_raises_store_full_and_leaves_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, rank=1, max_bytes=1000).open()
    write(store, 1)
    write(store, 2)
    assert 200 < store.usage() < 1000 - 64  # data and manifests
    with pytest.raises(StoreFull, match="full"):
        write(store, 3, b"y" * (1001 - store.usage()))
    assert store.steps() == [2, 1]
    assert [p.name for p in store.dir.iterdir() if p.name.startswith(".")] == []


def test_a_truncated_data_file_is_refused(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, rank=1).open()
    write(store, 5)
    with open(store.dir / fmt.step_name(5) / fmt.DATA, "r+b") as f:
        f.truncate(10)
    m, why = store.check(5, ME)
    assert m is None and why is not None and "torn" in why


# --- snapshots taken and restored ---------------------------------------------------------------


def snapshots(root: Path, **kw: object) -> Snapshots:
    return Snapshots(root, Identity("j", "run1", 3, 1, 0), **kw)  # type: ignore[arg-type]


def test_a_snapshot_restores_identical_values_from_one_buffer(tmp_path: Path) -> None:
    s = snapshots(tmp_path)
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = {"w": w, "b": np.float64(2.5), "step": 4, "groups": [{"lr": 0.1}]}
    assert s.snapshot(4, state)
    w += 100  # training goes on in place: the snapshot holds the copy
    got = s.restore()
    assert got is not None and (got.step, got.source) == (4, "local")
    np.testing.assert_array_equal(got.state["w"], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert got.state["b"] == 2.5 and got.state["step"] == 4 and got.state["groups"][0]["lr"] == 0.1
    assert got.nbytes == 128 and s.stats["snapshots.written"] == 1
    got.state["w"][0, 0] = 99.0  # a private page: the store keeps what it had
    again = s.restore()
    assert again is not None and again.state["w"][0, 0] == 0.0
    s.close()


def test_torch_tensors_and_bfloat16_round_trip(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    s = snapshots(tmp_path)
    sd = {"w": torch.arange(6, dtype=torch.bfloat16), "n": torch.tensor(3)}
    s.snapshot(1, {"model": sd, "opt": {"state": {0: {"step": torch.tensor(2.0)}}}})
    got = s.restore()
    assert got is not None
    assert got.state["model"]["w"].dtype == torch.bfloat16
    assert torch.equal(got.state["model"]["w"], sd["w"])
    assert torch.equal(got.state["opt"]["state"][0]["step"], torch.tensor(2.0))
    s.close()


def test_a_state_it_cannot_snapshot_is_counted_and_training_goes_on(tmp_path: Path) -> None:
    s = snapshots(tmp_path)
    assert not s.snapshot(1, {"f": open})  # not jax-flattenable either
    assert s.stats["snapshots.unsupported"] == 1 and s.errors
    assert s.snapshot(2, {"w": np.ones(2)})
    s.close()


def test_a_full_store_is_counted_and_the_previous_snapshot_still_restores(tmp_path: Path) -> None:
    s = snapshots(tmp_path, max_bytes=3000)
    s.snapshot(1, {"w": np.ones(100)})  # 800 bytes
    s.flush()
    s.snapshot(2, {"w": np.ones(1000)})  # 8000: past the bound
    s.flush()
    assert s.stats["snapshots.store_full"] == 1
    assert "full" in s.errors[-1]
    got = s.restore()
    assert got is not None and got.step == 1
    s.close()


def test_ranks_agree_on_the_newest_step_all_hold(tmp_path: Path) -> None:
    """Two ranks: rank 1 died writing step 3; the job restores step 2, which both hold."""
    ranks = [Snapshots(tmp_path, Identity("j", "run1", 0, 2, r)) for r in (0, 1)]
    for step in (1, 2, 3):
        ranks[0].snapshot(step, {"w": np.full(4, step)})
        ranks[0].flush()
    for step in (1, 2):
        ranks[1].snapshot(step, {"w": np.full(4, step)})
        ranks[1].flush()
    # Each round's values, as the collective would see them (both ranks' words, minimum).
    words: dict[int, list[int]] = {}

    def agree_for(rank: int):  # type: ignore[no-untyped-def]
        calls = iter(range(10))

        def agree(step: int) -> int:
            round_ = next(calls)
            words.setdefault(round_, [])
            words[round_].append(step)
            theirs = {0: 3, 1: 2}[1 - rank] if round_ == 0 else 2
            return min(step, theirs)

        return agree

    got = [ranks[r].restore(agree=agree_for(r)) for r in (0, 1)]
    assert [g.step if g else None for g in got] == [2, 2]
    assert all(g is not None and int(g.state["w"][0]) == 2 for g in got)
    with pytest.raises(ValueError, match="agree"):
        ranks[0].restore()
    for r in ranks:
        r.close()


def test_persistent_copies_are_read_only_when_no_local_step_is_held(tmp_path: Path) -> None:
    local, persist = tmp_path / "local", tmp_path / "persist"
    s = snapshots(local)
    s.snapshot(5, {"w": np.ones(3)})
    s.flush()
    Persister(
        LocalCkpt(local, persist_dir=persist), stats=__import__("collections").Counter()
    ).once()
    got = s.restore()
    assert got is not None and got.source == "local"
    s.close()
    for p in sorted(local.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    again = snapshots(local, persistent=persist)
    got = again.restore()
    assert got is not None and (got.step, got.source) == (5, "persistent")
    again.close()


def test_verify_finds_a_corrupted_byte(tmp_path: Path) -> None:
    s = snapshots(tmp_path)
    s.snapshot(1, {"w": np.zeros(64)})
    s.flush()
    data = s.store.dir / fmt.step_name(1) / fmt.DATA
    raw = bytearray(data.read_bytes())
    raw[3] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="checksum"):
        s.restore(verify=True)
    s.close()


def test_at_a_notice_a_state_from_a_failed_device_is_dropped_the_rest_written(
    tmp_path: Path,
) -> None:
    import threading

    s = snapshots(tmp_path)
    s.snapshot(1, {"w": np.ones(2)})
    assert s.at_notice(devices=["gpu-7"], mine=["gpu-0"]) == 1  # not ours: written
    release, write = threading.Event(), s.store.write

    def slow_write(*args):  # type: ignore[no-untyped-def]
        release.wait(5)
        return write(*args)

    s.store.write = slow_write  # type: ignore[method-assign]
    s.snapshot(2, {"w": np.ones(2)})  # being written (slowly)
    while s._writing is None:
        time.sleep(0.001)
    s.snapshot(3, {"w": np.ones(2)})  # pending behind it
    s.snapshot(4, {"w": np.ones(2)})  # replaces the pending one, never blocks
    assert s.stats["snapshots.superseded"] == 1
    threading.Timer(0.2, release.set).start()
    assert s.at_notice(devices=["gpu-0"], mine=["gpu-0"]) == 2  # ours failed: 4 dropped
    assert s.stats["snapshots.discarded"] == 1 and s.store.steps() == [2, 1]
    s.close()


# --- the agent's side ----------------------------------------------------------------------------


def test_sizes_and_where_the_store_lives() -> None:
    assert parse_size("4GiB") == 4 << 30 and parse_size("512M") == 512 << 20
    assert parse_size("1000") == 1000 and parse_size("0") == 0
    with pytest.raises(ValueError):
        parse_size("lots")
    assert store_path("none", "j", "r", 0) is None
    auto = store_path("auto", "j", "r", 2)
    assert auto is not None and auto.name == "marduk-j-r-2"
    assert store_path("/x/y", "j", "r", 0) == Path("/x/y")


def test_the_store_goes_when_the_job_ends_for_this_member_and_stays_otherwise(
    tmp_path: Path,
) -> None:
    for code, kept in ((70, True), (143, True), (0, False), (71, False), (72, False)):
        ckpt = LocalCkpt(tmp_path / f"s{code}", max_bytes=10)
        assert ckpt.open() and ckpt.path is not None
        write(LocalStore(ckpt.path, rank=1).open(), 1)
        ckpt.remove_if_done(code)
        assert ckpt.path.exists() == kept, code
    empty = LocalCkpt(tmp_path / "empty")
    assert empty.open() and empty.path is not None
    empty.remove_if_done(143)  # nothing in it: gone whatever the exit
    assert not empty.path.exists()
    env = LocalCkpt(tmp_path / "s", max_bytes=10, lineage="L").handoff()
    assert env["MARDUK_LOCAL_CKPT_DIR"] == str(tmp_path / "s")
    assert env["MARDUK_LOCAL_CKPT_MAX_BYTES"] == "10" and env["MARDUK_CKPT_LINEAGE"] == "L"
    assert LocalCkpt(None).handoff() == {}


def test_the_persister_copies_each_ranks_newest_and_measures_its_lag(tmp_path: Path) -> None:
    from collections import Counter

    local, persist = tmp_path / "local", tmp_path / "persist"
    stats: Counter[str] = Counter()
    p = Persister(LocalCkpt(local, persist_dir=persist, persist_interval_s=1.0), stats)
    stores = [LocalStore(local, rank=r).open() for r in (0, 1)]
    for r, store in enumerate(stores):
        for step in (1, 2, 3):
            store.write(
                manifest(step=step, rank=r, created_at=float(step)), [memoryview(b"z" * 64)]
            )
    assert p.lag(10.0) == (3.0, 8.0)  # nothing copied: behind since step 2, the oldest held
    p.once()
    assert sorted(os.listdir(persist)) == ["rank-0", "rank-1"]
    assert LocalStore(persist, rank=1).steps() == [3] and stats["persist.copies"] == 2
    assert p.lag(10.0) == (0.0, 0.0)
    stores[1].write(manifest(step=5, rank=1, created_at=5.0), [memoryview(b"z" * 64)])
    assert p.lag(10.0) == (2.0, 7.0)  # rank 1: step 5 held, step 3 (created at 3) copied


def test_a_jax_pytree_restores_onto_its_shardings(tmp_path: Path) -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    s = snapshots(tmp_path)
    # A NamedTuple (as optax states are) is not a container of ours: jax flattens it.
    from typing import NamedTuple

    class Opt(NamedTuple):
        mu: object
        count: object

    state = {"w": jnp.arange(6.0).reshape(2, 3), "opt": Opt(jnp.ones(3), jnp.int32(4))}
    assert s.snapshot(2, state)
    got = s.restore(like=state)
    assert got is not None and isinstance(got.state["opt"], Opt)
    assert got.state["w"].sharding == state["w"].sharding
    assert jnp.array_equal(got.state["w"], state["w"]) and int(got.state["opt"].count) == 4
    with pytest.raises(ValueError, match="like"):
        s.restore()
    s.close()
