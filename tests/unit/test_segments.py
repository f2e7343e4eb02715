"""NVLink segments (``--segment N``), pure: whole segments of one domain in contiguous node
ranks, spares of the segment's domain, a segment that cannot stay whole leaving whole; the
domain found from NVML's ClusterUUID (synthetic values) or the environment's override."""

from __future__ import annotations

import ctypes

import pytest

from agent.library import devices as found
from agent.supervise.run_config import ConfigError
from marduk.core import membership as rdzv
from marduk.core.drmap import WorkerKey
from marduk.core.policy import Policy
from marduk.core.records import EpochKey
from marduk.wire.protocol import DeviceHealth, Registration, Rendezvous

JOB = EpochKey("j", None)


def rz(*, lo: int = 2, hi: int = 4, segment: int = 2, spare: bool = False) -> Rendezvous:
    return Rendezvous(
        nproc=1,
        min_nodes=lo,
        max_nodes=hi,
        addr="10.0.0.1",
        ports=[40001],
        spare=spare,
        segment=segment,
    )


def cand(replica: str, domain: str, at: float, **kw: object) -> rdzv.Candidate:
    return rdzv.Candidate(WorkerKey("j", replica, 0), rz(**kw), at, domain=domain)  # type: ignore[arg-type]


def key(replica: str) -> WorkerKey:
    return WorkerKey("j", replica, 0)


def names(m: object) -> list[tuple[str, int]]:
    assert m is not None
    return [(x.replica, x.node_rank) for x in m.members]  # type: ignore[attr-defined]


def test_only_whole_segments_of_one_domain_form_in_contiguous_node_ranks() -> None:
    # Domain A has three nodes (one segment of two, one left over), B two (one segment).
    cs = [cand("a1", "A", 1), cand("b1", "B", 2), cand("a2", "A", 3), cand("a3", "A", 4)]
    cs.append(cand("b2", "B", 5))
    m = rdzv.form(1, cs)
    assert names(m) == [("a1", 0), ("a2", 1), ("b1", 2), ("b2", 3)]  # a3 takes no part
    # Without B's second node there is one whole segment, plus a spare node: MIN 2 is enough.
    assert names(rdzv.form(1, cs[:4])) == [("a1", 0), ("a2", 1)]
    assert not rdzv.ready(cs[:4], None, 10.0, 5.0)  # not MAX: waits the join timeout
    assert rdzv.ready(cs, None, 10.0, 5.0)  # MAX in whole segments: at once
    # Plain mode (no --segment) is unchanged: registration order, one domain or not.
    plain = [cand(c.key.replica, c.domain, c.registered_at, segment=0) for c in cs]
    assert names(rdzv.form(1, plain)) == [("a1", 0), ("b1", 1), ("a2", 2), ("a3", 3)]


def test_a_lost_member_takes_a_spare_of_its_segments_domain_never_another() -> None:
    cs = [cand("a1", "A", 1), cand("a2", "A", 2), cand("b1", "B", 3), cand("b2", "B", 4)]
    m = rdzv.form(1, cs)
    spares = [cand("sb", "B", 5, spare=True), cand("sa", "A", 6, spare=True)]
    change = rdzv.replace(m, 2, "j", {key("a2")}, [*cs, *spares], min_nodes=2)  # type: ignore[arg-type]
    assert names(change.membership) == [("a1", 0), ("sa", 1), ("b1", 2), ("b2", 3)]
    assert not change.dropped


def test_a_segment_no_spare_keeps_whole_leaves_whole_and_the_rest_moves_down() -> None:
    cs = [cand("a1", "A", 1), cand("a2", "A", 2), cand("b1", "B", 3), cand("b2", "B", 4)]
    m = rdzv.form(1, cs)
    spares = [cand("sb", "B", 5, spare=True)]  # B's: no use to segment A
    change = rdzv.replace(m, 2, "j", {key("a1")}, [*cs, *spares], min_nodes=2)  # type: ignore[arg-type]
    assert names(change.membership) == [("b1", 0), ("b2", 1)]
    assert {(x.replica, x.node_rank) for x in change.dropped} == {("a1", 0), ("a2", 1)}
    below = rdzv.replace(m, 2, "j", {key("a1"), key("b1")}, cs, min_nodes=2)  # type: ignore[arg-type]
    assert below.membership is None  # no whole segment left: held


