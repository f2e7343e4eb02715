"""``marduk monitor run``: the host daemon (one per accelerator node), as a typer command.

``app`` is a standalone one-command typer app (tests and ``python -m``-style use); the CLI root
mounts the function itself: ``monitor_app.command("run")(run_cli.run)``.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Annotated, Any

import typer
from rich.console import Console

from marduk.errors import MardukError
from marduk.shell import options
from marduk.shell.logs import setup_logging
from marduk.shell.runtime import run as run_loop
from monitor_cli.daemon import DaemonSettings, MonitorDaemon, default_host

app = typer.Typer(add_completion=False)
err = Console(stderr=True, highlight=False, soft_wrap=True)
log = logging.getLogger("monitor_cli.run")

PROBES = ("nvml", "tpu", "node", "dcgm", "gce")
EXIT_ERROR = 1
EXIT_USAGE = 2
_HOST_RE = re.compile(r"\A[\x21-\x7e]{1,200}\Z")


class UsageError(MardukError):
    """Options that cannot work together (exit 2)."""


def detect_probes() -> list[str]:
    """The probes that can run on this host, for the default ``--probe`` list."""
    from monitor_cli.probes.nvml import NvmlUnavailable, load_nvml
    from monitor_cli.probes.tpu import tpu_visible

    found = []
    try:
        if load_nvml().nvmlDeviceGetCount() > 0:
            found.append("nvml")
    except (NvmlUnavailable, Exception) as e:
        log.debug("nvml probe not available: %s", e)
    if tpu_visible():
        found.append("tpu")
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.environ.get("NODE_NAME"):
        found.append("node")
    # dcgm-exporter and the GCE metadata server are opt-in (--probe dcgm / --probe gce, or
    # their URL variables): guessing would poll addresses this host may not have.
    if os.environ.get("MARDUK_DCGM_URL"):
        found.append("dcgm")
    if os.environ.get("MARDUK_GCE_METADATA_URL"):
        found.append("gce")
    return found


def build_probes(
    names: list[str],
    *,
    host: str,
    interval: float,
    xid_hold: float,
    tpu_chips: int | None,
    tpu_runtime_addr: str | None,
    node_name: str | None,
    node_api: str | None,
    host_devices: Any,
    dcgm_url: str | None = None,
    gce_metadata_url: str | None = None,
) -> list[Any]:
    """Probe objects for ``names``; a probe that cannot run here raises ``MardukError``."""
    probes: list[Any] = []
    for name in names:
        if name == "nvml":
            from monitor_cli.probes.nvml import HealthProbe, XidProbe, load_nvml

            nvml = load_nvml()
            probes.append(HealthProbe(nvml, interval_s=interval, hold_s=xid_hold))
            probes.append(XidProbe(nvml, hold_s=xid_hold))
        elif name == "tpu":
            from monitor_cli.probes.tpu import TpuInfoRuntime, TpuProbe, TpuUnavailable, tpu_visible

            if not tpu_visible() and not tpu_chips:
                raise TpuUnavailable(
                    "no TPU chip on this host (no /dev/accel*, /dev/vfio/<n> or TPU PCI device)"
                )
            runtime = TpuInfoRuntime(tpu_runtime_addr) if tpu_runtime_addr else None
            probes.append(
                TpuProbe(host, interval_s=interval, expected_chips=tpu_chips, runtime=runtime)
            )
        elif name == "node":
            from monitor_cli.probes.node import NodeApi, NodeProbe

            api = NodeApi(node_api) if node_api else NodeApi.in_cluster()
            probes.append(NodeProbe(node_name or "", host_devices, api, interval_s=interval))
        elif name == "dcgm":
            from monitor_cli.probes.dcgm import DEFAULT_URL, DcgmExporterProbe

            probes.append(DcgmExporterProbe(dcgm_url or DEFAULT_URL, interval_s=max(interval, 1.0)))
        elif name == "gce":
            from monitor_cli.probes.gce import GceMetadataProbe

            probes.append(GceMetadataProbe(host_devices, base_url=gce_metadata_url))
    return probes


def _one_line(text: str) -> str:
    return " ".join(text.split())


HELP = """Run the host's health probes and publish what they find as device health events.

