"""``build_config``: what ``marduk agent run``'s options mean, checked without the machine (the
look-ups are fakes)."""

from __future__ import annotations

import inspect
import sys
from typing import Any

import pytest

from agent.errors import AgentError
from agent.library.options import Options
from agent.supervise.launch import LaunchSpec, Std
from agent.supervise.run_config import ConfigError, Lookups, RunArgs, build_config


class Fakes:
    def __init__(self, devices: list[str] | None = None, fail: str | None = None) -> None:
        self.devices = devices or []
        self.fail = fail
        self.resolved: dict[str, Any] = {}
        self.checked: list[LaunchSpec] = []
        self.preloaded: list[list[str]] = []
        self.environ: dict[str, str] = {"MARDUK_REPLICA_ID": "from-env"}

    def resolve(self, **kw: Any) -> Options:
        self.resolved = kw
        if self.fail:
            raise AgentError(self.fail)
        return Options(
            job=kw["job"],
            replica=kw["replica_id"] or "",
            worker=kw["worker"],
            devices=kw["devices"] if kw["devices"] is not None else self.devices,
            addr=kw["addr"],
            prefix=kw["prefix"],
            scope=kw["scope"],
            timeout=kw["timeout"],
            incarnation=0,
            epoch=0,
            role=kw["role"],
        )

    def preload(self, cmd: list[str]) -> list[str]:
        self.preloaded.append(cmd)
        return ["jax"]

    def lookups(self) -> Lookups:
        return Lookups(
            node_name=lambda: "host-a",
            resolve=self.resolve,
            check_master=self.checked.append,
            default_preload=self.preload,
            environ=self.environ,
            free_ports=lambda: [41000, 41001],
            nvlink_domain=lambda devices: "domain-of-" + ",".join(devices),
        )


def build(fakes: Fakes | None = None, **kw: Any) -> Any:
    kw.setdefault("cmd", ["python", "train.py"])
    return build_config(RunArgs(**kw), (fakes or Fakes()).lookups())


def test_run_args_has_one_field_per_option_of_agent_run() -> None:
    from agent.supervise.cli import run

    params = set(inspect.signature(run.__wrapped__).parameters)
    assert params == set(RunArgs.__dataclass_fields__)


def test_without_torchrun_options_one_trainer_and_no_launch_contract() -> None:
    fakes = Fakes()
    config = build(fakes, replica="r1", devices="a, b,", max_restarts=4, grace=2.0)
    assert config.launch is None
    assert config.cmd == ["python", "train.py"]
    assert (config.max_restarts, config.grace_s) == (4, 2.0)
    assert config.logs.redirects == {0: Std.NONE} and config.logs.prefix_template is None
    assert fakes.resolved["replica_id"] == "r1"
    assert fakes.resolved["devices"] == ["a", "b"]
    assert fakes.resolved["role"] == "supervisor" and fakes.resolved["worker"] == 0
    assert fakes.checked == []


def test_no_replica_and_no_torchrun_options_leaves_it_to_the_environment() -> None:
    fakes = Fakes()
    build(fakes)
    assert fakes.resolved["replica_id"] is None
    assert fakes.resolved["devices"] is None  # discovered


def test_one_node_torchrun_style_is_named_after_the_host_and_checks_the_master() -> None:
    fakes = Fakes()
    config = build(fakes, nproc_per_node="2")
    assert fakes.resolved["replica_id"] == "host-a"
    assert config.launch == LaunchSpec(nproc_per_node=2, max_restarts=config.max_restarts)
    assert fakes.checked == [config.launch]
    assert config.logs.prefix_template == "[rank${rank}]:"


def test_standalone_is_named_after_the_host_too() -> None:
    fakes = Fakes()
    config = build(fakes, standalone=True)
    assert fakes.resolved["replica_id"] == "host-a"
    assert config.launch is None and config.standalone


def test_across_nodes_the_replica_is_main_and_the_worker_is_the_node_rank() -> None:
    fakes = Fakes()
    config = build(fakes, nnodes="2:2", node_rank=1, master_addr="h0")
    assert fakes.resolved["replica_id"] == "main" and fakes.resolved["worker"] == 1
    assert (config.launch.nnodes, config.launch.node_rank, config.launch.master_addr) == (
        2,
        1,
        "h0",
    )


