"""`marduk monitor run` end to end: a probe condition -> the right replica restarts -> the
condition clears -> the device is healthy again. Real CLI, controller, agent and HTTP source."""

from __future__ import annotations

import http.server
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.conftest import eventually_sync
from tests.processes import Proc, agent_run, controller, status

pytestmark = pytest.mark.e2e
GPU = "GPU-8e1a4c2b-5f3d-4a9e-b1c7-2d6f0e9a8b31"
TEMPLATE = (
    "# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.\n"
    "# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n"
    'DCGM_FI_DEV_XID_ERRORS{{gpu="0",UUID="{gpu}",modelName="NVIDIA H100",Hostname="n1"}} {xid}\n'
)


@pytest.fixture
def exporter() -> Iterator[dict[str, object]]:
    """A dcgm-exporter stand-in whose last XID the test sets."""
    state: dict[str, object] = {"xid": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = TEMPLATE.format(gpu=GPU, xid=state["xid"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    yield state
    server.shutdown()


def test_a_dcgm_xid_restarts_the_replica_and_clears(
    env: dict[str, str], exporter: dict[str, object]
) -> None:
    ctl = controller(env)
    agent = agent_run(
        env, "--replica", "r1", "--devices", f"{GPU},GPU-other",
        cmd=[sys.executable, "tests/trainers/toy.py", "--step-seconds", "0.05"],
    )  # fmt: skip
    monitor = Proc(
        [
            sys.executable, "-m", "marduk", "monitor", "run", "--probe", "dcgm",
            "--dcgm-url", str(exporter["url"]), "--interval", "0.2", "--clear-after", "0.5",
            "--host", "n1",
        ],
        env,
    )  # fmt: skip
    try:
        agent.expect("START r1/0 epoch=0")
        exporter["xid"] = 79  # fallen off the bus
        agent.expect("START r1/0 epoch=1", timeout=30)
        eventually_sync(
            lambda: {d["device"]: d["state"] for d in status(env)["devices"]}.get(GPU) == "failed"
        )
        exporter["xid"] = 0
        eventually_sync(
            lambda: {d["device"]: d["state"] for d in status(env)["devices"]}.get(GPU) == "healthy",
            timeout=30,
        )
        assert monitor.proc.poll() is None and "Traceback" not in "".join(monitor.all)
    finally:
        monitor.stop()
        agent.stop()
        ctl.stop()