One daemon per accelerator node (deploy/k8s/monitor-daemonset.yaml). Each probe reports
conditions; an event goes out when a condition starts (state: the device's worst), when a
device's worst state changes, and `healthy` when its last condition clears — never on an
unchanged interval. Events are published durably and in order; while NATS is away they queue
and go out when it is back.

Probes (default: every one that can run here):

nvml — NVIDIA GPUs through NVML, keyed by NVML UUID. XID events: 48, 61, 62, 64, 74, 79, 94,
95, 119, 120, 140 are failed (restart the trainers); 13, 31, 43 (usually the application), 63,
92 and unknown XIDs are degraded; 45 is ignored; each holds --xid-hold seconds. Polled: GPU
lost and row-remap failure are failed; new uncorrectable ECC errors failed for --xid-hold;
a pending row remap and HW slowdown / thermal / power-brake throttling are degraded.

tpu — TPU chips of this host (/dev/accel*, /dev/vfio/<n>), ids <host>:tpu:<n>: a chip that
disappears, or fewer than --tpu-chips, is failed. With --tpu-runtime-addr, libtpu's runtime
metrics (tpu-info) too. A crashed TPU runtime is visible only to the agent, not here.

node — the Kubernetes node (in-cluster API, NODE_NAME): not Ready and the not-ready /
unreachable taints are failed for every device of the host; memory, disk, PID pressure and
NetworkUnavailable degraded; autoscaler / Karpenter removal taints preempting.

dcgm — scrape dcgm-exporter (--dcgm-url) by the UUID label: XID, uncorrectable ECC and
row-remap failure failed; pending remaps degraded. Opt-in.

gce — the GCE metadata server's maintenance-event and preempted keys (long-polled): a
maintenance or preemption notice is preempting for every device of the host. Opt-in.
"""


@app.command(help=HELP)
@options.connection_options
def run(
    probe: Annotated[
        list[str] | None,
        typer.Option(
            "--probe",
            "-p",
            help="nvml, tpu or node; repeat for several (default: those that can run here).",
            show_default=False,
        ),
    ] = None,
    devices: Annotated[
        str | None,
        typer.Option(
            "--devices",
            envvar="MARDUK_DEVICES",
            help="This host's device ids, comma-separated, as agents register them (default: "
            "those the probes find). Host-wide conditions (node) name these.",
            show_default=False,
        ),
    ] = None,
    host: Annotated[
        str | None,
        typer.Option(
            "--host",
            envvar="MARDUK_HOST",
            help="Host name in events' source (<probe>@<host>) and TPU ids (default: NODE_NAME, "
            "else this machine's name).",
            show_default=False,
        ),
    ] = None,
    interval: Annotated[
        float,
        typer.Option(
            "--interval", envvar="MARDUK_MONITOR_INTERVAL", help="Seconds between polls.", min=0.05
        ),
    ] = 10.0,
    xid_hold: Annotated[
        float,
        typer.Option(
            "--xid-hold",
            help="Seconds an XID (or new ECC errors) stays a condition after it last occurred.",
            min=0.0,
        ),
    ] = 300.0,
    clear_after: Annotated[
        float,
        typer.Option(
            "--clear-after",
            envvar="MARDUK_MONITOR_CLEAR_AFTER",
            help="Seconds a condition must stay absent before its device is reported healthy "
            "(damps flapping).",
            min=0.0,
        ),
    ] = 30.0,
    report_probe_errors: Annotated[
        bool,
        typer.Option(
            "--report-probe-errors",
            help="Report a probe that keeps failing as `degraded` on every device of the host "
            "(default: log and count only).",
        ),
    ] = False,
    tpu_chips: Annotated[
        int | None,
        typer.Option(
            "--tpu-chips",
            help="TPU chips this host must have (default: as many as first seen).",
            min=1,
        ),
    ] = None,
    tpu_runtime_addr: Annotated[
        str | None,
        typer.Option(
            "--tpu-runtime-addr",
            help="libtpu runtime metrics (HOST:PORT, e.g. localhost:8431) to read with tpu-info; "
            "reachable only from the trainer's network namespace.",
            show_default=False,
        ),
    ] = None,
    node_name: Annotated[
        str | None,
        typer.Option(
            "--node-name", envvar="NODE_NAME", help="Kubernetes node to watch.", show_default=False
        ),
    ] = None,
    node_api: Annotated[
        str | None,
        typer.Option(
            "--node-api",
            envvar="MARDUK_NODE_API",
            help="Kubernetes API URL without the service account (e.g. http://127.0.0.1:8001 "
            "behind kubectl proxy); default: in-cluster.",
            show_default=False,
        ),
    ] = None,
    dcgm_url: Annotated[
        str | None,
        typer.Option(
            "--dcgm-url",
            envvar="MARDUK_DCGM_URL",
            help="dcgm-exporter's /metrics (probe dcgm) [default: http://localhost:9400/metrics].",
            show_default=False,
        ),
    ] = None,
    gce_metadata_url: Annotated[
        str | None,
        typer.Option(
            "--gce-metadata-url",
            envvar="MARDUK_GCE_METADATA_URL",
            help="GCE metadata server (probe gce) [default: http://metadata.google.internal].",
            show_default=False,
        ),
    ] = None,
    addr: options.Addr = options.DEFAULTS["addr"],
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout", help="Seconds one publish may take (stored and decided) before a retry."
        ),
    ] = 10.0,
    json_logs: options.JsonLogs = False,
    log_level: options.LogLevel = "info",
) -> None:
    try:
        daemon = _daemon(
            probe or [],
            devices=devices,
            host=host,
            interval=interval,
            xid_hold=xid_hold,
            clear_after=clear_after,
            report_probe_errors=report_probe_errors,
            tpu_chips=tpu_chips,
            tpu_runtime_addr=tpu_runtime_addr,
            node_name=node_name,
            node_api=node_api,
            dcgm_url=dcgm_url,
            gce_metadata_url=gce_metadata_url,
            addr=addr,
            prefix=prefix,
            timeout=timeout,
        )
    except UsageError as e:
        err.print(f"[red]error:[/red] {_one_line(str(e))}")
        raise typer.Exit(EXIT_USAGE) from None
    except MardukError as e:
        err.print(f"[red]error:[/red] {_one_line(str(e))}")
        raise typer.Exit(EXIT_ERROR) from None
    setup_logging(json_logs=json_logs, level=log_level)
    try:
        run_loop(daemon.run())
    except MardukError as e:
        err.print(f"[red]error:[/red] {_one_line(str(e))}")
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _daemon(
    names: list[str],
    *,
    devices: str | None,
    host: str | None,
    interval: float,
    xid_hold: float,
    clear_after: float,
    report_probe_errors: bool,
    tpu_chips: int | None,
    tpu_runtime_addr: str | None,
    node_name: str | None,
    node_api: str | None,
    addr: str,
    prefix: str,
    timeout: float,
    dcgm_url: str | None = None,
    gce_metadata_url: str | None = None,
) -> MonitorDaemon:
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        raise UsageError(f"unknown probe {unknown[0]!r}: choose from {', '.join(PROBES)}")
    host = host or default_host()
    if not _HOST_RE.match(host):
        raise UsageError(f"--host {host!r} must be printable, without spaces")
    device_list = [d.strip() for d in devices.split(",") if d.strip()] if devices else None
    if device_list is not None:
        bad = [d for d in device_list if not _HOST_RE.match(d)]
        if bad:
            raise UsageError(f"device id {bad[0]!r} must be printable, without spaces")
    names = list(dict.fromkeys(names))
    if not names:
        names = detect_probes()
        # A URL given for an opt-in probe asks for it, as its variable does in detect_probes.
        for probe, url in (("dcgm", dcgm_url), ("gce", gce_metadata_url)):
            if url and probe not in names:
                names.append(probe)
    if not names:
        raise MardukError(
            "no probe can run here: no NVML GPU, no TPU chip, not a Kubernetes pod with "
            "NODE_NAME, no --dcgm-url or --gce-metadata-url; name one with --probe"
        )
    if "node" in names and not node_name:
        raise UsageError("the node probe needs the node's name: --node-name or NODE_NAME")
    holder: list[MonitorDaemon] = []
    probes = build_probes(
        names,
        host=host,
        interval=interval,
        xid_hold=xid_hold,
        tpu_chips=tpu_chips,
        tpu_runtime_addr=tpu_runtime_addr,
        node_name=node_name,
        node_api=node_api,
        host_devices=lambda: holder[0].host_devices() if holder else [],
        dcgm_url=dcgm_url,
        gce_metadata_url=gce_metadata_url,
    )
    settings = DaemonSettings(
        addr=addr,
        prefix=prefix,
        host=host,
        devices=device_list,
        publish_timeout_s=timeout,
        clear_after_s=clear_after,
        probe_error_state="degraded" if report_probe_errors else None,
    )
    holder.append(MonitorDaemon(probes, settings))
    return holder[0]