def test_nnodes_min_max_without_a_node_rank_asks_the_controller_for_ranks() -> None:
    fakes = Fakes()
    config = build(fakes, nnodes="2:4", scope="job", nproc_per_node="2", local_addr="10.0.0.7")
    assert fakes.resolved["replica_id"] == "host-a" and fakes.resolved["worker"] == 0
    launch = config.launch
    assert launch.from_controller and (launch.min_nodes, launch.nnodes) == (2, 4)
    r = config.opts.rendezvous
    assert (r.nproc, r.min_nodes, r.max_nodes, r.node_rank) == (2, 2, 4, None)
    assert (r.addr, r.ports) == ("10.0.0.7", [41000, 41001])
    assert config.require_controller and fakes.checked == []
    placed = launch.placed(3, 1, "10.0.0.5", 39000)
    env = placed.env(1, [], 0, placed.fixed_port(5))
    assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == (
        "3",
        "6",
        "1",
        "3",
    )
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.5", "39000")


def test_a_given_node_rank_goes_to_the_controller_with_a_range() -> None:
    config = build(Fakes(), nnodes="1:3", node_rank=2, scope="job")
    assert config.opts.rendezvous.node_rank == 2 and config.launch.from_controller
    assert config.opts.rendezvous.addr == config.opts.host
    static = build(Fakes(), nnodes="2", node_rank=1)
    assert static.opts.rendezvous is None and not static.launch.from_controller


def test_rdzv_id_names_the_replica_and_the_endpoint_the_master() -> None:
    fakes = Fakes()
    config = build(fakes, rdzv_id="run7", rdzv_endpoint="h1:4000")
    assert fakes.resolved["replica_id"] == "run7"
    assert (config.launch.master_addr, config.launch.master_port) == ("h1", 4000)
    assert config.launch.run_id == "run7"


def test_an_explicit_worker_wins_over_the_node_rank() -> None:
    fakes = Fakes()
    build(fakes, nnodes="2", node_rank=1, worker=5)
    assert fakes.resolved["worker"] == 5


def test_nproc_gpu_is_one_rank_per_device() -> None:
    config = build(Fakes(devices=["g0", "g1", "g2"]), nproc_per_node="gpu")
    assert config.launch.nproc_per_node == 3
    assert build(Fakes(), nproc_per_node="auto").launch.nproc_per_node == 1


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"nnodes": "2"}, "--nnodes 2 without --node-rank: the controller assigns"),
        ({"nnodes": "1:2", "scope": "replica"}, "needs --scope job"),
        ({"nnodes": "1:2", "scope": "job", "standalone": True}, "--standalone cannot"),
        ({"nnodes": "3:2"}, "--nnodes 3:2: MIN:MAX with 1 <= MIN <= MAX"),
        ({"nproc_per_node": "0"}, "--nproc-per-node '0'"),
        ({"nproc_per_node": "x"}, "--nproc-per-node 'x'"),
        ({"step_regex": "("}, "--step-regex '('"),
        ({"redirects": "9"}, "--redirects '9'"),
        ({"nproc_per_node": "2", "tee": "5:1"}, "--tee '5:1': local rank 5 of 2"),
        ({"local_ranks_filter": "a"}, "--local-ranks-filter 'a': local ranks"),
        ({"nnodes": "2:"}, "--nnodes '2:': a number, or MIN:MAX (both given)"),
        ({"nnodes": ":2"}, "--nnodes ':2'"),
        ({"rdzv_endpoint": "h:x"}, "--rdzv-endpoint 'h:x'"),
        ({"nproc_per_node": "2", "rank_devices": "split"}, "--rank-devices split"),
        ({"cmd": []}, "no trainer command given"),
        ({"local_ckpt_max": "lots"}, "--local-ckpt-max: not a size: 'lots'"),
    ],
)
def test_an_option_that_cannot_work_is_one_line_naming_it(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        build(**kw)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_the_local_checkpoint_stores_options_reach_the_config() -> None:
    c = build(local_ckpt_max="2GiB", persist_dir="/p", persist_interval=5.0, ckpt_lineage="L")
    assert (c.local_ckpt_dir, c.local_ckpt_max_bytes) == ("auto", 2 << 30)
    assert (c.persist_dir, c.persist_interval_s, c.ckpt_lineage) == ("/p", 5.0, "L")
    assert build().persist_dir is None and build().local_ckpt_max_bytes == 0


def test_the_resolvers_error_is_reported_as_it_is() -> None:
    with pytest.raises(ConfigError, match=r"^replica_id is required"):
        build(Fakes(fail="replica_id is required (or set MARDUK_REPLICA_ID)"))


def test_no_replica_anywhere_names_the_option_and_its_variable() -> None:
    fakes = Fakes()
    fakes.environ.clear()
    with pytest.raises(ConfigError) as e:
        build(fakes)
    assert str(e.value) == "no replica id: give --replica ID (or set MARDUK_REPLICA_ID)"
    build(fakes, replica="r1")
    build(fakes, nproc_per_node="2")  # torchrun's options: the host name


def test_a_bad_regex_is_reported_before_anything_is_resolved() -> None:
    fakes = Fakes(fail="not this one")
    with pytest.raises(ConfigError, match="--step-regex"):
        build(fakes, step_regex="(")
    assert fakes.resolved == {}


def test_preload_given_or_guessed_from_the_command() -> None:
    fakes = Fakes()
    assert build(fakes).preload == ["jax"]
    assert fakes.preloaded == [["python", "train.py"]]
    assert build(preload="torch, numpy").preload == ["torch", "numpy"]
    assert build(preload="none").preload == []


def test_a_script_runs_with_this_interpreter_as_torchrun_runs_it() -> None:
    assert build(cmd=["t.py", "--x"]).cmd == [sys.executable, "t.py", "--x"]
    assert build(cmd=["pkg.t"], module=True).cmd == [sys.executable, "-m", "pkg.t"]
    assert build(cmd=["t.py"], no_python=True).cmd == ["t.py"]


def test_torchruns_line_prefix_template_from_the_environment() -> None:
    fakes = Fakes()
    fakes.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "${role_name}/${rank}|"
    assert build(fakes, nproc_per_node="2").logs.prefix_template == "${role_name}/${rank}|"
    assert build(Fakes(), nproc_per_node="1").logs.prefix_template is None


def test_a_spare_of_a_pool_registers_under_the_pool_and_a_job_names_the_pool() -> None:
    spare = build(Fakes(), nnodes="1:2", scope="job", spare=True, spare_pool="gpu8")
    assert spare.opts.job == "gpu8"
    r = spare.opts.rendezvous
    assert r is not None and r.spare and r.pool == "gpu8"
    worker = build(Fakes(), job="llama", nnodes="1:2", scope="job", spare_pool="gpu8")
    assert worker.opts.job == "llama" and worker.opts.rendezvous.pool == "gpu8"
    assert build(Fakes(), job="llama", nnodes="1:2", scope="job").opts.rendezvous.pool is None


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"spare": True, "spare_pool": "gpu8", "job": "llama"}, "of no job"),
        ({"spare_pool": "gpu 8"}, "--spare-pool: invalid job name"),
        ({"spare_pool": "gpu8", "nnodes": "2", "node_rank": 1, "scope": "replica"}, "--spare-pool"),
    ],
)
def test_a_pool_option_that_cannot_work_is_refused(kw: dict[str, Any], says: str) -> None:
    kw = {"nnodes": "1:2", "scope": "job", **kw}
    with pytest.raises(ConfigError, match=says):
        build(Fakes(), **kw)


