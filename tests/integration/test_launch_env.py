"""torchrun's contract (agent/supervise/launch.py): each rank's variables, options, log routing. Pure."""

from __future__ import annotations

import pytest

from agent.supervise.cli import node_name, trainer_command
from agent.supervise.launch import (
    PORT_SPAN,
    LaunchError,
    LaunchSpec,
    LogSpec,
    Std,
    parse_endpoint,
    parse_nnodes,
    parse_std,
)
from agent.supervise.ports import port_for_incarnation


def test_rank_variables_match_torchrun() -> None:
    spec = LaunchSpec(nproc_per_node=4, nnodes=2, node_rank=1, master_addr="h0", run_id="j")
    env = spec.env(2, ["a", "b"], restart_count=3, master_port=1234)
    assert env == {
        "RANK": "6",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "6",
        "ROLE_WORLD_SIZE": "8",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "j",
    }


def test_several_ranks_get_one_openmp_thread_unless_the_user_chose() -> None:
    four, one = LaunchSpec(nproc_per_node=4), LaunchSpec(nproc_per_node=1)
    assert four.thread_env({}) == {"OMP_NUM_THREADS": "1"}  # torchrun's default
    assert four.thread_env({"OMP_NUM_THREADS": "8"}) == {}
    assert one.thread_env({}) == {}


def test_split_devices_give_each_rank_its_share_and_cuda_visible_devices() -> None:
    spec = LaunchSpec(nproc_per_node=2, rank_devices="split")
    gpus = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    env = spec.env(1, gpus, 0, 1)
    assert env["MARDUK_DEVICES"] == "GPU-c,GPU-d"
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-c,GPU-d"  # NVIDIA UUIDs as they are
    other = spec.env(1, ["n:gpu:0", "n:gpu:1", "n:gpu:2", "n:gpu:3"], 0, 1)
    assert other["CUDA_VISIBLE_DEVICES"] == "2,3"  # else their ordinals
    assert "CUDA_VISIBLE_DEVICES" not in LaunchSpec(nproc_per_node=2).env(1, gpus, 0, 1)


def test_split_needs_a_multiple_of_the_ranks() -> None:
    with pytest.raises(LaunchError, match="multiple of 4"):
        LaunchSpec(nproc_per_node=4, rank_devices="split").check_devices(["a", "b"])


def test_bad_node_rank_and_elastic_nnodes_are_clear_errors() -> None:
    with pytest.raises(LaunchError, match="not in"):
        LaunchSpec(nnodes=2, node_rank=2)
    assert parse_nnodes("3") == parse_nnodes("3:3") == (3, 3)
    assert parse_nnodes("1:4") == (1, 4)
    with pytest.raises(LaunchError, match="MIN:MAX"):
        parse_nnodes("4:1")


def test_master_port_fixed_free_or_torchruns_default() -> None:
    assert port_for_incarnation(LaunchSpec(master_port=4000), 7) == 4000
    assert port_for_incarnation(LaunchSpec(nnodes=2, node_rank=0), 0) == 29500
    assert LaunchSpec().fixed_port(0) is None
    assert 0 < port_for_incarnation(LaunchSpec(), 0) < 65536


def test_across_nodes_the_coordinator_port_moves_with_the_epoch() -> None:
    """Every node derives the same port from the epoch; the next epoch's never equals the last
    one's (a restarted rank must not reach the old coordinator), and it wraps within the span."""
    nodes = [LaunchSpec(nnodes=3, node_rank=i, master_port=4000) for i in range(3)]
    for epoch in range(40):
        ports = {n.fixed_port(epoch) for n in nodes}
        assert len(ports) == 1
        port = ports.pop()
        assert 4000 <= port < 4000 + PORT_SPAN
        assert port != nodes[0].fixed_port(epoch + 1)
    assert LaunchSpec(nnodes=2).fixed_port(PORT_SPAN + 1) == 29501
    with pytest.raises(LaunchError, match="below"):
        LaunchSpec(nnodes=2, master_port=65535)


def test_rdzv_endpoint() -> None:
    assert parse_endpoint("h0:29400") == ("h0", 29400)
    assert parse_endpoint("h0") == ("h0", None)
    assert parse_endpoint("[::1]:5") == ("::1", 5)
    with pytest.raises(LaunchError):
        parse_endpoint("h0:port")


def test_redirects_and_tee_specs() -> None:
    assert parse_std("3", 2, "--tee") == {0: Std.ALL, 1: Std.ALL}
    assert parse_std("0:1,1:2", 3, "-r") == {0: Std.OUT, 1: Std.ERR, 2: Std.NONE}
    with pytest.raises(LaunchError, match="--tee"):
        parse_std("x", 2, "--tee")


def test_log_routing() -> None:
    logs = LogSpec(
        redirects={0: Std.OUT, 1: Std.NONE},
        tee={0: Std.NONE, 1: Std.ERR},
        local_ranks_filter=frozenset({0}),
        prefix_template="[rank${rank}]:",
    )
    assert not logs.to_console(0, Std.OUT) and logs.to_file(0, Std.OUT)
    assert logs.to_console(0, Std.ERR) and not logs.to_file(0, Std.ERR)
    assert not logs.to_console(1, Std.ERR) and logs.to_file(1, Std.ERR)  # filtered out
    assert logs.prefix(LaunchSpec(nproc_per_node=2, nnodes=2, node_rank=1), 1) == b"[rank3]:"
    assert logs.path("/l/run", 2, 1, Std.ERR) == "/l/run/attempt_2/1/stderr.log"


def test_scripts_run_as_torchrun_runs_them() -> None:
    import sys

    assert trainer_command(["t.py", "--x"], module=False, no_python=False) == [
        sys.executable,
        "t.py",
        "--x",
    ]
    assert trainer_command(["pkg.t"], module=True, no_python=False)[1:] == ["-m", "pkg.t"]
    assert trainer_command(["t.py"], module=False, no_python=True) == ["t.py"]
    assert trainer_command(["python", "t.py"], module=False, no_python=False) == ["python", "t.py"]


def test_node_name_is_a_valid_replica_id() -> None:
    from marduk.wire.subjects import check_replica

    check_replica(node_name())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nnodes", "2"], "--nnodes 2 without --node-rank: the controller assigns"),
        (["--nnodes", "1:4", "--scope", "job"], "--standalone cannot"),
        (["--nproc-per-node", "3", "--devices", "a,b", "--rank-devices", "split"], "multiple of 3"),
        (["--nproc-per-node", "2", "--tee", "x"], "--tee 'x'"),
        (["--rdzv-endpoint", "h0:port"], "the port must be a number"),
        (["--nproc-per-node", "2", "--redirects", "9"], "--redirects '9'"),
        (["--nproc-per-node", "2", "--tee", "7:1"], "--tee '7:1': local rank 7 of 2"),
        (["--nproc-per-node", "abc"], "--nproc-per-node 'abc': a number of ranks"),
        (["--step-regex", "("], "--step-regex '('"),
        (["--nproc-per-node", "2", "--master-addr", "192.0.2.1"], "not an address of this"),
    ],
)
def test_launch_mistakes_are_one_line_and_exit_2(options: list[str], message: str) -> None:
    from tests.conftest import marduk_cli

    r = marduk_cli("agent", "run", "--standalone", *options, "--", "true")
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_listening_sees_a_listening_socket_only() -> None:
    import socket

    from agent.supervise.ports import listening

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert not listening(port)  # bound, not listening
        s.listen()
        assert listening(port)