def test_grow_takes_whole_segments_only() -> None:
    cs = [cand("a1", "A", 1), cand("a2", "A", 2)]
    m = rdzv.form(1, cs)
    assert m is not None
    from marduk.core import grow

    free = [cand("b1", "B", 3), cand("c1", "C", 4), cand("b2", "B", 5)]
    seen = {c.key: 0.0 for c in free}  # live and heard from since 0: settled by 100
    chosen = grow.joining(m, "j", [*cs, *free], seen, seen, 100.0, 0.0, 1e9, 4)
    assert [c.key.replica for c in chosen] == ["b1", "b2"]  # C's one node is no segment


def reg(replica: str, domain: str, pid: int, **kw: object) -> Registration:
    return Registration(
        job="j",
        replica=replica,
        host=replica,
        devices=[f"{replica}-d0"],
        scope="job",
        pid=pid,
        rendezvous=rz(**kw),  # type: ignore[arg-type]
        nvlink_domain=domain,
    )


def test_the_policy_swaps_within_the_domain_and_status_shows_each_devices_domain() -> None:
    p = Policy()
    for i, (name, domain) in enumerate([("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B")]):
        p.register(reg(name, domain, i + 1), now=1.0)
    p.register(reg("sb", "B", 8, spare=True), now=1.0)
    p.register(reg("sa", "A", 9, spare=True), now=1.0)
    m = p.epochs[JOB].membership
    assert m is not None and [x.replica for x in m.members] == ["a1", "a2", "b1", "b2"]
    assert {d.device: d.nvlink_domain for d in p.device_infos()}["sa-d0"] == "A"
    p.drain(["b1-d0"], "", False, "test", now=2.0)
    m = p.epochs[JOB].membership
    assert m is not None and [x.replica for x in m.members] == ["a1", "a2", "sb", "b2"]
    failed = DeviceHealth(device="a1-d0", state="failed", event_id="e1")
    assert p.on_health(failed, now=3.0).reply.known


def test_a_clusteruuid_is_a_domain_only_once_the_fabric_registered_it() -> None:
    raw = bytes(range(1, 17))
    assert found.fabric_domain(raw, 3, 0) == "01020304-0506-0708-090a-0b0c0d0e0f10"
    assert found.fabric_domain(raw, 1, 0) == ""  # registration in progress
    assert found.fabric_domain(bytes(16), 3, 0) == ""  # no fabric: all zeros
    assert found.fabric_domain(raw, 3, 999) == ""  # NVML says it failed


class FakeNvml:
    """pynvml's fabric calls over synthetic ClusterUUIDs, by GPU UUID."""

    def __init__(self, domains: dict[str, bytes]) -> None:
        self.domains = domains

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> str:
        return uuid.decode()

    from pynvml import c_nvmlGpuFabricInfo_t  # the real struct: filled in through a pointer

    def nvmlDeviceGetGpuFabricInfo(self, handle: str, pointer: object) -> None:
        info = pointer._obj  # type: ignore[attr-defined]  # ctypes.byref's
        info.clusterUuid = (ctypes.c_uint8 * 16)(*self.domains[handle])
        info.state, info.status = 3, 0


def test_the_nodes_domain_is_its_gpus_common_one_and_the_environment_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = bytes([0xA] * 16), bytes([0xB] * 16)
    monkeypatch.delenv(found.NVLINK_DOMAIN, raising=False)
    monkeypatch.setitem(found._nvml_state, "module", FakeNvml({"GPU-1": a, "GPU-2": a, "GPU-3": b}))
    assert found.nvlink_domain(["GPU-1", "GPU-2"]) == found.fabric_domain(a, 3, 0)
    assert found.nvlink_domain(["GPU-1", "GPU-3"]) == ""  # two domains: none
    assert found.nvlink_domain(["host:cpu:0"]) == ""  # no GPU
    monkeypatch.setenv(found.NVLINK_DOMAIN, "rack-7")
    assert found.nvlink_domain(["GPU-1"]) == "rack-7"


def test_the_segment_option_needs_controller_ranks_and_whole_segments() -> None:
    from tests.unit.test_run_config import build

    config = build(replica="n", nnodes="2:4", scope="job", segment=2, devices="g0")
    assert config.opts.rendezvous.segment == 2
    assert config.opts.nvlink_domain == "domain-of-g0"
    plain = build(replica="n", nnodes="2:4", scope="job", devices="g0")
    assert plain.opts.rendezvous.segment == 0
    with pytest.raises(ConfigError, match="multiples of 2"):
        build(replica="n", nnodes="2:3", scope="job", segment=2)
    with pytest.raises(ConfigError, match="--segment needs --nnodes MIN:MAX"):
        build(replica="n", nnodes="2", node_rank=0, segment=2, master_addr="h")