@pytest.mark.parametrize(
    ("kw", "given"),
    [
        ({"spare": True}, "no --nnodes"),
        ({"spare_pool": "gpu8"}, "no --nnodes"),
        ({"spare": True, "nnodes": "1"}, "--nnodes 1: one node on its own"),
        ({"spare": True, "nnodes": "2:2", "node_rank": 1, "scope": "job"}, "--node-rank 1"),
    ],
)
def test_a_spare_without_ranks_from_the_controller_is_told_so_first(
    kw: dict[str, Any], given: str
) -> None:
    # No --replica either: the spare's own mistake is the one to name, not the environment's.
    fakes = Fakes(fail="not this one")
    fakes.environ.clear()
    with pytest.raises(ConfigError) as e:
        build(fakes, **kw)
    option = "--spare" if kw.get("spare") else "--spare-pool"
    assert str(e.value) == (
        f"{option} needs ranks from the controller: --nnodes MIN:MAX without --node-rank, "
        f"with --scope job (given: {given})"
    )


def test_an_empty_spare_pool_is_refused_not_ignored() -> None:
    with pytest.raises(ConfigError, match=r"^--spare-pool '': name the pool"):
        build(Fakes(), nnodes="1:2", scope="job", spare_pool="")


def test_nnodes_one_to_one_without_a_node_rank_asks_the_controller_as_the_help_says() -> None:
    # Two agents of one job with --nnodes 1:1 ran rank 0 of world 1 each: now the controller
    # assigns the one node rank (a second agent is beyond MAX: it holds, as a spare does).
    launch = build(Fakes(), nnodes="1:1", scope="job").launch
    assert launch.from_controller and (launch.min_nodes, launch.nnodes) == (1, 1)
    with pytest.raises(ConfigError, match=r"--nnodes 1:1 without --node-rank.*--scope job"):
        build(Fakes(), nnodes="1:1")
    assert build(Fakes(), nnodes="1:1", spare=True, scope="job").opts.rendezvous.spare
    # Given a node rank, or --nnodes 1 (the default), it is one node on its own.
    assert not build(Fakes(), nnodes="1:1", node_rank=0).launch.from_controller
    assert not build(Fakes(), nnodes="1").launch.from_controller
